"""RuntimeService requests -> core: the pod's and containers' specs, what a container runs, list filters.

Each RPC that changes state gets one value (``shim.model``: ``RunPodSandbox``, ``StopPodSandbox``,
``RemovePodSandbox``, ``UpdatePodSandboxResources``, ``CreateContainer``, ``StartContainer``,
``StopContainer``, ``RemoveContainer``, ``UpdateContainerResources``), checked here and nowhere
else: required fields present, names, attempts, timeouts and ids in range, and the shapes the
protobuf types cannot check (quantities, page sizes, mounts, and names, labels and annotations by
Kubernetes' rules: ``vmsandbox.validation``). A bad one raises ``InvalidArgument`` naming the
field, so nothing malformed reaches the RPC's steps (``shim.rpc``), a log line or the domain XML.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping
from typing import Any

from gen.cri.runtime.v1 import api_pb2 as pb
from shim.model import (
    PROPAGATIONS,
    ContainerFilter,
    ContainerSpec,
    CreateContainer,
    ImageVolume,
    MountRequest,
    PodMeta,
    RemoveContainer,
    RemovePodSandbox,
    RunPodSandbox,
    SandboxFilter,
    SandboxSpec,
    StartContainer,
    StopContainer,
    StopPodSandbox,
    UpdateContainerResources,
    UpdatePodSandboxResources,
)
from vmsandbox import oci_spec, pod_cgroup, userns, validation
from vmsandbox.errors import InvalidArgument, Unsupported
from vmsandbox.network import (
    HOSTNAME_MAX,
    NAMESPACE_MODES,
    DnsConfig,
    NamespaceMode,
    NamespaceOptions,
    PortMapping,
    Protocol,
    valid_hostname,
)
from vmsandbox.resources import (
    CdiDevice,
    ContainerDeclaration,
    ContainerResources,
    Device,
    Mount,
    PodDeclaration,
    ResourceList,
)
from vmsandbox.sizing import LinuxResources
from vmsandbox.userns import UserNamespace

_PAGE_SIZE = re.compile(r"([0-9]{1,16})(B|KB|MB|GB|TB|Ki|Mi|Gi|Ti)")  # ASCII digits only
_UNITS = {
    "B": 1,
    "KB": 1 << 10,
    "MB": 1 << 20,
    "GB": 1 << 30,
    "TB": 1 << 40,
    "Ki": 1 << 10,
    "Mi": 1 << 20,
    "Gi": 1 << 30,
    "Ti": 1 << 40,
}


def page_size_bytes(text: str, where: str) -> int:
    """CRI hugepage sizes are written '2MB', '1GB' (binary multiples); zero is no size."""
    m = _PAGE_SIZE.fullmatch(text)
    if not m:
        raise InvalidArgument(f"{where}: invalid hugepage size {validation.quote(text)} (expected e.g. 2MB or 1GB)")
    size = int(m.group(1)) * _UNITS[m.group(2)]
    if size == 0:
        raise InvalidArgument(f"{where}: hugepage size {validation.quote(text)} is zero")
    return size


def linux_resources(msg: pb.LinuxContainerResources, where: str) -> LinuxResources:
    if msg.cpu_period < 0 or msg.cpu_shares < 0 or msg.memory_limit_in_bytes < 0:
        raise InvalidArgument(f"{where}: cpu_period, cpu_shares and memory_limit_in_bytes must not be negative")
    validation.text(msg.cpuset_cpus, f"{where}.cpuset_cpus", 1024)  # recorded and reported back, not parsed
    pages = tuple(
        sorted((page_size_bytes(h.page_size, f"{where}.hugepage_limits"), int(h.limit)) for h in msg.hugepage_limits)
    )
    return LinuxResources(
        cpu_period=msg.cpu_period,
        cpu_quota=max(msg.cpu_quota, 0),
        cpu_shares=msg.cpu_shares,
        memory_limit_bytes=msg.memory_limit_in_bytes,
        hugepage_limits=pages,
        cpuset_cpus=msg.cpuset_cpus,
    )


def _quantities(m: Mapping[str, Any], where: str) -> ResourceList:
    raw = {}
    for key, q in m.items():
        # a qualified name at most ("vendor.com/gpu"): bounded here, its grammar checked by ResourceList.parse
        validation.text(key, f"{where}: resource name", 253 + 1 + 63)
        if not q.HasField("string"):
            raise InvalidArgument(f"{where}.{key}: quantity has no value")
        raw[key] = q.string
    return ResourceList.parse(raw, where=where)


def _mounts(items: Iterable[pb.Mount], where: str) -> frozenset[Mount]:
    """A declaration's mounts, as admission compares them with a container's (an image volume's as
    ``mount_requests`` makes it: read-only, its sub path cleaned)."""
    out = []
    for m in items:
        validation.text(m.host_path, f"{where}.host_path")
        validation.text(m.container_path, f"{where}.container_path")
        if m.image.image or m.image_sub_path:
            out.append(_image_mount(m, validation.quote(m.container_path)).declared())
            continue
        out.append(
            Mount(
                container_path=m.container_path,
                host_path=m.host_path,
                readonly=m.readonly,
                recursive_read_only=m.recursive_read_only,
                selinux_relabel=m.selinux_relabel,
                propagation=int(m.propagation),
            )
        )
    return frozenset(out)


def _devices(items: Iterable[pb.Device], where: str) -> frozenset[Device]:
    for d in items:
        validation.text(d.host_path, f"{where}.host_path")
        validation.text(d.container_path, f"{where}.container_path")
        validation.text(d.permissions, f"{where}.permissions", 3)
    return frozenset(Device(d.container_path, d.host_path, d.permissions) for d in items)


def _cdi(items: Iterable[pb.CDIDevice], where: str) -> frozenset[CdiDevice]:
    for c in items:
        validation.text(c.name, f"{where}.name", 253)
    return frozenset(CdiDevice(c.name) for c in items)


def kubernetes_resources(msg: pb.KubernetesResources, where: str) -> ContainerResources:
    res = ContainerResources(
        requests=_quantities(msg.requests, f"{where}: requests"),
        limits=_quantities(msg.limits, f"{where}: limits"),
    )
    for key, request in res.requests:
        limit = res.limits.get(key)
        if limit is not None and request > limit:
            raise InvalidArgument(
                f"{where}: requests.{key} {request.canonical()} is greater than limits.{key} {limit.canonical()}"
            )
    return res


def declaration(msg: pb.PodResourceConfig) -> PodDeclaration:
    def one(c: pb.ContainerResourceConfig, kind: str) -> ContainerDeclaration:
        if not c.name:
            raise InvalidArgument(f"pod_resources: an {kind} has an empty name")
        validation.container_name(c.name, f"pod_resources: {kind} name")
        where = f'pod_resources: container "{c.name}"'
        res = kubernetes_resources(c.kubernetes_resources, where)
        return ContainerDeclaration(
            name=c.name,
            resources=ContainerResources(
                requests=res.requests,
                limits=res.limits,
                mounts=_mounts(c.mounts, f"{where}: mounts"),
                devices=_devices(c.devices, f"{where}: devices"),
                cdi_devices=_cdi(c.CDI_devices, f"{where}: CDI_devices"),
            ),
        )

    return PodDeclaration(
        init_containers=tuple(one(c, "init container") for c in msg.init_containers),
        containers=tuple(one(c, "app container") for c in msg.containers),
    )


_PROTOCOLS: dict[int, Protocol] = {pb.TCP: "tcp", pb.UDP: "udp", pb.SCTP: "sctp"}
_MAX_DNS_ITEMS = 64


def _namespace_mode(value: int, where: str) -> NamespaceMode:
    if value not in pb.NamespaceMode.values():
        raise InvalidArgument(f"{where} is {value}, not a NamespaceMode (POD, CONTAINER, NODE or TARGET)")
    return NAMESPACE_MODES[value]


def namespace_options(msg: pb.NamespaceOption, where: str) -> NamespaceOptions:
    options = NamespaceOptions(
        network=_namespace_mode(msg.network, f"{where}.network"),
        pid=_namespace_mode(msg.pid, f"{where}.pid"),
        ipc=_namespace_mode(msg.ipc, f"{where}.ipc"),
        target_id=msg.target_id,
    )
    if msg.target_id:
        validation.id_prefix(msg.target_id, f"{where}.target_id")
    return options


def user_namespace(msg: pb.NamespaceOption, where: str) -> UserNamespace | None:
    """A user namespace of the pod's own (``userns_options`` in mode POD, ``hostUsers: false``)
    with its checked mappings; None for the node's (unset, or mode NODE without mappings)."""
    if not msg.HasField("userns_options"):
        return None
    u = msg.userns_options
    where = f"{where}.userns_options"
    if u.mode == pb.NODE:
        if u.uids or u.gids:
            raise InvalidArgument(f"{where}: mode NODE (the node's user namespace) takes no uids or gids mappings")
        return None
    if u.mode != pb.POD:
        raise InvalidArgument(f"{where}.mode is {u.mode}, not POD or NODE")
    ns = UserNamespace(userns.mappings(u.uids, f"{where}.uids"), userns.mappings(u.gids, f"{where}.gids"))
    for side, mapped in (("uids", ns.maps_uid(0)), ("gids", ns.maps_gid(0))):
        if not mapped:
            raise InvalidArgument(
                f"{where}.{side} maps no container id 0: the pod's user namespace would have no root, "
                "which its sandbox and containers start as (map container id 0, as the kubelet does)"
            )
    return ns


def _ip(value: str, where: str) -> None:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        raise InvalidArgument(f"{where} {validation.quote(value)} is not an IP address") from None


def port_mappings(items: Iterable[pb.PortMapping], where: str) -> tuple[PortMapping, ...]:
    out = []
    for i, m in enumerate(items):
        at = f"{where}[{i}]"
        if m.protocol not in _PROTOCOLS:
            raise InvalidArgument(f"{at}.protocol is {m.protocol}, not TCP, UDP or SCTP")
        for name, port in (("container_port", m.container_port), ("host_port", m.host_port)):
            if not 0 <= port <= 65535:
                raise InvalidArgument(f"{at}.{name} is {port}, outside 0-65535")
        if m.host_ip:
            _ip(m.host_ip, f"{at}.host_ip")
        out.append(PortMapping(_PROTOCOLS[m.protocol], m.container_port, m.host_port, m.host_ip))
    return tuple(out)


def dns_config(msg: pb.DNSConfig, where: str) -> DnsConfig:
    for name, items in (("servers", msg.servers), ("searches", msg.searches), ("options", msg.options)):
        if len(items) > _MAX_DNS_ITEMS:
            raise InvalidArgument(f"{where}.{name} has {len(items)} entries, more than {_MAX_DNS_ITEMS}")
        for i, item in enumerate(items):
            validation.text(item, f"{where}.{name}[{i}]", 253)
            if not item or any(c.isspace() for c in item):
                raise InvalidArgument(f"{where}.{name}[{i}] {validation.quote(item)} is empty or holds white space")
    for i, server in enumerate(msg.servers):
        _ip(server, f"{where}.servers[{i}]")
    return DnsConfig(servers=tuple(msg.servers), searches=tuple(msg.searches), options=tuple(msg.options))


# -- the sandbox RPCs' requests ----------------------------------------------------------------------
def run_pod_sandbox(request: pb.RunPodSandboxRequest) -> RunPodSandbox:
    if not request.HasField("config"):
        raise InvalidArgument("RunPodSandboxRequest.config is missing")
    # the CRI has no way to give a namespace: the shim makes the pod's network (given_netns None)
    return RunPodSandbox(sandbox_spec(request.config, request.runtime_handler), given_netns=None)


def stop_pod_sandbox(request: pb.StopPodSandboxRequest) -> StopPodSandbox:
    return StopPodSandbox(validation.teardown_id(request.pod_sandbox_id, "pod_sandbox_id"))


def remove_pod_sandbox(request: pb.RemovePodSandboxRequest) -> RemovePodSandbox:
    return RemovePodSandbox(validation.teardown_id(request.pod_sandbox_id, "pod_sandbox_id"))


def update_pod_sandbox_resources(request: pb.UpdatePodSandboxResourcesRequest) -> UpdatePodSandboxResources:
    return UpdatePodSandboxResources(
        sandbox_id=validation.id_prefix(request.pod_sandbox_id, "pod_sandbox_id"),
        overhead=linux_resources(request.overhead, "overhead"),
        resources=linux_resources(request.resources, "resources"),
    )


def sandbox_spec(config: pb.PodSandboxConfig, runtime_handler: str) -> SandboxSpec:
    """The pod a RunPodSandbox asks for (its metadata's name, namespace and uid non-empty and
    well-formed; its attempt is unsigned on the wire)."""
    md = config.metadata
    linux = config.linux
    validation.pod_name(md.name, "PodSandboxConfig.metadata.name")
    validation.dns1123_label(md.namespace, "PodSandboxConfig.metadata.namespace")
    validation.uid(md.uid, "PodSandboxConfig.metadata.uid")
    if runtime_handler:
        validation.dns1123_label(runtime_handler, "RunPodSandboxRequest.runtime_handler")
    if config.hostname and not valid_hostname(config.hostname):
        raise InvalidArgument(
            f"PodSandboxConfig.hostname {validation.quote(config.hostname)} is not a host name: at most "
            f"{HOSTNAME_MAX} letters, digits, '.', '_' and '-', starting and ending with a letter or digit"
        )
    validation.absolute_path(config.log_directory, "PodSandboxConfig.log_directory")
    validation.label_map(config.labels, "PodSandboxConfig.labels")
    validation.annotation_map(config.annotations, "PodSandboxConfig.annotations")
    where = "PodSandboxConfig.linux.security_context.namespace_options"
    namespaces = namespace_options(linux.security_context.namespace_options, where)
    pod_userns = user_namespace(linux.security_context.namespace_options, where)
    if pod_userns is not None and namespaces.host_network:
        raise Unsupported(
            f"{where}: a user namespace of the pod's own with the node's network (hostNetwork) is not supported "
            "in VM pods (the runtime does not advertise user_namespaces_host_network)"
        )
    return SandboxSpec(
        meta=PodMeta(name=md.name, namespace=md.namespace, uid=md.uid, attempt=md.attempt),
        runtime_handler=runtime_handler,
        hostname=config.hostname,
        log_directory=config.log_directory,
        labels=dict(config.labels),
        annotations=dict(config.annotations),
        declaration=declaration(config.pod_resources) if config.HasField("pod_resources") else None,
        linux_resources=linux_resources(linux.resources, "linux.resources"),
        linux_overhead=linux_resources(linux.overhead, "linux.overhead"),
        namespaces=namespaces,
        userns=pod_userns,
        port_mappings=port_mappings(config.port_mappings, "PodSandboxConfig.port_mappings"),
        dns=dns_config(config.dns_config, "PodSandboxConfig.dns_config"),
        # the driver is the one RuntimeConfig answers
        cgroup_parent=pod_cgroup.cgroup_parent(
            linux.cgroup_parent, pod_cgroup.CGROUPFS, "PodSandboxConfig.linux.cgroup_parent"
        ),
        sysctls=dict(linux.sysctls),
    )


def container_spec(config: pb.ContainerConfig) -> ContainerSpec:
    name = config.metadata.name
    validation.container_name(name, "ContainerConfig.metadata.name")  # its attempt is unsigned on the wire
    validation.text(config.image.image, "ContainerConfig.image.image")
    if config.log_path:
        validation.relative_file(config.log_path, "ContainerConfig.log_path")
    validation.label_map(config.labels, "ContainerConfig.labels")
    validation.annotation_map(config.annotations, "ContainerConfig.annotations")
    where = f'container "{name}"'
    resources = (
        kubernetes_resources(config.kubernetes_resources, where) if config.HasField("kubernetes_resources") else None
    )
    return ContainerSpec(
        name=name,
        attempt=config.metadata.attempt,
        image=config.image.image,
        labels=dict(config.labels),
        annotations=dict(config.annotations),
        log_path=config.log_path,
        resources=resources,
        mounts=mount_requests(config.mounts, f"{where}: mounts", _container_userns(config)),
        attachments=ContainerResources(
            devices=_devices(config.devices, f"{where}: devices"),
            cdi_devices=_cdi(config.CDI_devices, f"{where}: CDI_devices"),
        ),
        linux=linux_resources(config.linux.resources, f"{where}: linux.resources"),
    )


def create_container(request: pb.CreateContainerRequest) -> CreateContainer:
    if not request.pod_sandbox_id:
        raise InvalidArgument("CreateContainerRequest.pod_sandbox_id is empty")
    validation.id_prefix(request.pod_sandbox_id, "pod_sandbox_id")
    if not request.HasField("config"):
        raise InvalidArgument("CreateContainerRequest.config is missing")
    run, user, stop_signal = container_request(request.config, request.sandbox_config.linux.sysctls)
    if request.HasField("sandbox_config"):
        sandbox_ns = user_namespace(
            request.sandbox_config.linux.security_context.namespace_options,
            "CreateContainerRequest.sandbox_config.linux.security_context.namespace_options",
        )
        userns.check_same(sandbox_ns, run.userns, f'container "{request.config.metadata.name}"')
    return CreateContainer(request.pod_sandbox_id, container_spec(request.config), run, user, stop_signal)


def start_container(request: pb.StartContainerRequest) -> StartContainer:
    return StartContainer(validation.id_prefix(request.container_id, "container_id"))


def stop_container(request: pb.StopContainerRequest) -> StopContainer:
    if request.timeout < 0:
        raise InvalidArgument(f"StopContainer timeout is negative ({request.timeout})")
    return StopContainer(validation.teardown_id(request.container_id, "container_id"), int(request.timeout))


def remove_container(request: pb.RemoveContainerRequest) -> RemoveContainer:
    return RemoveContainer(validation.teardown_id(request.container_id, "container_id"))


def update_container_resources(request: pb.UpdateContainerResourcesRequest) -> UpdateContainerResources:
    where = "UpdateContainerResourcesRequest"
    resources = (
        kubernetes_resources(request.kubernetes_resources, f"{where}.kubernetes_resources")
        if request.HasField("kubernetes_resources")
        else None
    )
    return UpdateContainerResources(
        validation.id_prefix(request.container_id, "container_id"),
        resources,
        linux_resources(request.linux, f"{where}.linux"),
    )


# -- what a container runs (vmsandbox.oci_spec) ------------------------------------------------------
def _profile_text(p: pb.SecurityProfile) -> str:
    """A SecurityProfile (present) as oci_spec spells it: "runtime/default", "unconfined", "localhost/<ref>"."""
    if p.profile_type == pb.SecurityProfile.ProfileType.Localhost:
        return f"localhost/{p.localhost_ref}"
    if p.profile_type == pb.SecurityProfile.ProfileType.Unconfined:
        return "unconfined"
    return "runtime/default"


def container_request(
    config: pb.ContainerConfig, sysctls: Mapping[str, str]
) -> tuple[oci_spec.ContainerRequest, str, str]:
    """(what to run, the user spec to resolve against the image, the stop signal name or "");
    ``sysctls`` are the pod's (LinuxPodSandboxConfig.sysctls). The hostname is the pod's, which
    the owner of the pod fills in."""
    sc = config.linux.security_context
    res = config.linux.resources
    user = ""
    if sc.HasField("run_as_user"):
        user = str(sc.run_as_user.value)
    elif sc.run_as_username:
        user = sc.run_as_username
    if sc.HasField("run_as_group"):
        if not user:
            raise InvalidArgument("run_as_group needs run_as_user or run_as_username")
        user += f":{sc.run_as_group.value}"
    hugepages = {h.page_size: h.limit for h in res.hugepage_limits if h.limit > 0}
    ns = _container_userns(config)
    if ns is not None and sc.namespace_options.pid != pb.CONTAINER:
        # the guest's PID namespace belongs to the guest's initial user namespace: the container's
        # cannot mount a /proc of it
        raise Unsupported(
            "ContainerConfig.linux.security_context.namespace_options: a user namespace of the pod's own with "
            "a PID namespace shared with the pod (shareProcessNamespace) is not supported in VM pods"
        )
    request = oci_spec.ContainerRequest(
        command=tuple(config.command),
        args=tuple(config.args),
        stdin=config.stdin,
        stdin_once=config.stdin_once,
        tty=config.tty,
        # bytes on the wire (as upstream); the OCI spec holds UTF-8 strings, so invalid bytes become U+FFFD,
        # as containerd's JSON encoding of the spec does
        env=tuple((kv.key, kv.value.decode("utf-8", errors="replace")) for kv in config.envs),
        working_dir=config.working_dir,
        readonly_rootfs=sc.readonly_rootfs,
        privileged=sc.privileged,
        add_capabilities=tuple(sc.capabilities.add_capabilities),
        drop_capabilities=tuple(sc.capabilities.drop_capabilities),
        no_new_privileges=sc.no_new_privs,
        seccomp=_profile_text(sc.seccomp) if sc.HasField("seccomp") else sc.seccomp_profile_path,
        apparmor=_profile_text(sc.apparmor) if sc.HasField("apparmor") else sc.apparmor_profile,
        resources=oci_spec.Resources(
            cpu_quota_us=res.cpu_quota or None,
            cpu_period_us=res.cpu_period or None,
            cpu_shares=res.cpu_shares or None,
            memory_limit_bytes=res.memory_limit_in_bytes or None,
            hugepage_limits=hugepages,
        ),
        oom_score_adj=int(res.oom_score_adj),
        sysctls=dict(sysctls),
        own_pid_namespace=sc.namespace_options.pid == pb.CONTAINER,
        userns=ns,
        # the kubelet sends the paths to mask (its defaults unless the pod's procMount is Unmasked)
        masked_paths=tuple(sc.masked_paths) if sc.masked_paths else None,
        readonly_paths=tuple(sc.readonly_paths) if sc.readonly_paths else None,
        supplemental_groups=tuple(int(g) for g in sc.supplemental_groups),
        image_groups=_image_groups(sc.supplemental_groups_policy),
    )
    # upstream's enum names are SIGNAL_SIGTERM etc.; the signal itself is what follows the prefix
    try:
        signal = "" if config.stop_signal == 0 else pb.Signal.Name(config.stop_signal).removeprefix("SIGNAL_")
    except ValueError:  # an enum value the CRI does not define (open enums carry any int32)
        raise InvalidArgument(
            f"ContainerConfig.stop_signal {config.stop_signal} is not a signal the CRI defines"
        ) from None
    return request, user, signal


def _image_groups(policy: int) -> bool:
    """SupplementalGroupsPolicy: Merge adds the groups the image gives the user, Strict does not."""
    if policy == pb.SupplementalGroupsPolicy.Merge:
        return True
    if policy == pb.SupplementalGroupsPolicy.Strict:
        return False
    raise InvalidArgument(
        f"ContainerConfig.linux.security_context.supplemental_groups_policy {policy} is not one the CRI defines"
    )


def _container_userns(config: pb.ContainerConfig) -> UserNamespace | None:
    return user_namespace(
        config.linux.security_context.namespace_options, "ContainerConfig.linux.security_context.namespace_options"
    )


def mount_requests(items: Iterable[pb.Mount], where: str, ns: UserNamespace | None = None) -> tuple[MountRequest, ...]:
    """The mounts a container config asks for, in its order. A recursive read-only mount must be
    read-only and private (as the CRI defines recursive_read_only), else INVALID_ARGUMENT. A
    mount's ``uidMappings``/``gidMappings`` (an idmapped mount) must be the container's own user
    namespace's, as the kubelet sets them (``ns``; the guest shows the volume through them, see
    docs/containers.md), else INVALID_ARGUMENT; none at all without one."""
    out = []
    for m in items:
        validation.text(m.host_path, f"{where}.host_path")
        validation.text(m.container_path, f"{where}.container_path")
        shown = validation.quote(m.container_path)
        if not 0 <= m.propagation < len(PROPAGATIONS):
            raise InvalidArgument(f"mount {shown}: propagation {m.propagation} is not a MountPropagation")
        if m.image.image or m.image_sub_path:
            out.append(_image_mount(m, shown))
            continue
        if m.uidMappings or m.gidMappings:
            _mount_idmap(m, ns, f"mount {shown}")
        if m.mount_options:
            raise Unsupported(f"mount {shown}: mount_options are not supported in VM pods")
        if m.recursive_read_only and not m.readonly:
            raise InvalidArgument(f"mount {shown}: recursive_read_only needs readonly")
        if m.recursive_read_only and m.propagation != pb.PROPAGATION_PRIVATE:
            mode = pb.MountPropagation.Name(m.propagation)
            raise InvalidArgument(f"mount {shown}: recursive_read_only needs private propagation, not {mode}")
        out.append(
            MountRequest(
                m.container_path,
                m.host_path,
                m.readonly,
                m.recursive_read_only,
                PROPAGATIONS[m.propagation],
                m.selinux_relabel,
            )
        )
    return tuple(out)


def _mount_idmap(m: pb.Mount, ns: UserNamespace | None, where: str) -> None:
    if ns is None:
        raise InvalidArgument(
            f"{where}: uidMappings/gidMappings (an idmapped mount) need the container to have a user namespace "
            "of its pod's own (userns_options in mode POD)"
        )
    asked = UserNamespace(
        userns.mappings(m.uidMappings, f"{where}.uidMappings"), userns.mappings(m.gidMappings, f"{where}.gidMappings")
    )
    if asked != ns:
        raise InvalidArgument(
            f"{where}: its idmapping ({userns.describe(asked)}) is not the container's user namespace "
            f"({userns.describe(ns)}); a VM pod idmaps a volume with its user namespace's mappings only"
        )


def _image_mount(m: pb.Mount, shown: str) -> MountRequest:
    """An image volume's mount (KEP-4639: ``image`` set, no host path): the image's tree, or its
    ``image_sub_path``, read-only whatever ``readonly`` says (an image's tree is never written).
    Its propagation must be private (an image's tree has no mounts below it to propagate), and
    idmapped mounts and mount options are refused as for other mounts."""
    if not 0 <= m.propagation < len(PROPAGATIONS):
        raise InvalidArgument(f"mount {shown}: propagation {m.propagation} is not a MountPropagation")
    validation.text(m.image.image, f"mount {shown}: image.image")
    if not m.image.image:
        raise InvalidArgument(f"mount {shown}: image_sub_path is set but image.image is empty")
    if m.host_path:
        raise InvalidArgument(f"mount {shown}: an image volume (image set) has no host_path")
    sub = m.image_sub_path
    if sub:
        validation.relative_file(sub, f"mount {shown}: image_sub_path")
    if m.propagation != pb.PROPAGATION_PRIVATE:
        mode = pb.MountPropagation.Name(m.propagation)
        raise Unsupported(f"mount {shown}: an image volume's propagation must be PROPAGATION_PRIVATE, not {mode}")
    if m.uidMappings or m.gidMappings:
        raise Unsupported(
            f"mount {shown}: an idmapped image volume (uidMappings, gidMappings: a pod with a user namespace of its "
            "own) is not supported in VM pods"
        )
    if m.mount_options:
        raise Unsupported(f"mount {shown}: mount_options are not supported in VM pods")
    # its sub path as the guest resolves it: '.' and empty components dropped
    clean = "/".join(part for part in sub.split("/") if part not in ("", "."))
    return MountRequest(
        m.container_path,
        "",
        readonly=True,
        recursive=m.recursive_read_only,
        selinux_relabel=m.selinux_relabel,
        image=ImageVolume(m.image.image, clean),
    )


# -- list filters ---------------------------------------------------------------------------------
def _state_name(enum: Any, value: int) -> str:
    """A filter's state as the records spell it; a value the enum does not define matches nothing."""
    try:
        return str(enum.Name(value))
    except ValueError:
        return f"undefined state {value}"


def sandbox_filter(f: pb.PodSandboxFilter | pb.PodSandboxStatsFilter) -> SandboxFilter:
    state = None
    if isinstance(f, pb.PodSandboxFilter) and f.HasField("state"):
        state = _state_name(pb.PodSandboxState, f.state.state)
    return SandboxFilter(id_prefix=f.id, state=state, labels=dict(f.label_selector))


def container_filter(f: pb.ContainerFilter | pb.ContainerStatsFilter) -> ContainerFilter:
    state = None
    if isinstance(f, pb.ContainerFilter) and f.HasField("state"):
        state = _state_name(pb.ContainerState, f.state.state)
    return ContainerFilter(id_prefix=f.id, sandbox_id=f.pod_sandbox_id, state=state, labels=dict(f.label_selector))
