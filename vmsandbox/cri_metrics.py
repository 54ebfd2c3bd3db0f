"""The CRI metrics of VM pods (``ListMetricDescriptors``, ``ListPodSandboxMetrics``) (pure).

The descriptors are containerd 2.4's (internal/cri/server/list_metric_descriptors*.go): the same
names, help texts and label keys, so a kubelet that reads the node's metrics through vmsandbox sees
one set whichever runtime runs a pod. critest 1.37 expects nine names containerd 2.4 does not
describe (hugetlb usage, pressure stall time, the spec's CPU quota); they are described here with
cAdvisor's help text and label keys (``beyond_containerd``).

The values are what a pod's guest and its host-side network device say, read at the call
(``container_values``, ``pod_values``), of the same kind containerd gives each name (counter or
gauge), with one label value per label key, in the keys' order. What cannot be read is left out,
never stood in for by a constant: an agent that does not send a field leaves its metrics out.
As in containerd, the container and image labels of pod-level values are empty, values are whole
numbers (seconds of CPU time truncated), and the ``failure_type``/``scope`` labels of
``container_memory_failures_total`` are ``pgfault``/``pgmajfault`` and ``container``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from vmsandbox.agent_ops import CgroupStats

Kind = Literal["counter", "gauge"]
COUNTER: Kind = "counter"
GAUGE: Kind = "gauge"

BASE_LABELS = ("pod", "namespace", "container", "id", "image")
NETWORK_LABELS = (*BASE_LABELS, "interface")
DISK_LABELS = (*BASE_LABELS, "device")


@dataclass(frozen=True)
class Descriptor:
    name: str
    help: str
    kind: Kind
    """The type of every value of this name (containerd's; cAdvisor's for the names beyond it)."""
    label_keys: tuple[str, ...] = BASE_LABELS
    beyond_containerd: bool = False
    """critest expects it; containerd 2.4 does not describe it."""


def _c(name: str, help: str, labels: tuple[str, ...] = BASE_LABELS) -> Descriptor:
    return Descriptor(name, help, COUNTER, labels)


def _g(name: str, help: str, labels: tuple[str, ...] = BASE_LABELS) -> Descriptor:
    return Descriptor(name, help, GAUGE, labels)


DESCRIPTORS: tuple[Descriptor, ...] = (
    # cpu
    _c("container_cpu_user_seconds_total", "Cumulative user CPU time consumed in seconds."),
    _c("container_cpu_system_seconds_total", "Cumulative system CPU time consumed in seconds."),
    _c("container_cpu_usage_seconds_total", "Cumulative CPU time consumed in seconds."),
    _c("container_cpu_cfs_periods_total", "Number of elapsed enforcement period intervals."),
    _c("container_cpu_cfs_throttled_periods_total", "Number of CPU throttled period intervals."),
    _c("container_cpu_cfs_throttled_seconds_total", "Total time duration the container has been throttled."),
    # memory
    _g("container_memory_cache", "Number of bytes of memory used by the container for caching purposes."),
    _g(
        "container_memory_rss",
        "Size of RSS in bytes, total anonymous memory and [swap cache memory used by the container.",
    ),
    _g(
        "container_memory_kernel_usage",
        "Size of kernel memory allocated to the container in bytes, includes page tables, socket buffers...",
    ),
    _g("container_memory_mapped_file", "Size of container's memory mapped files in bytes."),
    _g("container_memory_swap", "Container swap usage in bytes."),
    _c(
        "container_memory_failcnt",
        "Number of times container memory usage has hit its cgroup v1 upper memory limit, for cg2 this value "
        "is not currently supported",
    ),
    _g(
        "container_memory_usage_bytes",
        "Current memory usage in bytes, including all memory regardless of when it was accessed",
    ),
    _g("container_memory_max_usage_bytes", "Maximum container memory usage recorded in bytes"),
    _g(
        "container_memory_working_set_bytes",
        "Amount of memory that is actively used by the container, excluding cached memory.",
    ),
    _g(
        "container_memory_total_active_file_bytes",
        "Amount of cache memory bytes, in use by the container, in file on disk.",
    ),
    _g(
        "container_memory_total_inactive_file_bytes",
        "Amount of inactive cache memory bytes, for the container, in file on disk.",
    ),
    _c(
        "container_memory_failures_total",
        "Cumulative count of container memory allocation failures.",
        (*BASE_LABELS, "failure_type", "scope"),
    ),
    _c("container_oom_events_total", "Count of out of memory events observed for the container"),
    # network
    _c("container_network_receive_bytes_total", "Cumulative count of bytes received", NETWORK_LABELS),
    _c("container_network_receive_packets_total", "Cumulative count of packets received", NETWORK_LABELS),
    _c(
        "container_network_receive_packets_dropped_total",
        "Cumulative count of packets dropped while receiving",
        NETWORK_LABELS,
    ),
    _c(
        "container_network_receive_errors_total",
        "Cumulative count of errors encountered while receiving",
        NETWORK_LABELS,
    ),
    _c("container_network_transmit_bytes_total", "Cumulative count of bytes transmitted", NETWORK_LABELS),
    _c("container_network_transmit_packets_total", "Cumulative count of packets transmitted", NETWORK_LABELS),
    _c(
        "container_network_transmit_packets_dropped_total",
        "Cumulative count of packets dropped while transmitting",
        NETWORK_LABELS,
    ),
    _c(
        "container_network_transmit_errors_total",
        "Cumulative count of errors encountered while transmitting",
        NETWORK_LABELS,
    ),
    # disk usage
    _g("container_fs_inodes_free", "Number of available Inodes", DISK_LABELS),
    _g("container_fs_inodes_total", "Number of Inodes", DISK_LABELS),
    _g(
        "container_fs_limit_bytes",
        "Number of bytes that can be consumed by the container on this filesystem.",
        DISK_LABELS,
    ),
    _g(
        "container_fs_usage_bytes",
        "Number of bytes that are consumed by the container on this filesystem.",
        DISK_LABELS,
    ),
    # disk IO
    _c("container_fs_reads_bytes_total", "Cumulative count of bytes read", DISK_LABELS),
    _c("container_fs_reads_total", "Cumulative count of reads completed", DISK_LABELS),
    _c("container_fs_writes_bytes_total", "Cumulative count of bytes written", DISK_LABELS),
    _c("container_fs_writes_total", "Cumulative count of writes completed", DISK_LABELS),
    _c("container_blkio_device_usage_total", "Blkio device bytes usage", (*DISK_LABELS, "major", "minor", "operation")),
    # processes
    _g("container_processes", "Number of processes running inside the container."),
    _g("container_file_descriptors", "Number of open file descriptors for the container."),
    _g("container_sockets", "Number of open sockets for the container."),
    _g("container_threads_max", "Maximum number of threads allowed inside the container, infinity if value is zero"),
    _g("container_threads", "Number of threads running inside the container"),
    _g(
        "container_ulimits_soft",
        "Soft ulimit values for the container root process. Unlimited if -1, except priority and nice",
        (*BASE_LABELS, "ulimit"),
    ),
    # miscellaneous
    _g("container_last_seen", "Last time a container was seen by the exporter"),
    _g("container_start_time_seconds", "Start time of the container since unix epoch in seconds"),
    # the container's spec
    _g("container_spec_cpu_period", "CPU period of the container"),
    _g("container_spec_cpu_shares", "CPU share of the container"),
    _g("container_spec_memory_limit_bytes", "Memory limit for the container"),
    _g("container_spec_memory_reservation_limit_bytes", "Memory reservation limit for the container"),
    _g("container_spec_memory_swap_limit_bytes", "Memory swap limit for the container"),
    # critest's names that containerd 2.4 does not describe: cAdvisor's help and labels
    Descriptor("container_spec_cpu_quota", "CPU quota of the container.", GAUGE, beyond_containerd=True),
    Descriptor(
        "container_hugetlb_usage_bytes",
        "Current hugepage usage in bytes",
        GAUGE,
        (*BASE_LABELS, "pagesize"),
        beyond_containerd=True,
    ),
    Descriptor(
        "container_hugetlb_max_usage_bytes",
        "Maximum hugepage usage recorded in bytes",
        GAUGE,
        (*BASE_LABELS, "pagesize"),
        beyond_containerd=True,
    ),
    Descriptor(
        "container_pressure_cpu_stalled_seconds_total",
        "Total time duration no tasks in the container could make progress due to CPU congestion.",
        COUNTER,
        beyond_containerd=True,
    ),
    Descriptor(
        "container_pressure_cpu_waiting_seconds_total",
        "Total time duration tasks in the container have waited due to CPU congestion.",
        COUNTER,
        beyond_containerd=True,
    ),
    Descriptor(
        "container_pressure_memory_stalled_seconds_total",
        "Total time duration no tasks in the container could make progress due to memory congestion.",
        COUNTER,
        beyond_containerd=True,
    ),
    Descriptor(
        "container_pressure_memory_waiting_seconds_total",
        "Total time duration tasks in the container have waited due to memory congestion.",
        COUNTER,
        beyond_containerd=True,
    ),
    Descriptor(
        "container_pressure_io_stalled_seconds_total",
        "Total time duration no tasks in the container could make progress due to IO congestion.",
        COUNTER,
        beyond_containerd=True,
    ),
    Descriptor(
        "container_pressure_io_waiting_seconds_total",
        "Total time duration tasks in the container have waited due to IO congestion.",
        COUNTER,
        beyond_containerd=True,
    ),
)
BY_NAME: dict[str, Descriptor] = {d.name: d for d in DESCRIPTORS}

# what a value of a container carries in its "device" label for its root file system (containerd's)
ROOT_DEVICE = "/"
_USEC_PER_S = 1_000_000
_NS_PER_S = 1_000_000_000


@dataclass(frozen=True)
class Value:
    """One metric value: its name, type and label values (one per key of its descriptor)."""

    name: str
    kind: Kind
    labels: tuple[str, ...]
    value: int


@dataclass(frozen=True)
class ContainerMetrics:
    container_id: str
    timestamp_ns: int  # host clock, when its values were read
    values: tuple[Value, ...]


@dataclass(frozen=True)
class PodMetrics:
    """One pod's answer in ``ListPodSandboxMetrics``: its own values and its containers'."""

    sandbox_id: str
    timestamp_ns: int  # host clock, when its own values were read
    values: tuple[Value, ...]
    containers: tuple[ContainerMetrics, ...]


@dataclass(frozen=True)
class PodIdentity:
    name: str
    namespace: str
    sandbox_id: str


@dataclass(frozen=True)
class ContainerIdentity:
    name: str
    id: str
    image: str
    started_ns: int  # host clock; 0: not started


@dataclass(frozen=True)
class LinkCounters:
    """A network device's counters (``statistics/`` of its sysfs directory)."""

    rx_bytes: int
    rx_packets: int
    rx_errors: int
    rx_dropped: int
    tx_bytes: int
    tx_packets: int
    tx_errors: int
    tx_dropped: int


DeviceKind = Literal["macvtap", "tap"]


def pod_side(kind: DeviceKind, host: LinkCounters) -> LinkCounters:
    """What a guest NIC's host-side device counts, turned to the pod's side of the link.

    A ``tap`` is the other end of the guest's NIC: what the host transmits on it QEMU reads and the
    guest receives, so the directions swap. A passthru ``macvtap`` counts as the pod's NIC does:
    frames arriving on the lower device for the guest are its receive, frames the guest writes
    are its transmit (measured on a 6.1 host: the guest's /proc/net/dev agrees, less the few
    frames the host's own stack sends on the macvtap, which it counts as transmitted)."""
    if kind == "macvtap":
        return host
    return LinkCounters(
        rx_bytes=host.tx_bytes,
        rx_packets=host.tx_packets,
        rx_errors=host.tx_errors,
        rx_dropped=host.tx_dropped,
        tx_bytes=host.rx_bytes,
        tx_packets=host.rx_packets,
        tx_errors=host.rx_errors,
        tx_dropped=host.rx_dropped,
    )


def _value(name: str, labels: tuple[str, ...], value: int) -> Value:
    return Value(name, BY_NAME[name].kind, labels, value)


def pod_values(pod: PodIdentity, links: tuple[tuple[str, LinkCounters], ...]) -> list[Value]:
    """The pod-level values: its network, per interface (the name the pod's network gave it), as
    the pod sees it."""
    out: list[Value] = []
    for interface, c in links:
        labels = (pod.name, pod.namespace, "", pod.sandbox_id, "", interface)
        for name, v in (
            ("container_network_receive_bytes_total", c.rx_bytes),
            ("container_network_receive_packets_total", c.rx_packets),
            ("container_network_receive_packets_dropped_total", c.rx_dropped),
            ("container_network_receive_errors_total", c.rx_errors),
            ("container_network_transmit_bytes_total", c.tx_bytes),
            ("container_network_transmit_packets_total", c.tx_packets),
            ("container_network_transmit_packets_dropped_total", c.tx_dropped),
            ("container_network_transmit_errors_total", c.tx_errors),
        ):
            out.append(_value(name, labels, v))
    return out


def shares_from_weight(weight: int) -> int:
    """cgroup v2 ``cpu.weight`` back to v1 CPU shares (the inverse crun and runc use, cAdvisor's)."""
    return 2 + ((weight - 1) * 262142) // 9999


def container_values(
    pod: PodIdentity,
    c: ContainerIdentity,
    s: CgroupStats,
    now_ns: int,
    fs_used: tuple[int, int],
    cpu_shares: int = 0,
) -> list[Value]:
    """One running container's values from its guest's sample ``s``. ``now_ns``: the host's clock
    (``container_last_seen``); ``fs_used``: (bytes, inodes) of its writable layer, as its CRI stats
    report them; ``cpu_shares``: the shares it was given (0: none, then they follow from its
    ``cpu.weight``)."""
    r = s.readings
    base = (pod.name, pod.namespace, c.name, c.id, c.image)
    out: list[Value] = []

    def add(name: str, value: int | None, extra: tuple[str, ...] = ()) -> None:
        if value is not None:
            out.append(_value(name, (*base, *extra), value))

    def sec(usec: int | None) -> int | None:
        return None if usec is None else usec // _USEC_PER_S

    add("container_last_seen", now_ns // _NS_PER_S)
    add("container_start_time_seconds", c.started_ns // _NS_PER_S if c.started_ns else None)
    # cpu
    add("container_cpu_usage_seconds_total", s.cpu_usage_ns // _NS_PER_S)
    add("container_cpu_user_seconds_total", sec(r.cpu_user_usec))
    add("container_cpu_system_seconds_total", sec(r.cpu_system_usec))
    add("container_cpu_cfs_periods_total", r.cpu_nr_periods)
    add("container_cpu_cfs_throttled_periods_total", r.cpu_nr_throttled)
    add("container_cpu_cfs_throttled_seconds_total", sec(r.cpu_throttled_usec))
    # memory
    add("container_memory_usage_bytes", s.memory_usage_bytes)
    add("container_memory_max_usage_bytes", r.memory_peak)
    add("container_memory_working_set_bytes", s.memory_working_set_bytes)
    add("container_memory_rss", s.memory_rss_bytes)
    add("container_memory_cache", r.memory_file)
    add("container_memory_kernel_usage", r.memory_kernel)
    add("container_memory_mapped_file", r.memory_file_mapped)
    add("container_memory_swap", r.memory_swap_current)
    add("container_memory_failcnt", r.memory_events_max)  # memory.events "max": usage hit memory.max
    add("container_memory_total_active_file_bytes", r.memory_active_file)
    add("container_memory_total_inactive_file_bytes", r.memory_inactive_file)
    add("container_memory_failures_total", s.page_faults, ("pgfault", "container"))
    add("container_memory_failures_total", s.major_page_faults, ("pgmajfault", "container"))
    add("container_oom_events_total", s.oom_kills)
    # the writable layer's file system
    add("container_fs_usage_bytes", fs_used[0], (ROOT_DEVICE,))
    add("container_fs_limit_bytes", r.fs_bytes, (ROOT_DEVICE,))
    add("container_fs_inodes_total", r.fs_inodes, (ROOT_DEVICE,))
    add("container_fs_inodes_free", r.fs_inodes_free, (ROOT_DEVICE,))
    # block IO on the guest's devices
    for d in r.io or ():
        device = f"{d.major}:{d.minor}"
        add("container_fs_reads_bytes_total", d.rbytes, (device,))
        add("container_fs_writes_bytes_total", d.wbytes, (device,))
        add("container_fs_reads_total", d.rios, (device,))
        add("container_fs_writes_total", d.wios, (device,))
        add("container_blkio_device_usage_total", d.rbytes, (device, str(d.major), str(d.minor), "Read"))
        add("container_blkio_device_usage_total", d.wbytes, (device, str(d.major), str(d.minor), "Write"))
    # processes
    add("container_processes", r.processes)
    add("container_threads", s.pids)  # pids.current counts tasks: threads
    add("container_threads_max", r.pids_max)
    add("container_file_descriptors", r.file_descriptors)
    add("container_sockets", r.sockets)
    # pressure stall time
    add("container_pressure_cpu_waiting_seconds_total", sec(r.psi_cpu_some_usec))
    add("container_pressure_cpu_stalled_seconds_total", sec(r.psi_cpu_full_usec))
    add("container_pressure_memory_waiting_seconds_total", sec(r.psi_memory_some_usec))
    add("container_pressure_memory_stalled_seconds_total", sec(r.psi_memory_full_usec))
    add("container_pressure_io_waiting_seconds_total", sec(r.psi_io_some_usec))
    add("container_pressure_io_stalled_seconds_total", sec(r.psi_io_full_usec))
    for size, used in r.hugetlb or ():
        add("container_hugetlb_usage_bytes", used, (size,))
    # the spec, as the guest's cgroup enforces it
    add("container_spec_cpu_period", r.cpu_max_period_usec)
    add("container_spec_cpu_quota", r.cpu_max_quota_usec)
    if cpu_shares > 0:
        add("container_spec_cpu_shares", cpu_shares)
    elif r.cpu_weight is not None and r.cpu_weight > 0:
        add("container_spec_cpu_shares", shares_from_weight(r.cpu_weight))
    add("container_spec_memory_limit_bytes", r.memory_max)
    add("container_spec_memory_reservation_limit_bytes", r.memory_low)
    if r.memory_max is not None and r.memory_swap_max is not None:
        # the CRI's swap limit is memory plus swap (cgroup v1's memsw); v2 keeps swap alone
        add("container_spec_memory_swap_limit_bytes", r.memory_max + r.memory_swap_max)
    return out
