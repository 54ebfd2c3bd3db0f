"""What the cluster start benchmark reads from the kubelet and the pods' logs: the kubelet's CRI
call seconds from its /metrics text, their split into phases, the CRI log timestamps, and the
Deployments it applies (the two runtimes' pods alike but for the RuntimeClass)."""

from __future__ import annotations

import calendar
import time

import pytest

from bench.cluster_start import deployment, kubelet_ops, log_timestamp_ns, ops_delta

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
