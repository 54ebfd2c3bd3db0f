"""The move of a QEMU pid into its pod's cgroup and back, and the read of that cgroup's usage
(vmsandbox.adapters.host_cgroup), on a cgroup tree of plain files (a real one: tests/integration/
test_pod_cgroup.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vmsandbox.adapters.host_cgroup import HostCgroups
from vmsandbox.errors import InfrastructureError, Unsupported
from vmsandbox.pod_cgroup import CONTROLLERS

PID = 4242
POD = "/kubepods/burstable/pod1"
WAS = {
    "cpu": "/machine/q.libvirt-qemu/emulator",
    "cpuacct": "/machine/q.libvirt-qemu/emulator",
    "memory": "/machine/q.libvirt-qemu",
    "pids": "/",
}


def tree(tmp_path: Path, pod: tuple[str, ...] = CONTROLLERS) -> HostCgroups:
    """The cgroups QEMU is in, and the pod's (as the kubelet made it) in the ``pod`` controllers."""
    root, proc = tmp_path / "cgroup", tmp_path / "proc"
    for controller, path in WAS.items():
        for d in (root / controller / path.lstrip("/"), *([root / controller / POD[1:]] if controller in pod else [])):
            d.mkdir(parents=True, exist_ok=True)
            (d / "cgroup.procs").write_text("")
        (root / controller / "cgroup.procs").write_text("")
    (proc / str(PID)).mkdir(parents=True)
    lines = [f"{i}:{c}:{p}" for i, (c, p) in enumerate(WAS.items(), 1)]
    (proc / str(PID) / "cgroup").write_text("\n".join([*lines, "0::/"]) + "\n")
    return HostCgroups(str(root), str(proc))


def procs(cg: HostCgroups, controller: str, path: str) -> str:
    return (cg.root / controller / path.lstrip("/") / "cgroup.procs").read_text()


def test_a_pid_moves_into_the_pod_cgroup_of_each_controller_and_back(tmp_path: Path) -> None:
    cg = tree(tmp_path)
    placed = cg.place(PID, POD)
    assert placed.previous == tuple((c, WAS[c]) for c in CONTROLLERS)
    for c in CONTROLLERS:
        assert procs(cg, c, POD) == str(PID)
    assert not (cg.root / "cpuset").exists()  # cpuset (libvirt's pinning) is not touched
    cg.put_back(placed)
    for c, path in WAS.items():
        assert procs(cg, c, path) == str(PID)


def test_a_cgroup_gone_meanwhile_puts_the_pid_back_at_the_root(tmp_path: Path) -> None:
    cg = tree(tmp_path)
    placed = cg.place(PID, POD)
    (cg.root / "memory" / "machine" / "q.libvirt-qemu" / "cgroup.procs").unlink()
    (cg.root / "memory" / "machine" / "q.libvirt-qemu").rmdir()
    cg.put_back(placed)
    assert procs(cg, "memory", "/") == str(PID)


def test_a_failed_move_puts_back_what_it_moved_and_says_where(tmp_path: Path) -> None:
    cg = tree(tmp_path, pod=("cpu", "cpuacct", "pids"))
    (cg.root / "memory" / "kubepods").write_text("")  # a file where the cgroup should be
    with pytest.raises(InfrastructureError, match=r"cannot move QEMU \(pid 4242\) into the cgroup .*\(memory\)"):
        cg.place(PID, POD)
    assert procs(cg, "cpu", WAS["cpu"]) == str(PID)
    assert procs(cg, "cpuacct", WAS["cpuacct"]) == str(PID)


def test_a_cgroup_v2_host_is_refused_as_such(tmp_path: Path) -> None:
    cg = tree(tmp_path)
    (cg.root / "cgroup.controllers").write_text("cpu memory pids\n")
    with pytest.raises(Unsupported, match="cgroup v2"):
        cg.place(PID, POD)


def test_the_pod_cgroups_usage(tmp_path: Path) -> None:
    cg = tree(tmp_path, pod=())
    (cg.root / "cpuacct" / "kubepods").mkdir()
    (cg.root / "cpuacct" / "kubepods" / "cpuacct.usage").write_text("123456789\n")
    (cg.root / "memory" / "kubepods").mkdir()
    (cg.root / "memory" / "kubepods" / "memory.usage_in_bytes").write_text("1000000\n")
    (cg.root / "memory" / "kubepods" / "memory.stat").write_text("total_inactive_file 1000\ntotal_rss 900000\n")
    u = cg.usage("/kubepods")
    assert (u.cpu_usage_ns, u.memory_usage_bytes, u.memory_working_set_bytes, u.memory_rss_bytes) == (
        123456789,
        1000000,
        999000,
        900000,
    )
    with pytest.raises(InfrastructureError, match="cannot read the usage of the cgroup /nothing"):
        cg.usage("/nothing")
