"""JSON-ready documents for the core values we persist (declaration, demand, shape, cgroup limits). Pure.

The state database stores these documents; ``*_from_doc`` rebuilds the frozen values exactly
(quantities are stored in canonical form, which round-trips).
"""

from __future__ import annotations

from typing import Any

from vmsandbox.resources import (
    CdiDevice,
    ContainerDeclaration,
    ContainerResources,
    Device,
    Mount,
    PodDeclaration,
    ResourceList,
)
from vmsandbox.sizing import LinuxResources, PodDemand, VmShape


def resources_doc(res: ContainerResources) -> dict[str, Any]:
    return {
        "requests": res.requests.as_strings(),
        "limits": res.limits.as_strings(),
        "mounts": [
            {
                "container_path": m.container_path,
                "host_path": m.host_path,
                "readonly": m.readonly,
                "recursive_read_only": m.recursive_read_only,
                "selinux_relabel": m.selinux_relabel,
                "propagation": m.propagation,
                # an image volume's (written only for those: other mounts' documents stay as they were)
                **({"image": m.image, "image_sub_path": m.image_sub_path} if m.image else {}),
            }
            for m in sorted(res.mounts)
        ],
        "devices": [
            {"container_path": d.container_path, "host_path": d.host_path, "permissions": d.permissions}
            for d in sorted(res.devices)
        ],
        "cdi_devices": [c.name for c in sorted(res.cdi_devices)],
    }


def mounts_from_doc(doc: dict[str, Any]) -> tuple[Mount, ...]:
    """The mounts of a ``resources_doc``, in its order."""
    return tuple(Mount(**m) for m in doc.get("mounts", []))


def resources_from_doc(doc: dict[str, Any], where: str) -> ContainerResources:
    return ContainerResources(
        requests=ResourceList.parse(doc.get("requests", {}), where=f"{where}: requests"),
        limits=ResourceList.parse(doc.get("limits", {}), where=f"{where}: limits"),
        mounts=frozenset(mounts_from_doc(doc)),
        devices=frozenset(Device(**d) for d in doc.get("devices", [])),
        cdi_devices=frozenset(CdiDevice(name) for name in doc.get("cdi_devices", [])),
    )


def declaration_doc(decl: PodDeclaration) -> dict[str, Any]:
    return {
        "init_containers": [{"name": c.name, **resources_doc(c.resources)} for c in decl.init_containers],
        "containers": [{"name": c.name, **resources_doc(c.resources)} for c in decl.containers],
    }


def declaration_from_doc(doc: dict[str, Any]) -> PodDeclaration:
    def one(c: dict[str, Any]) -> ContainerDeclaration:
        return ContainerDeclaration(name=c["name"], resources=resources_from_doc(c, f'container "{c["name"]}"'))

    return PodDeclaration(
        init_containers=tuple(one(c) for c in doc.get("init_containers", [])),
        containers=tuple(one(c) for c in doc.get("containers", [])),
    )


def demand_doc(d: PodDemand) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "cpu_millis": d.cpu_millis,
        "memory_bytes": d.memory_bytes,
        "hugepages": [list(p) for p in d.hugepages],
        "ephemeral_storage_bytes": d.ephemeral_storage_bytes,
        "extended": [list(e) for e in d.extended],
        "mode": d.mode,
    }
    if d.overhead_cpu_millis or d.overhead_memory_bytes:  # only when the kubelet sent a RuntimeClass overhead
        doc["overhead"] = {"cpu_millis": d.overhead_cpu_millis, "memory_bytes": d.overhead_memory_bytes}
    return doc


def demand_from_doc(doc: dict[str, Any]) -> PodDemand:
    return PodDemand(
        cpu_millis=doc["cpu_millis"],
        memory_bytes=doc["memory_bytes"],
        hugepages=tuple((int(s), int(b)) for s, b in doc.get("hugepages", [])),
        ephemeral_storage_bytes=doc.get("ephemeral_storage_bytes", 0),
        extended=tuple((str(n), int(c)) for n, c in doc.get("extended", [])),
        mode=doc.get("mode", "declared"),
        overhead_cpu_millis=int(doc.get("overhead", {}).get("cpu_millis", 0)),
        overhead_memory_bytes=int(doc.get("overhead", {}).get("memory_bytes", 0)),
    )


def shape_doc(s: VmShape) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "vcpus": s.vcpus,
        "memory_bytes": s.memory_bytes,
        "backing_page_size": s.backing_page_size,
        "guest_hugepages": [list(p) for p in s.guest_hugepages],
        "cpu_policy": s.cpu_policy,
        "demand": demand_doc(s.demand),
    }
    if s.has_headroom:  # written only when there is some
        doc["headroom"] = {"vcpus": s.headroom_vcpus, "memory_bytes": s.headroom_memory_bytes}
    return doc


def shape_from_doc(doc: dict[str, Any]) -> VmShape:
    return VmShape(
        vcpus=doc["vcpus"],
        memory_bytes=doc["memory_bytes"],
        backing_page_size=doc["backing_page_size"],
        guest_hugepages=tuple((int(s), int(c)) for s, c in doc.get("guest_hugepages", [])),
        cpu_policy=doc["cpu_policy"],
        demand=demand_from_doc(doc["demand"]),
        headroom_vcpus=int(doc.get("headroom", {}).get("vcpus", 0)),
        headroom_memory_bytes=int(doc.get("headroom", {}).get("memory_bytes", 0)),
    )


def linux_doc(r: LinuxResources) -> dict[str, Any]:
    """A ``LinuxResources`` as a document ({} when it says nothing)."""
    if r.empty:
        return {}
    return {
        "cpu_period": r.cpu_period,
        "cpu_quota": r.cpu_quota,
        "cpu_shares": r.cpu_shares,
        "memory_limit_bytes": r.memory_limit_bytes,
        "hugepage_limits": [list(p) for p in r.hugepage_limits],
        "cpuset_cpus": r.cpuset_cpus,
    }


def linux_from_doc(doc: dict[str, Any]) -> LinuxResources:
    return LinuxResources(
        cpu_period=int(doc.get("cpu_period", 0)),
        cpu_quota=int(doc.get("cpu_quota", 0)),
        cpu_shares=int(doc.get("cpu_shares", 0)),
        memory_limit_bytes=int(doc.get("memory_limit_bytes", 0)),
        hugepage_limits=tuple((int(size), int(limit)) for size, limit in doc.get("hugepage_limits", ())),
        cpuset_cpus=str(doc.get("cpuset_cpus", "")),
    )
