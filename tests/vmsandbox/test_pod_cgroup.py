"""A pod's cgroup (vmsandbox.pod_cgroup): which ``cgroup_parent`` values are accepted, and the usage
the kubelet reads from a v1 memory cgroup (cAdvisor's working set)."""

from __future__ import annotations

import pytest

from vmsandbox import pod_cgroup
from vmsandbox.errors import InvalidArgument

WHERE = "PodSandboxConfig.linux.cgroup_parent"


@pytest.mark.parametrize(
    "value",
    [
        "",
        "/kubepods/burstable/pod6f1c2a3e-0b1d-4c5e-9f00-123456789abc",
        "/kubepods/besteffort/pod1",
        "/kubepods/pod1",
        "/machine/vm:1@x+y",
        "/" + "a" * 255,
        "/" + "/".join(["abcdefg"] * 64),  # 512 bytes
    ],
)
def test_an_absolute_cgroupfs_path_is_taken_as_it_is(value: str) -> None:
    assert pod_cgroup.cgroup_parent(value, pod_cgroup.CGROUPFS, WHERE) == value


@pytest.mark.parametrize(
    ("value", "driver", "message"),
    [
        (
            "kubepods-burstable-pod1.slice",
            pod_cgroup.CGROUPFS,
            "is a systemd slice name, but this runtime's cgroup driver is cgroupfs",
        ),
        ("system.slice", pod_cgroup.CGROUPFS, "systemd slice name"),
        ("/kubepods", pod_cgroup.SYSTEMD, "the cgroup driver 'systemd' is not supported"),
        ("kubepods/pod1", pod_cgroup.CGROUPFS, "must be an absolute cgroupfs path"),
        ("/", pod_cgroup.CGROUPFS, "not the root"),
        ("/kubepods/../x", pod_cgroup.CGROUPFS, "'..'"),
        ("/kubepods/./x", pod_cgroup.CGROUPFS, "'.'"),
        ("/kubepods//x", pod_cgroup.CGROUPFS, "empty"),
        ("/kubepods/", pod_cgroup.CGROUPFS, "empty"),
        ("/kube pods", pod_cgroup.CGROUPFS, "each component"),
        ("/kube\npods", pod_cgroup.CGROUPFS, "each component"),
        ("/kubépods", pod_cgroup.CGROUPFS, "each component"),
        ("/" + "a" * 256, pod_cgroup.CGROUPFS, "each component is at most 255"),
        ("/" + "/".join(["abcdefg"] * 64) + "x", pod_cgroup.CGROUPFS, "longer than 512 bytes"),
    ],
)
def test_anything_else_is_refused_naming_the_field_and_why(value: str, driver: str, message: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        pod_cgroup.cgroup_parent(value, driver, WHERE)
    assert WHERE in str(err.value)
    assert message in str(err.value)


STAT = """cache 4096
rss 8192
total_cache 1048576
total_rss 2097152
total_inactive_file 524288
total_pgfault 77
total_pgmajfault 3
hierarchical_memory_limit 9223372036854771712
"""


@pytest.mark.parametrize(
    ("usage", "stat", "working_set"),
    [
        (4 << 20, STAT, (4 << 20) - 524288),
        (100, STAT, 0),  # never below 0
        (4096, "", 4096),
    ],
)
def test_the_working_set_is_usage_less_inactive_file_pages(usage: int, stat: str, working_set: int) -> None:
    u = pod_cgroup.pod_usage(7, 123, usage, pod_cgroup.parse_stat(stat))
    assert u.memory_working_set_bytes == working_set
    assert (u.timestamp_ns, u.cpu_usage_ns, u.memory_usage_bytes) == (7, 123, usage)


def test_memory_stat_is_read_defensively() -> None:
    text = "total_rss 5\nnot a number\ntotal_pgfault -1\n" + "x" * 100 + " 1\nbig 1" + "0" * 30 + "\n"
    got = pod_cgroup.parse_stat(text + "total_pgmajfault 2\n" * 500)
    assert got == {"total_rss": 5, "total_pgmajfault": 2}
    u = pod_cgroup.pod_usage(0, 0, 0, got)
    assert (u.memory_rss_bytes, u.page_faults, u.major_page_faults) == (5, 0, 2)


def test_a_processes_cgroups_per_v1_controller() -> None:
    text = (
        "12:pids:/kubepods/pod1\n11:cpu,cpuacct:/machine/qemu-1.libvirt-qemu/emulator\n"
        "4:memory:/machine/qemu-1.libvirt-qemu\n1:name=systemd:/\n0::/\ngarbage\n"
    )
    assert pod_cgroup.proc_cgroups(text) == {
        "pids": "/kubepods/pod1",
        "cpu": "/machine/qemu-1.libvirt-qemu/emulator",
        "cpuacct": "/machine/qemu-1.libvirt-qemu/emulator",
        "memory": "/machine/qemu-1.libvirt-qemu",
        "name=systemd": "/",
    }
