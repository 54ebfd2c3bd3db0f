"""A VM pod in its ``cgroup_parent``, through the CRI socket with a real guest: the pod's cgroup made
as the kubelet makes it (in every v1 hierarchy), RunPodSandbox names it, and then

- every thread of the pod's QEMU (vCPUs, emulator, I/O) is in it in cpu, cpuacct, memory and pids,
  while cpuset stays libvirt's per-vCPU and emulator groups (the pinning);
- the guest's memory is charged there (it cold-booted paused until QEMU was moved), not to
  libvirt's per-domain cgroup;
- the cgroup is root's: QEMU's uid can write none of its files;
- PodSandboxStats reports what the cgroup says: CPU time between two reads of ``cpuacct.usage``
  around it, the working set within 10% of the cgroup's (usage less inactive file pages);
- a pod restored from its shape's snapshot is moved there too, once restored, and so is the thread
  of a vCPU a resize hot-plugs;
- a bad ``cgroup_parent`` is refused before anything is made; the pod's removal, and a
  RunPodSandbox failed after the move, leave the cgroup empty."""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml

from gen.cri.runtime.v1 import api_pb2 as pb
from tests.integration.test_snapshot_restore import remove as snapshot_remove
from tests.integration.test_snapshot_restore import run as snapshot_run
from tests.integration.test_snapshot_restore import seed_snapshot, snap_pod, started_by
from tests.shim_kit import (
    HEADROOM_HANDLER,
    IMAGE_DIR,
    Shim,
    pod,
    q,
    require_host,
    running_shim,
    start_shim,
    stop_shim,
)
from vmsandbox.domain import domain_name
from vmsandbox.pod_cgroup import CONTROLLERS, parse_stat, proc_cgroups

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(900)]

ROOT = Path("/sys/fs/cgroup")
MEMORY = "96Mi"
FILL_MIB = 48  # what the container writes to its tmpfs: guest RAM touched after the start


@pytest.fixture
def parent() -> Iterator[str]:
    """A pod cgroup made as the kubelet makes one, removed afterwards: tests ask for it before their
    shim, so that it goes after the shim has removed the pods it holds."""
    path = f"/vmsandbox-test/pod{uuid.uuid4()}"
    for c in ("cpu", "cpuacct", "cpuset", "memory", "pids"):
        (ROOT / c / path.lstrip("/")).mkdir(parents=True)
    try:
        yield path
    finally:
        for c in ("cpu", "cpuacct", "cpuset", "memory", "pids"):
            for d in (ROOT / c / path.lstrip("/"), ROOT / c / "vmsandbox-test"):
                with contextlib.suppress(OSError):
                    d.rmdir()


@pytest.fixture
def shim(tmp_path: Path) -> Iterator[Shim]:
    require_host()
    if (ROOT / "cgroup.controllers").exists() or not all((ROOT / c).is_dir() for c in CONTROLLERS):
        pytest.skip("not a cgroup v1 host")
    profiles = tmp_path / "profiles.yaml"
    # ordinary guest memory (4Ki pages): hugepages are not charged to a v1 memory cgroup
    profiles.write_text(
        yaml.safe_dump(
            {
                "name": "vmsandbox",
                "handler": "vmsandbox",
                "page_size": "4Ki",
                "snapshots": False,
                "guest": {"image_dir": str(IMAGE_DIR), "boot_timeout_s": 90},
            }
        )
    )
    (tmp_path / "shim").mkdir()
    with running_shim(tmp_path / "shim", extra_config={"profile_files": [str(profiles)]}) as s:
        yield s


def _read(controller: str, path: str, name: str) -> str:
    return (ROOT / controller / path.lstrip("/") / name).read_text()


def _working_set(path: str) -> int:
    usage = int(_read("memory", path, "memory.usage_in_bytes"))
    return max(usage - parse_stat(_read("memory", path, "memory.stat")).get("total_inactive_file", 0), 0)


def test_a_vm_pods_qemu_lives_and_is_counted_in_its_cgroup_parent(parent: str, shim: Shim) -> None:
    config = pod("acct", containers=[("c", q({"cpu": "500m", "memory": MEMORY}))])
    config.linux.cgroup_parent = parent
    rt = shim.runtime
    sid = rt.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=300).pod_sandbox_id
    pid = int(Path(f"/run/libvirt/qemu/{domain_name(sid)}.pid").read_text())

    threads = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    assert len(threads) > 2  # vCPU, emulator, I/O threads
    for tid in threads:
        where = proc_cgroups(Path(f"/proc/{pid}/task/{tid}/cgroup").read_text())
        for c in CONTROLLERS:
            assert where[c] == parent, (tid, c, where)
        assert where["cpuset"].startswith("/machine/"), (tid, where)  # libvirt's pinning groups
    assert {int(p) for p in _read("cpu", parent, "cgroup.procs").split()} == {pid}

    # the guest's pages are charged here: at least its kernel's and agent's, little left to libvirt
    qemu_uid = os.stat(f"/proc/{pid}").st_uid
    assert qemu_uid != 0
    usage = int(_read("memory", parent, "memory.usage_in_bytes"))
    status = dict(ln.split(":", 1) for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in ln)
    anon = int(status["RssAnon"].split()[0]) * 1024  # guest RAM and QEMU's heap: charged to who touched it
    libvirts = proc_cgroups(Path(f"/proc/{pid}/cgroup").read_text())["cpuset"].rsplit("/", 1)[0]
    left = ROOT / "memory" / libvirts.lstrip("/") / "memory.usage_in_bytes"
    left_bytes = int(left.read_text()) if left.exists() else 0
    print(f"\npod cgroup memory {usage >> 20} MiB, QEMU anon {anon >> 20} MiB, libvirt's {left_bytes >> 20} MiB")
    # what QEMU touched before its vCPUs ran (the kernel and initramfs it loads into guest RAM, its
    # start-up heap) stays charged to libvirt's per-domain group: a v1 move leaves charges behind
    assert usage + left_bytes >= 0.9 * anon, (usage, left_bytes, anon)
    assert usage >= 32 << 20, usage  # the guest's boot

    # what the guest touches from now on is the pod's
    container = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name="c"),
        image=pb.ImageSpec(image="busybox"),
        command=["sh", "-c", f"dd if=/dev/zero of=/dev/shm/fill bs=1M count={FILL_MIB} && sleep 600"],
    )
    container.kubernetes_resources.CopyFrom(q({"cpu": "500m", "memory": MEMORY}))
    cid = rt.CreateContainer(
        pb.CreateContainerRequest(pod_sandbox_id=sid, config=container, sandbox_config=config), timeout=120
    ).container_id
    rt.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=120)
    grown = 0
    deadline = time.monotonic() + 120
    while grown < (FILL_MIB - 8) << 20:
        assert time.monotonic() < deadline, f"the pod's cgroup grew {grown >> 20} MiB, not {FILL_MIB}"
        time.sleep(1)
        grown = int(_read("memory", parent, "memory.usage_in_bytes")) - usage
    if left.exists():
        assert int(left.read_text()) - left_bytes < 8 << 20  # libvirt's group did not grow with it

    # the cgroup is root's: QEMU's uid can write none of its files
    for c in CONTROLLERS:
        d = ROOT / c / parent.lstrip("/")
        for f in (d, d / "cgroup.procs", d / "tasks"):
            st = f.stat()
            assert st.st_uid == 0 and st.st_mode & 0o022 == 0, (f, oct(st.st_mode), st.st_uid)

    # PodSandboxStats is what the cgroup says
    time.sleep(2)
    before = int(_read("cpuacct", parent, "cpuacct.usage"))
    stats = rt.PodSandboxStats(pb.PodSandboxStatsRequest(pod_sandbox_id=sid), timeout=30).stats.linux
    after = int(_read("cpuacct", parent, "cpuacct.usage"))
    working_set = _working_set(parent)
    assert before > 0
    assert before <= stats.cpu.usage_core_nano_seconds.value <= after
    got = stats.memory.working_set_bytes.value
    assert abs(got - working_set) <= 0.1 * working_set, (got, working_set)
    listed = rt.ListPodSandboxStats(pb.ListPodSandboxStatsRequest(), timeout=30).stats
    assert [s.linux.cpu.usage_core_nano_seconds.value >= before for s in listed if s.attributes.id == sid] == [True]

    rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=120)
    rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=120)
    for c in CONTROLLERS:
        assert _read(c, parent, "cgroup.procs").split() == []


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("kubepods-burstable-pod1.slice", "systemd slice name"),
        ("/kubepods/../../x", "'..'"),
        ("relative/path", "absolute"),
    ],
)
def test_a_bad_cgroup_parent_is_refused_before_anything_is_made(shim: Shim, value: str, message: str) -> None:
    config = pod("bad", containers=[("c", q({"cpu": "500m", "memory": MEMORY}))])
    config.linux.cgroup_parent = value
    with pytest.raises(grpc.RpcError) as err:
        shim.runtime.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in str(err.value.details())
    assert list(shim.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items) == []


@pytest.fixture
def snapshot_shim(tmp_path: Path) -> Iterator[Shim]:
    require_host()
    if (ROOT / "cgroup.controllers").exists() or not all((ROOT / c).is_dir() for c in CONTROLLERS):
        pytest.skip("not a cgroup v1 host")
    (tmp_path / "shim").mkdir()
    with running_shim(tmp_path / "shim") as s:
        yield s


def test_a_restored_pods_qemu_is_moved_into_its_cgroup_parent_too(parent: str, snapshot_shim: Shim) -> None:
    shim = snapshot_shim
    made = seed_snapshot(shim)
    config = snap_pod("restored")
    config.linux.cgroup_parent = parent
    sid = snapshot_run(shim, config)
    assert started_by(shim, sid) == {"by": "restore", "snapshot": made.name}, shim.log_text()[-3000:]
    pid = int(Path(f"/run/libvirt/qemu/{domain_name(sid)}.pid").read_text())
    for tid in Path(f"/proc/{pid}/task").iterdir():
        where = proc_cgroups((tid / "cgroup").read_text())
        assert {c: where[c] for c in CONTROLLERS} == dict.fromkeys(CONTROLLERS, parent), where
    # the restore ran before the move, so the group counts only what QEMU has run since: wait
    # until it has run at all (an idle guest's timer ticks), then the stats are what it counts
    deadline = time.monotonic() + 30
    while (before := int(_read("cpuacct", parent, "cpuacct.usage"))) == 0:
        assert time.monotonic() < deadline, "the restored pod's QEMU ran for no time in 30 s"
        time.sleep(0.5)
    stats = shim.runtime.PodSandboxStats(pb.PodSandboxStatsRequest(pod_sandbox_id=sid), timeout=30).stats.linux
    after = int(_read("cpuacct", parent, "cpuacct.usage"))
    assert 0 < before <= stats.cpu.usage_core_nano_seconds.value <= after
    snapshot_remove(shim, sid)
    for c in CONTROLLERS:
        assert _read(c, parent, "cgroup.procs").split() == []


def _vcpu_threads(pid: int) -> dict[str, str]:
    """QEMU's vCPU threads by name ("CPU 1/TCG", "CPU 1/KVM"): thread id of each."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):
            comm = (task / "comm").read_text().strip()
            if comm.startswith("CPU "):
                out[comm] = task.name
    return out


def _all_in(pid: int, parent: str) -> None:
    for tid in Path(f"/proc/{pid}/task").iterdir():
        where = proc_cgroups((tid / "cgroup").read_text())
        assert {c: where[c] for c in CONTROLLERS} == dict.fromkeys(CONTROLLERS, parent), (tid.name, where)


def test_a_resized_pods_vcpus_are_all_in_the_pods_cgroup(parent: str, snapshot_shim: Shim) -> None:
    """The headroom's vCPUs are present from QEMU's start, a thread each, and move into the pod's
    cgroup with QEMU at RunPodSandbox; a resize into the headroom (``tests/integration/test_resize_headroom.py``)
    onlines one in the guest and makes no thread: every thread of QEMU is in the pod's cgroup before and after."""
    shim = snapshot_shim

    def linux(quota: int) -> pb.LinuxContainerResources:
        return pb.LinuxContainerResources(cpu_period=100_000, cpu_quota=quota, memory_limit_in_bytes=64 << 20)

    config = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name="plugged", namespace="test", uid=str(uuid.uuid4()), attempt=0),
        linux=pb.LinuxPodSandboxConfig(resources=linux(50_000), cgroup_parent=parent),
    )
    sid = shim.runtime.RunPodSandbox(
        pb.RunPodSandboxRequest(config=config, runtime_handler=HEADROOM_HANDLER), timeout=300
    ).pod_sandbox_id
    pid = int(Path(f"/run/libvirt/qemu/{domain_name(sid)}.pid").read_text())
    vcpus = _vcpu_threads(pid)
    # one vCPU booted, one of headroom: both threads exist before any resize
    assert sorted(name.split("/")[0] for name in vcpus) == ["CPU 0", "CPU 1"], vcpus
    _all_in(pid, parent)
    shim.runtime.UpdatePodSandboxResources(
        pb.UpdatePodSandboxResourcesRequest(pod_sandbox_id=sid, resources=linux(200_000)), timeout=120
    )
    assert _vcpu_threads(pid) == vcpus, "the resize onlines a vCPU QEMU already had"
    _all_in(pid, parent)
    # a hugepage-backed guest: its RAM is charged to no memory cgroup, QEMU's own memory is
    print(
        f"\nhugepage-backed pod: its cgroup's memory {int(_read('memory', parent, 'memory.usage_in_bytes')) >> 20} MiB"
    )
    snapshot_remove(shim, sid)


@pytest.mark.parametrize("point", ["RunPodSandbox:cgroup", "RunPodSandbox:ready"])
def test_a_run_failed_after_the_move_leaves_the_pods_cgroup_empty(tmp_path: Path, parent: str, point: str) -> None:
    require_host()
    if (ROOT / "cgroup.controllers").exists() or not all((ROOT / c).is_dir() for c in CONTROLLERS):
        pytest.skip("not a cgroup v1 host")
    (tmp_path / "shim").mkdir()
    shim = start_shim(tmp_path / "shim", env={"VMSANDBOX_FAULT": f"raise:{point}"}, pull_busybox=False)
    try:
        config = pod("undone", containers=[("c", q({"cpu": "500m", "memory": MEMORY}))])
        config.linux.cgroup_parent = parent
        with pytest.raises(grpc.RpcError) as err:
            shim.runtime.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=300)
        assert f"fault injected at {point}" in str(err.value.details())
        assert "cgroup, define" in str(err.value.details())  # undone: moved back, then torn down
        assert list(shim.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items) == []
        for c in CONTROLLERS:
            assert _read(c, parent, "cgroup.procs").split() == [], c
    finally:
        stop_shim(shim)
