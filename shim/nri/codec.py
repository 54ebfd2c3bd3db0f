"""NRI's protobufs <-> the core's types: the shim's records as NRI's PodSandbox and Container, a
plugin's ContainerAdjustment (or a ContainerUpdate's resources) as ``vmsandbox.nri_rules.Adjustment``,
LinuxResources both ways, and another runtime's PodSandbox as ``vmsandbox.dra_runc.RuncPod`` (for
vmsandbox as that runtime's plugin, ``shim.dra.nri_plugin``). NRI's protobuf types stop here."""

from __future__ import annotations

from gen.nri import api_pb2 as api
from shim.model import CONTAINER_CREATED, CONTAINER_EXITED, CONTAINER_RUNNING, ContainerRecord, SandboxRecord
from vmsandbox import nri_rules
from vmsandbox.dra_runc import RuncPod, pod_netns
from vmsandbox.sizing import LinuxResources, PodDemand

_STATES = {
    CONTAINER_CREATED: api.CONTAINER_CREATED,
    CONTAINER_RUNNING: api.CONTAINER_RUNNING,
    CONTAINER_EXITED: api.CONTAINER_STOPPED,
}
_HUGEPAGE_LABELS = {2 << 20: "2MB", 1 << 30: "1GB"}


def resources(lr: LinuxResources) -> api.LinuxResources:
    out = api.LinuxResources()
    if lr.memory_limit_bytes:
        out.memory.limit.value = lr.memory_limit_bytes
    if lr.cpu_shares:
        out.cpu.shares.value = lr.cpu_shares
    if lr.cpu_quota:
        out.cpu.quota.value = lr.cpu_quota
    if lr.cpu_period:
        out.cpu.period.value = lr.cpu_period
    if lr.cpuset_cpus:
        out.cpu.cpus = lr.cpuset_cpus
    for size, limit in lr.hugepage_limits:
        out.hugepage_limits.add(page_size=_HUGEPAGE_LABELS.get(size, f"{size // 1024}KB"), limit=limit)
    return out


def demand_resources(demand: PodDemand) -> api.LinuxResources:
    """The pod's whole size as NRI's LinuxResources (``LinuxPodSandbox.pod_resources``)."""
    return resources(
        LinuxResources(
            cpu_period=100_000 if demand.cpu_millis else 0,
            cpu_quota=demand.cpu_millis * 100,
            cpu_shares=max(2, demand.cpu_millis * 1024 // 1000),
            memory_limit_bytes=demand.memory_bytes,
            hugepage_limits=demand.hugepages,
        )
    )


def pod(r: SandboxRecord) -> api.PodSandbox:
    out = api.PodSandbox(
        id=r.id,
        name=r.meta.name,
        uid=r.meta.uid,
        namespace=r.meta.namespace,
        labels=r.labels,
        annotations=r.annotations,
        runtime_handler=r.runtime_handler,
    )
    if r.shape is not None:
        out.linux.pod_resources.CopyFrom(demand_resources(r.shape.demand))
    if r.network is not None:
        out.ips.extend(r.network.ips)
    return out


def runc_pod(p: api.PodSandbox) -> RuncPod:
    """A pod of another runtime as its NRI tells of it (ids and names bounded; the namespace path
    is checked where it is opened)."""
    return RuncPod(
        sandbox_id=p.id[:128],
        uid=p.uid[:128],
        namespace=p.namespace[:253],
        name=p.name[:253],
        runtime_handler=p.runtime_handler[:253],
        netns=pod_netns([(ns.type, ns.path) for ns in p.linux.namespaces[:16]]),
    )


def container(c: ContainerRecord) -> api.Container:
    out = api.Container(
        id=c.id,
        pod_sandbox_id=c.sandbox_id,
        name=c.name,
        state=_STATES.get(c.state, api.CONTAINER_UNKNOWN),
        labels=c.labels,
        annotations=c.annotations,
        created_at=c.created_ns,
        started_at=c.started_ns,
        finished_at=c.finished_ns,
        exit_code=c.exit_code,
        status_reason=c.reason[:256],
    )
    out.linux.resources.CopyFrom(resources(c.linux))
    return out


def _set(msg: object, prefix: str) -> list[str]:
    """The fields of ``msg`` that are set, as dotted paths."""
    return [f"{prefix}{fd.name}" for fd, _ in msg.ListFields()]  # type: ignore[attr-defined]


def _resources_adjustment(r: api.LinuxResources) -> tuple[dict[str, object], list[str]]:
    out: dict[str, object] = {}
    if r.memory.HasField("limit"):
        out["memory_limit"] = r.memory.limit.value
    if r.cpu.HasField("quota"):
        out["cpu_quota"] = r.cpu.quota.value
    if r.cpu.HasField("period"):
        out["cpu_period"] = r.cpu.period.value
    if r.cpu.HasField("shares"):
        out["cpu_shares"] = r.cpu.shares.value
    if r.hugepage_limits:
        out["hugepage_limits"] = tuple((h.page_size, h.limit) for h in r.hugepage_limits)
    taken = {"memory.limit", "cpu.quota", "cpu.period", "cpu.shares", "hugepage_limits", "memory", "cpu"}
    unsupported = [
        f
        for f in (
            *_set(r, "linux.resources."),
            *_set(r.memory, "linux.resources.memory."),
            *_set(r.cpu, "linux.resources.cpu."),
        )
        if f.removeprefix("linux.resources.") not in taken
    ]
    return out, unsupported


def adjustment(adj: api.ContainerAdjustment) -> nri_rules.Adjustment:
    kwargs: dict[str, object] = {
        "annotations": tuple(adj.annotations.items()),
        "env": tuple((kv.key, kv.value) for kv in adj.env),
        "args": tuple(adj.args),
        "rlimits": tuple((r.type, r.hard, r.soft) for r in adj.rlimits),
        "mounts": tuple(nri_rules.AdjustMount(m.destination, m.source, m.type, tuple(m.options)) for m in adj.mounts),
    }
    unsupported = []
    if adj.CDI_devices:
        unsupported.append("CDI_devices")
    if adj.HasField("hooks") and adj.hooks.ListFields():
        unsupported.append("hooks")
    if adj.HasField("linux"):
        linux = adj.linux
        if linux.HasField("oom_score_adj"):
            kwargs["oom_score_adj"] = linux.oom_score_adj.value
        unsupported += [f for f in _set(linux, "linux.") if f not in ("linux.resources", "linux.oom_score_adj")]
        if linux.HasField("resources"):
            res, more = _resources_adjustment(linux.resources)
            kwargs.update(res)
            unsupported += more
    return nri_rules.Adjustment(unsupported=tuple(unsupported), **kwargs)  # type: ignore[arg-type]


def update(u: api.ContainerUpdate) -> nri_rules.Adjustment:
    """A ContainerUpdate's resources, as an adjustment of them alone."""
    res, unsupported = _resources_adjustment(u.linux.resources)
    return nri_rules.Adjustment(unsupported=tuple(unsupported), **res)  # type: ignore[arg-type]
