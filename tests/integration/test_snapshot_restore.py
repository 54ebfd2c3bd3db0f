"""Pods restored from per-shape snapshots, through the real socket with real guests.

The first pod of a shape cold-boots and its snapshot is made in the background; later pods of that
shape are restored from it and made their own by the agent (hostname, the pod's NIC with its MAC,
addresses and routes, the clock, a reseeded random pool, a new agent instance). A corrupt snapshot
is refused, logged, dropped, and the pod cold-boots; a shim killed at each step of a restore
leaves nothing behind once it starts again.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import libvirt
import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from tests.integration.cni_kit import cni_env, require_cni
from tests.integration.state_check import assert_consistent, read_ledger, vmsandbox_free_baseline
from tests.shim_kit import (
    LIBVIRT_URI,
    SNAPSHOT_HANDLER,
    Shim,
    container,
    exit_code,
    pod,
    q,
    require_host,
    run_to_exit,
    start_shim,
    stop_shim,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.exclusive]

RPC_TIMEOUT = 120
SNAPSHOT_WAIT_S = 180
PROBE = (
    "cat /proc/sys/kernel/random/boot_id; head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'; echo; "
    "hostname; date +%s; cat /sys/class/misc/hw_random/rng_current; "
    "cat /sys/class/net/eth0/address 2>/dev/null || echo no-nic; "
    "ip -4 -o addr show dev eth0 2>/dev/null | awk '{print $4}'"
)


def snap_pod(name: str, hostname: str = "", log_directory: Path | None = None) -> pb.PodSandboxConfig:
    config = pod(name, containers=[("app", q({"cpu": "1", "memory": "64Mi"}))])
    config.hostname = hostname
    if log_directory is not None:
        log_directory.mkdir()
        config.log_directory = str(log_directory)
    return config


def run(shim: Shim, config: pb.PodSandboxConfig) -> str:
    request = pb.RunPodSandboxRequest(config=config, runtime_handler=SNAPSHOT_HANDLER)
    return str(shim.runtime.RunPodSandbox(request, timeout=RPC_TIMEOUT).pod_sandbox_id)


def remove(shim: Shim, sandbox_id: str) -> None:
    shim.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=RPC_TIMEOUT)
    shim.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=RPC_TIMEOUT)


def snapshots(state_dir: Path) -> list[Path]:
    root = state_dir / "snapshots"
    return sorted(d for d in root.glob("*") if re.fullmatch(r"[0-9a-f]{64}", d.name) and (d / "inputs.json").exists())


def started_by(shim: Shim, sandbox_id: str) -> dict[str, str]:
    """How the sandbox's guest was started, as its record says (``guest.start``)."""
    state, record = read_ledger(shim.state_dir).rows[sandbox_id]
    assert state == "SANDBOX_READY"
    return dict(record["guest"]["start"])


def wait_for_snapshot(shim: Shim) -> Path:
    deadline = time.monotonic() + SNAPSHOT_WAIT_S
    while not snapshots(shim.state_dir):
        assert time.monotonic() < deadline, f"no snapshot made\n{shim.log_text()[-4000:]}"
        time.sleep(0.5)
    (made,) = snapshots(shim.state_dir)
    return made


def seed_snapshot(shim: Shim) -> Path:
    """The first pod of the shape cold-boots and has its snapshot made once it is READY."""
    first = run(shim, snap_pod("seed"))
    assert started_by(shim, first)["by"] == "boot"
    made = wait_for_snapshot(shim)
    remove(shim, first)
    return made


def probe(shim: Shim, sandbox_id: str, config: pb.PodSandboxConfig) -> list[str]:
    c = container("app", q({"cpu": "1", "memory": "64Mi"}))
    c.command.extend(["sh", "-c", PROBE])
    c.log_path = "app.log"
    return [text for _, text in run_to_exit(shim, sandbox_id, config, c)]


@pytest.fixture(scope="module")
def cni_shim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shim]:
    require_host()
    require_cni()
    tmp = tmp_path_factory.mktemp("snap")
    (tmp / "cni").mkdir()
    with cni_env(tmp / "cni", bridge="vmsbr-snap0", subnet="10.232.0.0/24") as env:
        shim = start_shim(tmp, extra_config=env.shim_config())
        try:
            yield shim
        finally:
            try:
                for s in shim.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items:
                    remove(shim, s.id)
            finally:
                stop_shim(shim)
                shutil.rmtree(tmp, ignore_errors=True)


def test_restored_pods_are_each_their_own(cni_shim: Shim, tmp_path: Path) -> None:
    shim = cni_shim
    made = seed_snapshot(shim)
    inputs = json.loads((made / "inputs.json").read_text())["inputs"]
    assert inputs["nic"] == "ethernet" and inputs["vcpus"] >= 1 and inputs["qemu_version"]

    seen = {}
    for name in ("clone-a", "clone-b"):
        config = snap_pod(name, hostname=f"host-{name}", log_directory=tmp_path / name)
        sid = run(shim, config)
        assert started_by(shim, sid) == {"by": "restore", "snapshot": made.name}, shim.log_text()[-3000:]
        status = shim.runtime.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=sid), timeout=30).status
        assert status.state == pb.SANDBOX_READY
        record = read_ledger(shim.state_dir).rows[sid][1]
        mac = record["network"]["nic"]["mac"]
        assert record["guest"]["hostname"] == f"host-{name}"  # the guest's own word, after personalize
        lines = probe(shim, sid, config)
        boot_id, random, hostname, clock, hwrng, guest_mac, address = lines[:7]
        assert hostname == f"host-{name}"
        assert abs(int(clock) - time.time()) < 30, f"guest clock {clock} vs host {time.time():.0f}"
        assert hwrng.startswith("virtio_rng"), hwrng  # the guest's /dev/hwrng is the virtio-rng device
        assert guest_mac == mac  # the NIC carries the pod's MAC, not the snapshot's
        assert address.split("/")[0] == status.network.ip and status.network.ip.startswith("10.232.0.")
        assert record["guest"]["instance"] != ""
        seen[name] = (boot_id, random, status.network.ip, mac, record["guest"]["instance"])
    a, b = seen["clone-a"], seen["clone-b"]
    for what, x, y in zip(("boot id", "random bytes", "IP", "MAC", "agent instance"), a, b, strict=True):
        assert x != y, f"two restored pods share their {what}: {x}"
    for s in shim.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items:
        remove(shim, s.id)  # both ran side by side; the host has two CPUs for the next test


def test_a_host_network_pod_restores_from_a_snapshot_of_its_own_kind(cni_shim: Shim, tmp_path: Path) -> None:
    """Host-network pods have QEMU's user-mode NIC, whose state is saved with the guest: their
    snapshot is another (NIC kind in the key), and a restored one carries the pod's MAC and address."""
    shim = cni_shim
    before = set(snapshots(shim.state_dir))

    def host_pod(name: str) -> pb.PodSandboxConfig:
        config = snap_pod(name, hostname=name, log_directory=tmp_path / name)
        config.linux.security_context.namespace_options.network = pb.NODE
        return config

    first = run(shim, host_pod("host-seed"))
    assert started_by(shim, first)["by"] == "boot"
    deadline = time.monotonic() + SNAPSHOT_WAIT_S
    while not (set(snapshots(shim.state_dir)) - before):
        assert time.monotonic() < deadline, shim.log_text()[-3000:]
        time.sleep(0.5)
    (made,) = set(snapshots(shim.state_dir)) - before
    assert json.loads((made / "inputs.json").read_text())["inputs"]["nic"] == "user"
    remove(shim, first)
    config = host_pod("host-clone")
    sid = run(shim, config)
    assert started_by(shim, sid) == {"by": "restore", "snapshot": made.name}, shim.log_text()[-3000:]
    mac = read_ledger(shim.state_dir).rows[sid][1]["network"]["nic"]["mac"]
    lines = probe(shim, sid, config)
    assert lines[2] == "host-clone" and lines[5] == mac and lines[6] == "10.0.2.15/24", lines
    remove(shim, sid)


def test_a_corrupt_snapshot_is_refused_and_the_pod_cold_boots(cni_shim: Shim) -> None:
    shim = cni_shim
    ethernet = [d for d in snapshots(shim.state_dir) if '"nic": "ethernet"' in (d / "inputs.json").read_text()]
    made = ethernet[0] if ethernet else seed_snapshot(shim)
    image = made / "image.save"
    with open(image, "r+b") as f:  # keep the header, cut the guest's state short
        f.truncate(200 * 1024)
    sid = run(shim, snap_pod("after-corruption"))
    assert started_by(shim, sid)["by"] == "boot"
    text = shim.log_text()
    assert f"restore from snapshot {made.name[:12]} failed, cold-booting instead" in text, text[-3000:]
    assert "truncated" in text or "libvirt restore" in text or "restore:" in text
    assert not made.exists()  # dropped: the next pod of the shape makes it again
    # no restore copy is left, nor a spare copy of the dropped snapshot (other snapshots keep theirs)
    left = [p.name for p in (shim.state_dir / "snapshots" / "restore").glob("*")]
    assert [n for n in left if not n.startswith("spare-") or made.name in n] == [], left
    remove(shim, sid)


def test_a_snapshot_being_made_gives_way_to_a_pod_that_needs_its_cpu(tmp_path: Path) -> None:
    """The host hands out two CPUs: a first pod cold-boots and its snapshot's guest takes the other
    one; a second pod does not fit beside both, so the making stops (its guest removed, its claim
    released) and the pod boots. Pods come first; the snapshot is made again later."""
    require_host()
    shim = start_shim(tmp_path)
    try:
        first = run(shim, snap_pod("first"))
        assert started_by(shim, first)["by"] == "boot"
        deadline = time.monotonic() + SNAPSHOT_WAIT_S
        while "booting its guest" not in shim.log_text():
            assert time.monotonic() < deadline, shim.log_text()[-3000:]
            time.sleep(0.2)
        second = run(shim, snap_pod("second"))
        text = shim.log_text()
        assert "giving way to a pod that does not fit beside it" in text, text[-3000:]
        assert started_by(shim, second)["by"] == "boot"
        conn = libvirt.open(LIBVIRT_URI)
        try:
            making = [d.name() for d in conn.listAllDomains() if d.name().startswith("vmsnapshot-")]
        finally:
            conn.close()
        assert making == [], making  # the snapshot's guest is gone, and none fits beside the two pods
        assert snapshots(shim.state_dir) == []
        for sid in (first, second):
            remove(shim, sid)
    finally:
        stop_shim(shim)


def test_a_pod_that_fits_without_the_snapshot_is_not_refused_while_its_guest_boots(tmp_path: Path) -> None:
    """Two host CPUs: the first pod holds one and the snapshot of its shape, once its guest is
    running, the other. A second pod fits only without the snapshot: it is placed (its guest removed,
    its claim released before the pod is placed), in much less than the making's boot timeout."""
    require_host()
    before = set(snapshot_domains())
    shim = start_shim(tmp_path)
    try:
        first = run(shim, snap_pod("first"))
        assert started_by(shim, first)["by"] == "boot"
        deadline = time.monotonic() + SNAPSHOT_WAIT_S
        # the snapshot's guest runs on the other CPU: it is paused as soon as it exists, so the making
        # still waits for its agent when the second pod asks (on a fast host it could be saved first)
        while not (making := set(snapshot_domains()) - before):
            assert time.monotonic() < deadline, shim.log_text()[-3000:]
            assert not snapshots(shim.state_dir), "the snapshot was made before the test could ask"
            time.sleep(0.02)
        pause_domains(making)
        assert not snapshots(shim.state_dir), "the snapshot was made before the test could pause its guest"
        held = read_ledger(shim.state_dir).claims
        assert len(held) == 2 and first in held, held  # the pod's claim and the snapshot's
        started = time.monotonic()
        second = run(shim, snap_pod("second"))
        took = time.monotonic() - started
        text = shim.log_text()
        assert "giving way to a pod that does not fit beside it" in text, text[-3000:]
        assert started_by(shim, second)["by"] == "boot"
        assert took < 60, f"the pod waited {took:.1f} s for the snapshot to give way"
        assert set(snapshot_domains()) <= before
        assert set(read_ledger(shim.state_dir).claims) == {first, second}
        for sid in (first, second):
            remove(shim, sid)
    finally:
        stop_shim(shim)


# -- kill -9 during a restore ------------------------------------------------------------------
# with the shape's snapshot there, RunPodSandbox defines the pod's domain for its restore
RESTORE_POINTS = (
    "RunPodSandbox:define",
    "restore:after-stage",
    "restore:after-restore",
    "restore:after-personalize",
)


@pytest.fixture(scope="module")
def crash_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, int]]:
    require_host()
    tmp = tmp_path_factory.mktemp("snapcrash")
    baseline = vmsandbox_free_baseline()
    shim = start_shim(tmp)
    try:
        seed_snapshot(shim)
    finally:
        stop_shim(shim)
    try:
        yield tmp, baseline
    finally:
        shim = start_shim(tmp)
        try:
            for s in shim.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items:
                remove(shim, s.id)
        finally:
            stop_shim(shim)
            shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.parametrize("point", RESTORE_POINTS)
def test_kill_9_during_restore_leaves_nothing_behind(crash_dir: tuple[Path, int], point: str) -> None:
    tmp, baseline = crash_dir
    shim = start_shim(tmp, env={"VMSANDBOX_FAULT": point})
    try:
        with pytest.raises(grpc.RpcError) as err:
            run(shim, snap_pod(f"crash-{point.split(':')[1]}"))
    finally:
        code = exit_code(shim, 60)
    assert code == -signal.SIGKILL, shim.log_text()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert f"fault injection: SIGKILL at {point}" in shim.log_text()

    after = start_shim(tmp)
    try:
        led = assert_consistent(tmp / "state", baseline)
        assert led.rows == {} and led.claims == {}, led
        assert list((tmp / "state" / "snapshots" / "restore").glob("*")) == []
        # the snapshot is still whole: the next pod restores from it
        sid = run(after, snap_pod("after-crash"))
        assert started_by(after, sid)["by"] == "restore", after.log_text()[-3000:]
        remove(after, sid)
        assert_consistent(tmp / "state", baseline)
    finally:
        stop_shim(after, kill=True)


# -- made ahead of time -------------------------------------------------------------------------
MANIFEST = """apiVersion: v1
kind: Pod
metadata: {name: ahead, namespace: test}
spec:
  containers:
  - name: app
    image: busybox
    resources: {limits: {cpu: "1", memory: 64Mi}}
"""


def test_a_snapshot_made_by_the_admin_command_is_what_pods_restore_from(tmp_path: Path) -> None:
    """``vmsandbox snapshot make`` (shim stopped) computes the same key as the shim does for a pod
    of that manifest, with progress; ``list`` shows it, the pod restores from it, ``remove`` drops it."""
    require_host()
    shim = start_shim(tmp_path)  # writes the configuration the command reads
    stop_shim(shim)
    config = str(tmp_path / "config.yaml")
    (tmp_path / "pod.yaml").write_text(MANIFEST)
    cli = [sys.executable, "-m", "cli.main"]
    made = subprocess.run(
        [*cli, "snapshot", "make", str(tmp_path / "pod.yaml"), "--config", config, "--handler", SNAPSHOT_HANDLER,
         "--format", "json"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert "snapshot: booting a 1 vCPU" in made.stderr and "snapshot: saved" in made.stderr
    key = json.loads(made.stdout)["key"]
    listed = subprocess.run([*cli, "snapshot", "list", "--config", config, "--format", "json"], capture_output=True,
                            text=True, timeout=60, check=True)  # fmt: skip
    assert [s["key"] for s in json.loads(listed.stdout)] == [key]
    assert read_ledger(tmp_path / "state").claims == {}  # what the command claimed to boot on is released

    shim = start_shim(tmp_path)
    try:
        sid = run(shim, snap_pod("ahead"))
        assert started_by(shim, sid) == {"by": "restore", "snapshot": key}, shim.log_text()[-3000:]
        remove(shim, sid)
    finally:
        stop_shim(shim)
    gone = subprocess.run([*cli, "snapshot", "remove", key[:10], "--config", config], capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip
    assert gone.returncode == 0 and f"removed {key}" in gone.stdout, gone.stderr
    assert snapshots(tmp_path / "state") == []


# -- kill -9 while a snapshot is made -----------------------------------------------------------
def pause_domains(names: set[str]) -> None:
    conn = libvirt.open(LIBVIRT_URI)
    try:
        for name in names:
            conn.lookupByName(name).suspend()
    finally:
        conn.close()


def snapshot_domains() -> list[str]:
    conn = libvirt.open(LIBVIRT_URI)
    try:
        return [d.name() for d in conn.listAllDomains(0) if d.name().startswith("vmsnapshot-")]
    finally:
        conn.close()


@pytest.mark.parametrize("point", ["snapshot:after-start", "snapshot:after-save"])
def test_kill_9_while_a_snapshot_is_made_leaves_nothing_behind(tmp_path: Path, point: str) -> None:
    """The first pod of a shape is READY, then the background make dies with the shim: the next start
    removes the snapshot's domain and half-made files, releases its claims, and makes it again."""
    require_host()
    baseline = vmsandbox_free_baseline()
    mine_before = set(snapshot_domains())
    shim = start_shim(tmp_path, env={"VMSANDBOX_FAULT": point})
    try:
        first = run(shim, snap_pod("first"))  # answered: the make starts after the pod is READY
        assert started_by(shim, first)["by"] == "boot"
    except BaseException:
        stop_shim(shim)
        raise
    code = exit_code(shim, SNAPSHOT_WAIT_S)
    assert code == -signal.SIGKILL and f"fault injection: SIGKILL at {point}" in shim.log_text(), shim.log_text()

    after = start_shim(tmp_path)
    try:
        assert set(snapshot_domains()) <= mine_before  # ours is gone (other runs may have theirs)
        assert snapshots(tmp_path / "state") == []
        assert list((tmp_path / "state" / "snapshots" / "making").glob("*")) == []
        led = assert_consistent(tmp_path / "state", baseline)  # the READY pod adopted, its pages counted
        assert list(led.claims) == [first], led.claims  # the make's claims were released
        remove(after, first)
        second = run(after, snap_pod("second"))  # no snapshot: cold boot, and the make starts again
        assert started_by(after, second)["by"] == "boot"
        wait_for_snapshot(after)
        remove(after, second)
        assert_consistent(tmp_path / "state", baseline)
    finally:
        stop_shim(after)


def test_a_stopping_shim_removes_the_guest_of_a_snapshot_being_made(tmp_path: Path) -> None:
    """SIGTERM while the shape's snapshot is being made: the snapshot's guest does not outlive the
    shim (it would hold a pod's CPUs and pages until the next start)."""
    require_host()
    before = set(snapshot_domains())
    shim = start_shim(tmp_path)
    try:
        run(shim, snap_pod("first"))
        deadline = time.monotonic() + 60
        while not set(snapshot_domains()) - before:  # the snapshot's guest is running
            assert time.monotonic() < deadline, shim.log_text()[-3000:]
            time.sleep(0.05)
    finally:
        stop_shim(shim)  # SIGTERM
    assert set(snapshot_domains()) <= before, shim.log_text()[-3000:]
    after = start_shim(tmp_path)
    try:
        for s in after.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items:
            remove(after, s.id)
        assert read_ledger(tmp_path / "state").claims == {}
    finally:
        stop_shim(after)
