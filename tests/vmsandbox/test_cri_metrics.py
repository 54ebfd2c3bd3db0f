"""The CRI metrics (vmsandbox.cri_metrics): the descriptor table, the values a guest's sample and a
pod's network device give, the agent's stats body read defensively, the host-side counters, and
the two RPCs through the in-process CRI server."""

from __future__ import annotations

import dataclasses
import os
import re
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gen.cri.runtime.v1 import api_pb2 as pb
from shim.model import CONTAINER_RUNNING
from shim.proxy.service import Proxy
from tests.cri_server import SEED_CONTAINER, SEED_SANDBOXES, Server, cri_server
from vmsandbox import cri_metrics, routing
from vmsandbox.adapters import sysfs
from vmsandbox.agent_ops import (
    HUGETLB_SIZES_MAX,
    IO_DEVICES_MAX,
    CgroupReadings,
    CgroupStats,
    IoDevice,
    stats_from_body,
)
from vmsandbox.agent_protocol import INT64_MAX, ProtocolError
from vmsandbox.cri_metrics import BY_NAME, DESCRIPTORS, LinkCounters

# critest v1.37 (pkg/validate/pod.go): expectedMetricDescriptorNames, unimplementedMetricDescriptors,
# optionalValuesForMetricDescriptors
CRITEST_EXPECTED = [
    "container_blkio_device_usage_total",
    "container_cpu_cfs_periods_total",
    "container_cpu_cfs_throttled_periods_total",
    "container_cpu_cfs_throttled_seconds_total",
    "container_cpu_system_seconds_total",
    "container_cpu_usage_seconds_total",
    "container_cpu_user_seconds_total",
    "container_file_descriptors",
    "container_fs_inodes_free",
    "container_fs_inodes_total",
    "container_fs_limit_bytes",
    "container_fs_reads_bytes_total",
    "container_fs_reads_total",
    "container_fs_usage_bytes",
    "container_fs_writes_bytes_total",
    "container_fs_writes_total",
    "container_hugetlb_max_usage_bytes",
    "container_hugetlb_usage_bytes",
    "container_last_seen",
    "container_memory_cache",
    "container_memory_failcnt",
    "container_memory_failures_total",
    "container_memory_kernel_usage",
    "container_memory_mapped_file",
    "container_memory_max_usage_bytes",
    "container_memory_rss",
    "container_memory_swap",
    "container_memory_usage_bytes",
    "container_memory_working_set_bytes",
    "container_network_receive_bytes_total",
    "container_network_receive_errors_total",
    "container_network_receive_packets_dropped_total",
    "container_network_receive_packets_total",
    "container_network_transmit_bytes_total",
    "container_network_transmit_errors_total",
    "container_network_transmit_packets_dropped_total",
    "container_network_transmit_packets_total",
    "container_oom_events_total",
    "container_pressure_cpu_stalled_seconds_total",
    "container_pressure_cpu_waiting_seconds_total",
    "container_pressure_io_stalled_seconds_total",
    "container_pressure_io_waiting_seconds_total",
    "container_pressure_memory_stalled_seconds_total",
    "container_pressure_memory_waiting_seconds_total",
    "container_processes",
    "container_sockets",
    "container_spec_cpu_period",
    "container_spec_cpu_quota",
    "container_spec_cpu_shares",
    "container_spec_memory_limit_bytes",
    "container_spec_memory_reservation_limit_bytes",
    "container_spec_memory_swap_limit_bytes",
    "container_start_time_seconds",
    "container_threads",
    "container_threads_max",
    "container_ulimits_soft",
]
CRITEST_UNIMPLEMENTED = {
    "container_hugetlb_max_usage_bytes",
    "container_hugetlb_usage_bytes",
    "container_pressure_cpu_stalled_seconds_total",
    "container_pressure_cpu_waiting_seconds_total",
    "container_pressure_io_stalled_seconds_total",
    "container_pressure_io_waiting_seconds_total",
    "container_pressure_memory_stalled_seconds_total",
    "container_pressure_memory_waiting_seconds_total",
    "container_spec_cpu_quota",
    "container_spec_memory_reservation_limit_bytes",
    "container_ulimits_soft",
}
CRITEST_OPTIONAL = {
    "container_blkio_device_usage_total",
    "container_fs_reads_bytes_total",
    "container_fs_reads_total",
    "container_fs_writes_bytes_total",
    "container_fs_writes_total",
}
CRITEST_SOURCE = Path("/root/go/pkg/mod/sigs.k8s.io/cri-tools@v1.37.0/pkg/validate/pod.go")

POD = cri_metrics.PodIdentity("web", "shop", "s" * 64)
CTR = cri_metrics.ContainerIdentity("app", "c" * 64, "busybox:1.36", 1_700_000_000_123_456_789)
NOW_NS = 1_700_000_100_987_654_321

FULL = CgroupReadings(
    cpu_user_usec=2_500_000,
    cpu_system_usec=1_999_999,
    cpu_nr_periods=40,
    cpu_nr_throttled=3,
    cpu_throttled_usec=1_200_000,
    memory_file=1 << 20,
    memory_file_mapped=1 << 19,
    memory_kernel=1 << 18,
    memory_active_file=3 << 18,
    memory_inactive_file=1 << 18,
    memory_events_max=5,
    memory_events_oom=1,
    memory_peak=9 << 20,
    memory_swap_current=0,
    memory_max=64 << 20,
    memory_low=0,
    memory_swap_max=0,
    cpu_weight=39,
    cpu_max_quota_usec=20_000,
    cpu_max_period_usec=100_000,
    pids_max=0,
    psi_cpu_some_usec=3_000_001,
    psi_cpu_full_usec=1_000_000,
    psi_memory_some_usec=0,
    psi_memory_full_usec=0,
    psi_io_some_usec=6291,
    psi_io_full_usec=6291,
    processes=2,
    file_descriptors=9,
    sockets=1,
    fs_bytes=40 << 20,
    fs_inodes=4096,
    fs_inodes_free=4000,
    io=(IoDevice(254, 0, 1748992, 4096, 21, 1),),
    hugetlb=(("2MB", 4 << 20),),
)


def sample(readings: CgroupReadings = FULL, oom_kills: int | None = 1) -> CgroupStats:
    return CgroupStats(
        timestamp_ns=NOW_NS,
        cpu_usage_ns=4_499_999_999,
        memory_usage_bytes=8 << 20,
        memory_working_set_bytes=7 << 20,
        memory_rss_bytes=5 << 20,
        page_faults=673,
        major_page_faults=17,
        pids=3,
        writable_bytes=4096,
        writable_inodes=2,
        oom_kills=oom_kills,
        readings=readings,
    )


LINK = LinkCounters(
    rx_bytes=1000, rx_packets=10, rx_errors=1, rx_dropped=2, tx_bytes=500, tx_packets=5, tx_errors=3, tx_dropped=4
)


def values(s: CgroupStats | None = None, cpu_shares: int = 0) -> list[cri_metrics.Value]:
    return cri_metrics.container_values(POD, CTR, s or sample(), NOW_NS, (8192, 5), cpu_shares)


def by_name(vs: list[cri_metrics.Value]) -> dict[str, list[cri_metrics.Value]]:
    out: dict[str, list[cri_metrics.Value]] = {}
    for v in vs:
        out.setdefault(v.name, []).append(v)
    return out


# ---- the descriptor table -----------------------------------------------------------------------


def test_the_table_describes_every_name_critest_expects_once_with_help_and_labels() -> None:
    names = [d.name for d in DESCRIPTORS]
    assert len(names) == len(set(names))
    assert set(CRITEST_EXPECTED) <= set(names)
    for d in DESCRIPTORS:
        assert d.help and d.label_keys[:5] == cri_metrics.BASE_LABELS, d.name
        assert d.kind in (cri_metrics.COUNTER, cri_metrics.GAUGE)


def test_what_containerd_does_not_describe_is_what_critest_lists_unimplemented() -> None:
    beyond = {d.name for d in DESCRIPTORS if d.beyond_containerd}
    assert beyond <= CRITEST_UNIMPLEMENTED
    # containerd 2.4 describes two more that critest does not ask for
    assert {d.name for d in DESCRIPTORS} - set(CRITEST_EXPECTED) == {
        "container_memory_total_active_file_bytes",
        "container_memory_total_inactive_file_bytes",
    }


@pytest.mark.skipif(not CRITEST_SOURCE.is_file(), reason="cri-tools v1.37.0 source not in the Go module cache")
def test_the_critest_lists_here_are_critests() -> None:
    text = CRITEST_SOURCE.read_text()

    def listed(var: str) -> set[str]:
        body = text[text.index(f"var {var} = []string{{") :]
        return set(re.findall(r'"(\w+)"', body[: body.index("}")]))

    assert listed("expectedMetricDescriptorNames") == set(CRITEST_EXPECTED)
    assert listed("unimplementedMetricDescriptors") == CRITEST_UNIMPLEMENTED
    assert listed("optionalValuesForMetricDescriptors") == CRITEST_OPTIONAL


# ---- values agree with their descriptors ---------------------------------------------------------


@pytest.mark.parametrize(
    "vs",
    [
        pytest.param(values(), id="a full sample"),
        pytest.param(values(sample(CgroupReadings(), None)), id="an older agent's sample"),
        pytest.param(cri_metrics.pod_values(POD, (("eth0", LINK),)), id="a pod's network"),
        pytest.param(cri_metrics.pod_values(POD, ()), id="a pod without a network"),
    ],
)
def test_every_value_has_a_descriptor_its_type_and_one_label_per_key(vs: list[cri_metrics.Value]) -> None:
    for v in vs:
        d = BY_NAME[v.name]
        assert v.kind == d.kind, v.name
        assert len(v.labels) == len(d.label_keys), v.name
        assert 0 <= v.value < 1 << 64, v.name
    # one value per name and label set: the kubelet rejects a repeated series
    assert len({(v.name, v.labels) for v in vs}) == len(vs)


def test_critests_rule_holds_for_a_pod_with_a_network_and_a_full_sample() -> None:
    found = {v.name for v in values()} | {v.name for v in cri_metrics.pod_values(POD, (("eth0", LINK),))}
    missing = [n for n in CRITEST_EXPECTED if n not in found and n not in CRITEST_OPTIONAL | CRITEST_UNIMPLEMENTED]
    assert missing == []


@pytest.mark.parametrize(
    ("name", "labels", "value"),
    [
        ("container_cpu_usage_seconds_total", (), 4),  # whole seconds, truncated as containerd's
        ("container_cpu_user_seconds_total", (), 2),
        ("container_cpu_system_seconds_total", (), 1),
        ("container_cpu_cfs_throttled_seconds_total", (), 1),
        ("container_cpu_cfs_periods_total", (), 40),
        ("container_last_seen", (), 1_700_000_100),
        ("container_start_time_seconds", (), 1_700_000_000),
        ("container_memory_max_usage_bytes", (), 9 << 20),  # memory.peak
        ("container_memory_failcnt", (), 5),  # memory.events max
        ("container_oom_events_total", (), 1),
        ("container_memory_failures_total", ("pgfault", "container"), 673),
        ("container_memory_failures_total", ("pgmajfault", "container"), 17),
        ("container_fs_usage_bytes", ("/",), 8192),
        ("container_fs_limit_bytes", ("/",), 40 << 20),
        ("container_fs_inodes_free", ("/",), 4000),
        ("container_fs_reads_bytes_total", ("254:0",), 1748992),
        ("container_fs_writes_total", ("254:0",), 1),
        ("container_blkio_device_usage_total", ("254:0", "254", "0", "Read"), 1748992),
        ("container_blkio_device_usage_total", ("254:0", "254", "0", "Write"), 4096),
        ("container_threads", (), 3),  # pids.current
        ("container_processes", (), 2),
        ("container_threads_max", (), 0),  # pids.max "max": infinity
        ("container_pressure_cpu_waiting_seconds_total", (), 3),  # "some"
        ("container_pressure_cpu_stalled_seconds_total", (), 1),  # "full"
        ("container_hugetlb_usage_bytes", ("2MB",), 4 << 20),
        ("container_spec_cpu_period", (), 100_000),
        ("container_spec_cpu_quota", (), 20_000),
        ("container_spec_cpu_shares", (), 2 + (38 * 262142) // 9999),  # from cpu.weight 39
        ("container_spec_memory_limit_bytes", (), 64 << 20),
        ("container_spec_memory_swap_limit_bytes", (), 64 << 20),  # memory + swap, as the CRI says it
    ],
)
def test_a_value_is_what_the_guest_read(name: str, labels: tuple[str, ...], value: int) -> None:
    base = (POD.name, POD.namespace, CTR.name, CTR.id, CTR.image)
    assert [v.value for v in by_name(values())[name] if v.labels == (*base, *labels)] == [value]


def test_the_shares_the_container_was_given_come_before_its_weight() -> None:
    assert [v.value for v in by_name(values(cpu_shares=1024))["container_spec_cpu_shares"]] == [1024]


# what each reading, when the agent does not send it, takes away (and nothing is made up for it)
ABSENT = [
    ("cpu_user_usec", ["container_cpu_user_seconds_total"]),
    ("cpu_nr_periods", ["container_cpu_cfs_periods_total"]),
    ("memory_peak", ["container_memory_max_usage_bytes"]),
    ("memory_kernel", ["container_memory_kernel_usage"]),
    ("memory_swap_current", ["container_memory_swap"]),
    ("memory_events_max", ["container_memory_failcnt"]),
    ("memory_swap_max", ["container_spec_memory_swap_limit_bytes"]),
    ("memory_max", ["container_spec_memory_limit_bytes", "container_spec_memory_swap_limit_bytes"]),
    ("cpu_max_quota_usec", ["container_spec_cpu_quota"]),
    ("cpu_weight", ["container_spec_cpu_shares"]),
    ("pids_max", ["container_threads_max"]),
    ("file_descriptors", ["container_file_descriptors"]),
    ("fs_bytes", ["container_fs_limit_bytes"]),
    (
        "io",
        [
            "container_fs_reads_bytes_total",
            "container_fs_writes_bytes_total",
            "container_fs_reads_total",
            "container_fs_writes_total",
            "container_blkio_device_usage_total",
        ],
    ),
    ("hugetlb", ["container_hugetlb_usage_bytes"]),
    ("psi_io_full_usec", ["container_pressure_io_stalled_seconds_total"]),
]


@pytest.mark.parametrize(("field", "gone"), ABSENT, ids=[f for f, _ in ABSENT])
def test_a_reading_the_agent_did_not_send_leaves_its_metrics_out(field: str, gone: list[str]) -> None:
    before = set(by_name(values()))
    after = set(by_name(values(sample(dataclasses.replace(FULL, **{field: None})))))
    assert before - after == set(gone)


def test_an_older_agent_gives_the_metrics_of_the_fields_it_always_sent() -> None:
    assert set(by_name(values(sample(CgroupReadings(), None)))) == {
        "container_last_seen",
        "container_start_time_seconds",
        "container_cpu_usage_seconds_total",
        "container_memory_usage_bytes",
        "container_memory_working_set_bytes",
        "container_memory_rss",
        "container_memory_failures_total",
        "container_fs_usage_bytes",
        "container_threads",
    }


def test_a_container_not_started_has_no_start_time() -> None:
    vs = cri_metrics.container_values(POD, dataclasses.replace(CTR, started_ns=0), sample(), NOW_NS, (0, 0))
    assert "container_start_time_seconds" not in by_name(vs)


# ---- the network, as the pod sees it --------------------------------------------------------------


def test_a_macvtap_counts_as_the_pods_nic_does() -> None:
    assert cri_metrics.pod_side("macvtap", LINK) == LINK


def test_a_tap_counts_from_the_other_end_of_the_link() -> None:
    pod = cri_metrics.pod_side("tap", LINK)
    assert (pod.rx_bytes, pod.rx_packets, pod.rx_errors, pod.rx_dropped) == (500, 5, 3, 4)
    assert (pod.tx_bytes, pod.tx_packets, pod.tx_errors, pod.tx_dropped) == (1000, 10, 1, 2)
    assert cri_metrics.pod_side("tap", pod) == LINK


def test_pod_level_values_have_empty_container_and_image_labels() -> None:
    vs = by_name(cri_metrics.pod_values(POD, (("eth0", LINK),)))
    assert len(vs) == 8
    (rx,) = vs["container_network_receive_bytes_total"]
    assert rx.labels == ("web", "shop", "", POD.sandbox_id, "", "eth0") and rx.value == 1000
    assert vs["container_network_transmit_errors_total"][0].value == 3
    assert vs["container_network_receive_packets_dropped_total"][0].value == 2


# ---- the agent's stats body, read defensively -----------------------------------------------------

OLD_BODY: dict[str, Any] = {
    "timestamp_ns": 1,
    "cpu_usage_ns": 2,
    "memory_usage_bytes": 3,
    "memory_working_set": 4,
    "memory_rss_bytes": 5,
    "memory_page_faults": 6,
    "memory_major_faults": 7,
    "pids": 8,
}


def test_a_body_without_the_new_fields_reads_as_none_of_them() -> None:
    s = stats_from_body(OLD_BODY)
    assert s.readings == CgroupReadings() and s.oom_kills is None


def test_every_reading_of_a_body_is_read() -> None:
    body = {
        **OLD_BODY,
        **{f.name: i + 1 for i, f in enumerate(dataclasses.fields(CgroupReadings)) if f.name not in ("io", "hugetlb")},
        "io": [{"major": 254, "minor": 16, "rbytes": 1, "wbytes": 2, "rios": 3, "wios": 4, "dbytes": 9}],
        "hugetlb": {"2MB": 5, "1GB": 0},
        "oom_kills": 2,
    }
    s = stats_from_body(body)
    assert s.oom_kills == 2
    assert s.readings.io == (IoDevice(254, 16, 1, 2, 3, 4),)
    assert s.readings.hugetlb == (("1GB", 0), ("2MB", 5))
    assert s.readings.cpu_user_usec == 1 and s.readings.fs_inodes_free is not None


@pytest.mark.parametrize(
    "extra",
    [
        {"memory_peak": -1},
        {"memory_peak": "12"},
        {"memory_peak": 1.5},
        {"memory_peak": True},
        {"memory_peak": None},
        {"memory_peak": INT64_MAX + 1},
        {"oom_kills": -3},
        {"io": {}},
        {"io": [1]},
        {"io": [{"major": 1, "minor": 2, "rbytes": 0, "wbytes": 0, "rios": 0}]},  # no wios
        {"io": [{"major": 1 << 40, "minor": 0, "rbytes": 0, "wbytes": 0, "rios": 0, "wios": 0}]},
        {"io": [{"major": 1, "minor": 1, "rbytes": 0, "wbytes": 0, "rios": 0, "wios": 0}] * (IO_DEVICES_MAX + 1)},
        {"hugetlb": []},
        {"hugetlb": {"../x": 1}},
        {"hugetlb": {"2MB": -1}},
        {"hugetlb": {f"{i}MB": 1 for i in range(HUGETLB_SIZES_MAX + 1)}},
    ],
)
def test_a_bad_reading_is_a_protocol_error(extra: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError):
        stats_from_body({**OLD_BODY, **extra})


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_keys = st.sampled_from([f.name for f in dataclasses.fields(CgroupReadings)] + ["oom_kills", "pids", "timestamp_ns"])


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(_keys, _json | st.integers(min_value=-(1 << 70), max_value=1 << 70), max_size=12),
    st.dictionaries(st.text(max_size=8), _json, max_size=4),
)
def test_a_hostile_body_is_a_protocol_error_or_bounded_readings(fields: dict[str, Any], junk: dict[str, Any]) -> None:
    try:
        s = stats_from_body({**junk, **OLD_BODY, **fields})
    except ProtocolError:
        return
    for f in dataclasses.fields(CgroupReadings):
        v = getattr(s.readings, f.name)
        if isinstance(v, int):
            assert 0 <= v <= INT64_MAX
    assert len(s.readings.io or ()) <= IO_DEVICES_MAX
    assert len(s.readings.hugetlb or ()) <= HUGETLB_SIZES_MAX
    # whatever was accepted turns into values that agree with their descriptors
    for v in values(s):
        assert len(v.labels) == len(BY_NAME[v.name].label_keys)
        assert 0 <= v.value < 1 << 64


# ---- the host-side counters ---------------------------------------------------------------------


def _net(root: Path, name: str, counters: dict[str, str]) -> None:
    stats = root / "class" / "net" / name / "statistics"
    stats.mkdir(parents=True)
    for k, v in counters.items():
        (stats / k).write_text(v)


COUNTERS = {f.name: f"{i * 10}\n" for i, f in enumerate(dataclasses.fields(LinkCounters))}


def test_link_counters_are_read_from_sysfs(tmp_path: Path) -> None:
    _net(tmp_path, "vmt0123456789ab", COUNTERS)
    got = sysfs.link_counters("vmt0123456789ab", tmp_path)
    assert got == LinkCounters(*(i * 10 for i in range(8)))


@pytest.mark.parametrize(
    ("name", "counters"),
    [
        ("vmt0123456789ab", {**COUNTERS, "tx_dropped": "x\n"}),
        ("vmt0123456789ab", {**COUNTERS, "tx_dropped": "9" * 30}),
        ("vmt0123456789ab", {**COUNTERS, "tx_dropped": str(1 << 64)}),
        ("vmt0123456789ab", {k: v for k, v in COUNTERS.items() if k != "rx_errors"}),
        ("..", COUNTERS),
        ("a" * 16, COUNTERS),
    ],
)
def test_link_counters_that_do_not_read_as_counts_are_none(tmp_path: Path, name: str, counters: dict[str, str]) -> None:
    if name != "..":
        _net(tmp_path, name, counters)
    assert sysfs.link_counters(name, tmp_path) is None


def test_a_counter_file_that_is_a_symlink_is_not_followed(tmp_path: Path) -> None:
    _net(tmp_path, "vmt1", {k: v for k, v in COUNTERS.items() if k != "rx_bytes"})
    (tmp_path / "secret").write_text("42\n")
    os.symlink(tmp_path / "secret", tmp_path / "class/net/vmt1/statistics/rx_bytes")
    assert sysfs.link_counters("vmt1", tmp_path) is None


# ---- through the CRI ----------------------------------------------------------------------------


@pytest.fixture
def server() -> Any:
    with cri_server() as s:
        yield s


def test_the_descriptors_are_the_table(server: Server) -> None:
    code, details, body = server.rpc("ListMetricDescriptors", pb.ListMetricDescriptorsRequest())
    assert code == grpc.StatusCode.OK, details
    got = pb.ListMetricDescriptorsResponse.FromString(body).descriptors
    assert [(d.name, d.help, tuple(d.label_keys)) for d in got] == [(d.name, d.help, d.label_keys) for d in DESCRIPTORS]


def test_every_ready_pod_is_listed_with_its_running_containers_values(server: Server) -> None:
    assert server.sandboxes.records.change_container(SEED_CONTAINER, state=CONTAINER_RUNNING) is not None
    assert server.containers is not None
    server.containers.stats = lambda container_id: sample()  # type: ignore[method-assign]  # no guest here
    before = time.time_ns()
    code, details, body = server.rpc("ListPodSandboxMetrics", pb.ListPodSandboxMetricsRequest())
    assert code == grpc.StatusCode.OK, details
    pods = {m.pod_sandbox_id: m for m in pb.ListPodSandboxMetricsResponse.FromString(body).pod_metrics}
    assert set(pods) == set(SEED_SANDBOXES)
    assert not pods[SEED_SANDBOXES[1]].container_metrics and not pods[SEED_SANDBOXES[1]].metrics  # no NIC
    (cm,) = pods[SEED_SANDBOXES[0]].container_metrics
    assert cm.container_id == SEED_CONTAINER
    for m in cm.metrics:
        d = BY_NAME[m.name]
        assert len(m.label_values) == len(d.label_keys)
        assert m.metric_type == (pb.COUNTER if d.kind == cri_metrics.COUNTER else pb.GAUGE)
        assert m.timestamp >= before
        assert m.label_values[:5] == ["seed-0", "default", "app", SEED_CONTAINER, ""]
    usage = [m.value.value for m in cm.metrics if m.name == "container_cpu_usage_seconds_total"]
    assert usage == [4]


def test_a_container_whose_guest_fails_is_left_out_not_the_list(server: Server) -> None:
    from vmsandbox.errors import InfrastructureError

    assert server.sandboxes.records.change_container(SEED_CONTAINER, state=CONTAINER_RUNNING) is not None
    assert server.containers is not None

    def lost(container_id: str) -> CgroupStats:
        raise InfrastructureError("the agent answered garbage")

    server.containers.stats = lost  # type: ignore[method-assign]
    code, details, body = server.rpc("ListPodSandboxMetrics", pb.ListPodSandboxMetricsRequest())
    assert code == grpc.StatusCode.OK, details
    pods = pb.ListPodSandboxMetricsResponse.FromString(body).pod_metrics
    assert len(pods) == len(SEED_SANDBOXES) and not any(p.container_metrics for p in pods)


# ---- through the proxy: both sides' pods --------------------------------------------------------


class _Downstream:
    def __init__(self, reply: bytes) -> None:
        self.reply = reply
        self.asked: list[str] = []

    def call(self, path: str, data: bytes, context: Any = None, cap_s: float | None = None) -> bytes:
        self.asked.append(path)
        return self.reply


class _Runtime:
    def ListPodSandboxMetrics(self, request: Any, context: Any) -> pb.ListPodSandboxMetricsResponse:
        return pb.ListPodSandboxMetricsResponse(pod_metrics=[pb.PodSandboxMetrics(pod_sandbox_id="vm")])


def test_the_proxy_concatenates_both_sides_pods() -> None:
    assert routing.METHODS["ListPodSandboxMetrics"] == routing.Kind.MERGE
    assert routing.METHODS["ListMetricDescriptors"] == routing.Kind.DOWNSTREAM
    theirs = pb.ListPodSandboxMetricsResponse(pod_metrics=[pb.PodSandboxMetrics(pod_sandbox_id="runc")])
    down = _Downstream(theirs.SerializeToString() + b"\xfa\x3e\x00")  # with a field this proto does not know
    proxy = Proxy(_Runtime(), None, None, down, None, [])  # type: ignore[arg-type]
    method = pb.DESCRIPTOR.services_by_name["RuntimeService"].methods_by_name["ListPodSandboxMetrics"]
    reply = proxy._route(method, routing.Kind.MERGE)(b"", None)  # type: ignore[arg-type]
    assert down.asked == ["/runtime.v1.RuntimeService/ListPodSandboxMetrics"]
    merged = pb.ListPodSandboxMetricsResponse.FromString(reply)
    assert [m.pod_sandbox_id for m in merged.pod_metrics] == ["runc", "vm"]
