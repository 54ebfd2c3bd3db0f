"""A guest with root does its worst to the container log path, through the real CRI socket.

A privileged container (guest root, the guest's PID namespace) enters guest init's mount
namespace (``nsenter -t 1 -m``), where the sandbox's 9p share is mounted at
``/run/vmsandbox/shared``, and plants there what a host that read logs from the share would trip
on: the container's ``log`` as a symlink to a host file holding a secret, ``log.copied.tmp`` (where
progress was written) as a symlink to a host file, a sparse file of 512 MiB as the log. The host
must copy only what the container itself printed, leave its files alone, and its memory must not
grow with what the guest writes (a container flooding its stdout is held back by the agent)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from tests.shim_kit import Shim, container, pod, q, remove_all, require_host, start_shim, stop_shim

pytestmark = [pytest.mark.slow, pytest.mark.integration]

RES = q({"cpu": "500m", "memory": "64Mi"})
MiB = 1 << 20


def _privileged(name: str, script: str) -> pb.ContainerConfig:
    c = container(name, RES)
    c.command[:] = ["sh", "-c", script]
    c.log_path = f"{name}.log"
    c.linux.security_context.privileged = True
    c.linux.security_context.namespace_options.pid = pb.NODE
    return c


def _in_guest_init(script: str) -> str:
    """Runs ``script`` in guest init's mount namespace, where the shares are mounted."""
    return f"busybox nsenter -t 1 -m busybox sh -c '{script}'"


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _run(shim: Shim, name: str, script: str, tmp: Path) -> str:
    config = pod(name, containers=[(name, RES)])
    config.log_directory = str(tmp / "logs")
    sid = shim.runtime.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=300).pod_sandbox_id
    cid = shim.runtime.CreateContainer(
        pb.CreateContainerRequest(pod_sandbox_id=sid, config=_privileged(name, script), sandbox_config=config),
        timeout=120,
    ).container_id
    shim.runtime.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=120)
    return cid


def _wait_exit(shim: Shim, cid: str, timeout_s: float = 120) -> pb.ContainerStatus:
    deadline = time.monotonic() + timeout_s
    while True:
        st = shim.runtime.ContainerStatus(pb.ContainerStatusRequest(container_id=cid), timeout=60).status
        if st.state == pb.CONTAINER_EXITED:
            return st
        assert time.monotonic() < deadline, shim.log_text()[-3000:]
        time.sleep(0.3)


def test_guest_symlinks_reach_no_host_file(tmp_path: Path) -> None:
    require_host()
    secret = tmp_path / "secret"
    secret.write_text("host secret line one\nhost secret line two\n")
    target = tmp_path / "target"
    target.write_text("host file, unchanged\n")
    plant = (
        "for d in /run/vmsandbox/shared/containers/*; do "
        f"busybox ln -sfn {secret} $d/log && busybox ln -sfn {target} $d/log.copied.tmp && echo planted; done"
    )
    # nothing printed before the links are in place: a copier reading the share starts at offset 0
    script = f"{_in_guest_init(plant)} > /tmp/planted; sleep 2; echo own output; cat /tmp/planted; sleep 2"
    (tmp_path / "shim").mkdir()
    shim = start_shim(tmp_path / "shim")
    try:
        cid = _run(shim, "planter", script, tmp_path)
        st = _wait_exit(shim, cid)
        assert st.exit_code == 0, shim.log_text()[-2000:]
        records = [line.split(" ", 3) for line in (tmp_path / "logs" / "planter.log").read_text().splitlines()]
        texts = [text for _, stream, _, text in records if stream == "stdout"]
        # the links were made (or, with QEMU unprivileged, the share refused them: the container's
        # directory is not QEMU's), and only our own output came back
        assert texts in (["own output", "planted"], ["own output"]), records
        assert not any("host secret" in text or "host file" in text for *_, text in records), records
        assert secret.read_text() == "host secret line one\nhost secret line two\n"
        assert target.read_text() == "host file, unchanged\n"
        assert "secret" not in shim.log_text()
    finally:
        remove_all(shim)
        stop_shim(shim)


def test_shim_memory_stays_bounded_under_a_flood_and_a_sparse_log(tmp_path: Path) -> None:
    """The container writes far more than the agent holds, as fast as the guest can, and makes a
    512 MiB sparse file of its log in the share: the shim's RSS stays within a bound, and the
    kubelet's file grows at the configured rate, no faster."""
    require_host()
    rate = 1 * MiB
    sparse = (
        "for d in /run/vmsandbox/shared/containers/*; do busybox rm -f $d/log; busybox truncate -s 512M $d/log; done"
    )
    text = "0123456789abcdefghijklmnopqrstuvwxyz" * 2
    script = f"{_in_guest_init(sparse)}; echo start; busybox yes {text} | busybox head -c 200000000; sleep 600"
    (tmp_path / "shim").mkdir()
    shim = start_shim(tmp_path / "shim", extra_config={"log_rate_bytes": rate, "log_burst_bytes": rate})
    try:
        before = peak = _rss(shim.process.pid)
        cid = _run(shim, "flood", script, tmp_path)
        log = tmp_path / "logs" / "flood.log"
        deadline = time.monotonic() + 60
        while not (log.exists() and log.stat().st_size > 0):
            peak = max(peak, _rss(shim.process.pid))
            assert peak - before < 64 * MiB, (peak - before) / MiB
            assert time.monotonic() < deadline, shim.log_text()[-3000:]
            time.sleep(0.1)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 20:
            peak = max(peak, _rss(shim.process.pid))
            time.sleep(0.1)
        size, elapsed = log.stat().st_size, time.monotonic() - t0
        # stdout only: with QEMU unprivileged the share refuses the sparse file (an error on stderr)
        lines = [line for line in log.read_text().splitlines() if " stdout " in line]
        assert lines[0].endswith(" stdout F start"), lines[:2]
        assert all(line.endswith(f" stdout F {text}") for line in lines[1:-1])
        assert size > rate * 5, size  # it does flow
        assert size <= rate * (elapsed + 2) + 2 * rate + 256 * 1024, (size, elapsed)  # at the configured rate
        state = shim.runtime.ContainerStatus(pb.ContainerStatusRequest(container_id=cid), timeout=60).status.state
        assert state == pb.CONTAINER_RUNNING  # held back by the full pipe, not dropped or killed
        assert peak - before < 64 * MiB, (peak - before) / MiB
        print(f"shim RSS growth {(peak - before) / MiB:.1f} MiB; {size / MiB:.1f} MiB copied in {elapsed:.1f} s")
    finally:
        remove_all(shim)
        stop_shim(shim)
