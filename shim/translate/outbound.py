"""Core -> RuntimeService replies: sandboxes and containers as the CRI lists and reports them."""

from __future__ import annotations

import json

from gen.cri.runtime.v1 import api_pb2 as pb
from shim.model import Condition, ContainerRecord, SandboxRecord
from vmsandbox import states
from vmsandbox.network import NAMESPACE_MODES, NamespaceOptions
from vmsandbox.sizing import LinuxResources
from vmsandbox.userns import IdMapping, UserNamespace


def sandbox_state(state: str) -> int:
    return int(pb.SANDBOX_READY if state == states.SANDBOX_READY else pb.SANDBOX_NOTREADY)


def container_state(state: str) -> int:
    return int(pb.ContainerState.Value(state))


def pod_metadata(r: SandboxRecord) -> pb.PodSandboxMetadata:
    return pb.PodSandboxMetadata(name=r.meta.name, namespace=r.meta.namespace, uid=r.meta.uid, attempt=r.meta.attempt)


def pod_sandbox(r: SandboxRecord) -> pb.PodSandbox:
    return pb.PodSandbox(
        id=r.id,
        metadata=pod_metadata(r),
        state=sandbox_state(r.state),  # type: ignore[arg-type]
        created_at=r.created_ns,
        labels=r.labels,
        annotations=r.annotations,
        runtime_handler=r.runtime_handler,
    )


def pod_sandbox_status(r: SandboxRecord) -> pb.PodSandboxStatus:
    return pb.PodSandboxStatus(
        id=r.id,
        metadata=pod_metadata(r),
        state=sandbox_state(r.state),  # type: ignore[arg-type]
        created_at=r.created_ns,
        labels=r.labels,
        annotations=r.annotations,
        runtime_handler=r.runtime_handler,
        network=_network_status(r),
        linux=pb.LinuxPodSandboxStatus(namespaces=pb.Namespace(options=_namespace_option_msg(r.namespaces, r.userns))),
    )


def _network_status(r: SandboxRecord) -> pb.PodSandboxNetworkStatus:
    network = r.network
    ips = network.ips if network is not None else ()
    return pb.PodSandboxNetworkStatus(ip=ips[0] if ips else "", additional_ips=[pb.PodIP(ip=ip) for ip in ips[1:]])


def _namespace_option_msg(o: NamespaceOptions, ns: UserNamespace | None = None) -> pb.NamespaceOption:
    msg = pb.NamespaceOption(
        network=NAMESPACE_MODES.index(o.network),  # type: ignore[arg-type]
        pid=NAMESPACE_MODES.index(o.pid),  # type: ignore[arg-type]
        ipc=NAMESPACE_MODES.index(o.ipc),  # type: ignore[arg-type]
        target_id=o.target_id,
    )
    if ns is not None:  # the pod's own user namespace, echoed as the kubelet sent it

        def ids(items: tuple[IdMapping, ...]) -> list[pb.IDMapping]:
            return [pb.IDMapping(host_id=m.host_id, container_id=m.container_id, length=m.length) for m in items]

        msg.userns_options.CopyFrom(pb.UserNamespace(mode=pb.POD, uids=ids(ns.uids), gids=ids(ns.gids)))
    return msg


def sandbox_info(r: SandboxRecord) -> dict[str, str]:
    """The verbose ``info`` map: one JSON document under the key "info", as containerd does."""
    record = r.to_doc()
    doc = {
        "domain": r.domain,
        "profile": r.profile,
        "sizing_mode": r.shape.demand.mode if r.shape is not None else "",
        "shape": record["shape"],
        "pinned_cpus": record["cpus"],
        "emulator_cpus": record["emulator_cpus"],
        "hugepages": [{"node": n, "page_size": s, "pages": c} for n, s, c in r.hugepages],
        "devices": record["devices"],
        "accel": r.accel,
        "qemu_uid": r.qemu_uid,
        "boot_ms": r.boot_ms,
        "guest": record["guest"],
        "declaration": record["declaration"],
        "ephemeral_storage_bytes": r.shape.demand.ephemeral_storage_bytes if r.shape is not None else 0,
        "linux_overhead": record["linux_overhead"],
        "updated_resources": record["updated_resources"],
        "growth": record["growth"],
    }
    return {"info": json.dumps(doc, sort_keys=True)}


def container_metadata(c: ContainerRecord) -> pb.ContainerMetadata:
    return pb.ContainerMetadata(name=c.name, attempt=c.attempt)


def container(c: ContainerRecord) -> pb.Container:
    return pb.Container(
        id=c.id,
        pod_sandbox_id=c.sandbox_id,
        metadata=container_metadata(c),
        image=pb.ImageSpec(image=c.image),
        image_ref=c.image_ref or c.image,
        image_id=c.image_id,
        state=container_state(c.state),  # type: ignore[arg-type]
        created_at=c.created_ns,
        labels=c.labels,
        annotations=c.annotations,
    )


def page_size_text(size: int) -> str:
    """Bytes -> the CRI's hugepage size spelling ("2MB", "1GB")."""
    for unit, factor in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if size % factor == 0:
            return f"{size // factor}{unit}"
    return f"{size}B"


def linux_resources_msg(r: LinuxResources) -> pb.LinuxContainerResources:
    """A recorded ``LinuxResources`` back into the CRI message."""
    return pb.LinuxContainerResources(
        cpu_period=r.cpu_period,
        cpu_quota=r.cpu_quota,
        cpu_shares=r.cpu_shares,
        memory_limit_in_bytes=r.memory_limit_bytes,
        cpuset_cpus=r.cpuset_cpus,
        hugepage_limits=[
            pb.HugepageLimit(page_size=page_size_text(size), limit=limit) for size, limit in r.hugepage_limits
        ],
    )


def container_status(c: ContainerRecord) -> pb.ContainerStatus:
    log_path = c.log_path
    if log_path and c.log_directory and not log_path.startswith("/"):
        log_path = f"{c.log_directory.rstrip('/')}/{log_path}"  # the CRI wants it absolute
    return pb.ContainerStatus(
        id=c.id,
        metadata=container_metadata(c),
        state=container_state(c.state),  # type: ignore[arg-type]
        created_at=c.created_ns,
        started_at=c.started_ns,
        finished_at=c.finished_ns,
        exit_code=c.exit_code,
        image=pb.ImageSpec(image=c.image),
        image_ref=c.image_ref or c.image,
        image_id=c.image_id,
        reason=c.reason,
        message=c.message,
        labels=c.labels,
        annotations=c.annotations,
        log_path=log_path,
        resources=pb.ContainerResources(linux=linux_resources_msg(c.linux)),
        mounts=[
            pb.Mount(
                container_path=m.container_path,
                host_path=m.host_path,
                readonly=m.readonly,
                recursive_read_only=m.recursive_read_only,
                selinux_relabel=m.selinux_relabel,
                propagation=m.propagation,  # type: ignore[arg-type]
                image=pb.ImageSpec(image=m.image) if m.image else None,
                image_sub_path=m.image_sub_path,
            )
            for m in sorted(c.resources.mounts)
        ],
    )


def container_info(c: ContainerRecord) -> dict[str, str]:
    doc = c.to_doc()
    return {"info": json.dumps({"resources": doc["resources"], "linux": doc["linux"]}, sort_keys=True)}


def runtime_condition(c: Condition) -> pb.RuntimeCondition:
    return pb.RuntimeCondition(type=c.type, status=c.status, reason=c.reason, message=c.message)
