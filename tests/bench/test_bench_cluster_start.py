"""What the cluster start benchmark reads from the kubelet and the pods' logs: the kubelet's CRI
call seconds from its /metrics text, their split into phases, the CRI log timestamps, the
Deployments it applies (the two runtimes' pods alike but for the RuntimeClass), and the floor from
the pods' QEMU processes."""

from __future__ import annotations

import calendar
import os
import time
from pathlib import Path

import pytest

from bench.cluster_start import (
    QemuCpu,
    cgroup_pod_uid,
    cpu_list,
    deployment,
    floor,
    kubelet_ops,
    log_timestamp_ns,
    ops_delta,
    pod_qemu_cpu,
)

METRICS = """\
# HELP kubelet_runtime_operations_duration_seconds [ALPHA] Duration in seconds of runtime operations.
# TYPE kubelet_runtime_operations_duration_seconds histogram
kubelet_runtime_operations_duration_seconds_bucket{operation_type="run_podsandbox",le="0.005"} 0
kubelet_runtime_operations_duration_seconds_sum{operation_type="run_podsandbox"} 2.5
kubelet_runtime_operations_duration_seconds_count{operation_type="run_podsandbox"} 2
kubelet_runtime_operations_duration_seconds_sum{operation_type="pull_image"} 0.75
kubelet_runtime_operations_duration_seconds_sum{operation_type="image_status"} 0.25
kubelet_runtime_operations_duration_seconds_sum{operation_type="create_container"} 1e-01
kubelet_runtime_operations_duration_seconds_sum{operation_type="start_container"} 0.05
kubelet_runtime_operations_total{operation_type="run_podsandbox"} 2
kubelet_runtime_operations_duration_seconds_sum{} 9
"""


def test_the_kubelets_call_seconds_are_read_per_operation() -> None:
    assert kubelet_ops(METRICS) == {
        "run_podsandbox": 2.5,
        "pull_image": 0.75,
        "image_status": 0.25,
        "create_container": 0.1,
        "start_container": 0.05,
    }


def test_a_phase_is_the_growth_of_its_calls_seconds() -> None:
    before = kubelet_ops(METRICS)
    after = {**before, "run_podsandbox": 3.0, "image_status": 0.5, "list_containers": 7.0}
    assert ops_delta(before, after) == {
        "run_pod_sandbox": 0.5,
        "image": 0.25,
        "create_container": 0.0,
        "start_container": 0.0,
    }
    # a call the kubelet had not made yet counts from zero
    assert ops_delta({}, {"start_container": 0.2})["start_container"] == 0.2


@pytest.mark.parametrize(
    ("line", "fraction_ns"),
    [
        ("2026-11-28T03:04:05.123456789Z hello", 123456789),
        ("2026-11-28T03:04:05.5Z hello", 500_000_000),
        ("2026-11-28T03:04:05Z hello", 0),
    ],
)
def test_cri_log_timestamps_keep_their_nanoseconds(line: str, fraction_ns: int) -> None:
    whole = calendar.timegm(time.strptime("2026-11-28T03:04:05", "%Y-%m-%dT%H:%M:%S"))
    assert log_timestamp_ns(line) == whole * 1_000_000_000 + fraction_ns


@pytest.mark.parametrize("line", ["hello", "2026-11-28 03:04:05Z x", "2026-11-28T03:04:05.1234567890Z x"])
def test_a_line_without_a_cri_timestamp_is_refused(line: str) -> None:
    with pytest.raises(ValueError, match="not a CRI log timestamp"):
        log_timestamp_ns(line)


def test_the_runtimes_pods_differ_only_by_their_runtime_class() -> None:
    runc = deployment("a", "runc", "img:1", 3)
    vm = deployment("a", "vmsandbox", "img:1", 3)
    vm_spec = vm["spec"]["template"]["spec"]
    assert vm_spec.pop("runtimeClassName") == "vmsandbox"
    assert "runtimeClassName" not in runc["spec"]["template"]["spec"]
    assert runc == vm
    assert runc["spec"]["replicas"] == 3
    # the Deployment selects its own pods: its labels are on its template
    assert runc["spec"]["selector"]["matchLabels"].items() <= runc["spec"]["template"]["metadata"]["labels"].items()


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("1\n", {1}), ("0-3", {0, 1, 2, 3}), ("0,2-3,7", {0, 2, 3, 7}), ("", set())],
)
def test_a_kernel_cpu_list_is_read_as_its_cpus(text: str, cpus: set[int]) -> None:
    assert cpu_list(text) == cpus


def _process(proc: Path, pid: int, comm: str, cgroup: str, utime: int, stime: int, allowed: list[str]) -> None:
    d = proc / str(pid)
    d.mkdir(parents=True)
    (d / "comm").write_text(comm + "\n")
    (d / "cgroup").write_text(cgroup)
    # the command's name may hold spaces and parentheses: fields are counted after its last ")"
    fields = ["S"] + ["0"] * 10 + [str(utime), str(stime)] + ["0"] * 30
    (d / "stat").write_text(f"{pid} ({comm} (x) y) " + " ".join(fields) + "\n")
    for i, cpus in enumerate(allowed):
        t = d / "task" / str(pid + i)
        t.mkdir(parents=True)
        (t / "status").write_text(f"Name:\t{comm}\nCpus_allowed_list:\t{cpus}\nVoluntary: 1\n")


UID_A = "98e85a07-87e7-4708-8185-7c721e73d037"
UID_B = "0a1b2c3d-0000-4000-8000-000000000001"


@pytest.mark.parametrize(
    ("cgroup", "uid"),
    [
        (f"12:cpuacct:/kubepods/burstable/pod{UID_A}\n0::/\n", UID_A),
        (f"4:cpu:/kubepods/pod{UID_A}\n", UID_A),  # a Guaranteed pod's
        (f"0::/kubepods.slice/kubepods-besteffort-pod{UID_A.replace('-', '_')}.slice\n", UID_A),  # systemd
        ("12:cpuacct:/machine/qemu-9-vmsandbox\n", None),
        ("12:cpuacct:/kubepods/burstable\n", None),
    ],
)  # fmt: skip
def test_a_process_cgroup_names_its_pod_by_uid(cgroup: str, uid: str | None) -> None:
    assert cgroup_pod_uid(cgroup) == uid


def test_only_the_given_pods_qemus_count(tmp_path: Path) -> None:
    ticks = os.sysconf("SC_CLK_TCK")
    pod_a = f"12:cpuacct:/kubepods/burstable/pod{UID_A}\n0::/\n"
    _process(tmp_path, 10, "qemu-system-x86", pod_a, ticks, ticks // 2, ["1", "1-2"])
    _process(tmp_path, 11, "qemu-system-x86", f"12:cpuacct:/kubepods/pod{UID_B}\n", 2 * ticks, 0, ["1"])
    _process(tmp_path, 12, "qemu-system-x86", "12:cpuacct:/machine/qemu-9\n", 50 * ticks, 0, ["0"])  # not a pod's
    _process(tmp_path, 13, "pause", pod_a, 50 * ticks, 0, ["0"])  # a pod's, not a QEMU
    (tmp_path / "self").mkdir()
    assert pod_qemu_cpu({UID_A, UID_B}, tmp_path) == QemuCpu(seconds=3.5, processes=2, cpus=frozenset({1, 2}))
    # another pod's QEMU (one still going away, say) is not counted
    assert pod_qemu_cpu({UID_A}, tmp_path) == QemuCpu(seconds=1.5, processes=1, cpus=frozenset({1, 2}))


def test_a_process_gone_while_read_is_skipped(tmp_path: Path) -> None:
    (tmp_path / "20").mkdir()  # its files already gone
    assert pod_qemu_cpu({UID_A}, tmp_path) == QemuCpu(0.0, 0, frozenset())


def test_the_floor_replaces_runcs_calls_by_the_guests_cpu_time() -> None:
    got = floor(runc_ready_s=0.5, runc_runtime_s=0.1, vm_cpu_s=1.2, burst_cpu_s=12.0, cpus=2, one_vm_s=2.0)
    assert got == {"ready_s": 1.0, "ratio_p50": 2.0, "burst_all_ready_s": 6.0, "burst_ratio": 3.0}
