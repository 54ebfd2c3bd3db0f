"""Core -> the RuntimeService's stats and metrics replies: CPU, memory, writable layers, CRI metrics."""

from __future__ import annotations

from collections.abc import Iterable

from gen.cri.runtime.v1 import api_pb2 as pb
from shim.model import ContainerStats, SandboxStats
from shim.translate.outbound import container_metadata, pod_metadata
from vmsandbox import cri_metrics
from vmsandbox.agent_ops import CgroupStats


def _u64(v: int) -> pb.UInt64Value:
    return pb.UInt64Value(value=max(v, 0))


def cpu_usage(s: CgroupStats, nano_cores: int | None) -> pb.CpuUsage:
    cpu = pb.CpuUsage(timestamp=s.timestamp_ns, usage_core_nano_seconds=_u64(s.cpu_usage_ns))
    if nano_cores is not None:
        cpu.usage_nano_cores.CopyFrom(_u64(nano_cores))
    return cpu


def memory_usage(s: CgroupStats) -> pb.MemoryUsage:
    return pb.MemoryUsage(
        timestamp=s.timestamp_ns,
        working_set_bytes=_u64(s.memory_working_set_bytes),
        usage_bytes=_u64(s.memory_usage_bytes),
        rss_bytes=_u64(s.memory_rss_bytes),
        page_faults=_u64(s.page_faults),
        major_page_faults=_u64(s.major_page_faults),
    )


def container_stats(cs: ContainerStats, layer_mountpoint: str) -> pb.ContainerStats:
    """A container's stats; its writable layer (in guest memory) and its part of what the guest
    wrote in the sandbox's directory on the host (the CRI has no pod-level file system, and the
    kubelet adds the writable layers up against the pod's ephemeral-storage) are reported on
    ``layer_mountpoint``, the host directory ImageFsInfo names as the container file system, which
    the kubelet can stat."""
    c, s, nano_cores = cs.container, cs.sample, cs.nano_cores
    out = pb.ContainerStats(
        attributes=pb.ContainerAttributes(
            id=c.id, metadata=container_metadata(c), labels=c.labels, annotations=c.annotations
        )
    )
    if s is not None:
        out.cpu.CopyFrom(cpu_usage(s, nano_cores))
        out.memory.CopyFrom(memory_usage(s))
        out.writable_layer.CopyFrom(
            pb.FilesystemUsage(
                timestamp=s.timestamp_ns,
                fs_id=pb.FilesystemIdentifier(mountpoint=layer_mountpoint),
                used_bytes=_u64(s.writable_bytes + cs.shared_bytes),
                inodes_used=_u64(s.writable_inodes + cs.shared_inodes),
            )
        )
    return out


def pod_sandbox_stats(ss: SandboxStats, layer_mountpoint: str) -> pb.PodSandboxStats:
    r, s, nano_cores = ss.sandbox, ss.sample, ss.nano_cores
    linux = pb.LinuxPodSandboxStats(containers=[container_stats(c, layer_mountpoint) for c in ss.containers])
    if s is not None:
        linux.cpu.CopyFrom(cpu_usage(s, nano_cores))
        linux.memory.CopyFrom(memory_usage(s))
    return pb.PodSandboxStats(
        attributes=pb.PodSandboxAttributes(
            id=r.id, metadata=pod_metadata(r), labels=r.labels, annotations=r.annotations
        ),
        linux=linux,
    )


def metric_descriptors() -> list[pb.MetricDescriptor]:
    return [pb.MetricDescriptor(name=d.name, help=d.help, label_keys=d.label_keys) for d in cri_metrics.DESCRIPTORS]


_METRIC_TYPES = {cri_metrics.COUNTER: pb.COUNTER, cri_metrics.GAUGE: pb.GAUGE}


def _metrics(values: Iterable[cri_metrics.Value], timestamp_ns: int) -> list[pb.Metric]:
    return [
        pb.Metric(
            name=v.name,
            timestamp=timestamp_ns,
            metric_type=_METRIC_TYPES[v.kind],
            label_values=v.labels,
            value=_u64(v.value),
        )
        for v in values
    ]


def pod_sandbox_metrics(m: cri_metrics.PodMetrics) -> pb.PodSandboxMetrics:
    return pb.PodSandboxMetrics(
        pod_sandbox_id=m.sandbox_id,
        metrics=_metrics(m.values, m.timestamp_ns),
        container_metrics=[
            pb.ContainerMetrics(container_id=c.container_id, metrics=_metrics(c.values, c.timestamp_ns))
            for c in m.containers
        ],
    )
