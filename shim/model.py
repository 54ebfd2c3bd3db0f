"""What the shim knows about sandboxes and containers: requests in, records kept (no protobuf).

The requests of the RPCs that change state (``shim.rpc``), translated and checked
(``shim.translate``), are one value each: ``RunPodSandbox`` (its ``SandboxSpec``, the core's
own: ``vmsandbox.pod``), ``StopPodSandbox``, ``RemovePodSandbox``, ``UpdatePodSandboxResources``,
``CreateContainer`` (its ``ContainerSpec``, what it runs, its user and stop signal),
``StartContainer``, ``StopContainer``, ``RemoveContainer``, ``UpdateContainerResources``,
``PullImage`` and ``RemoveImage``; ``SandboxRecord`` and ``ContainerRecord`` are what the state
database keeps;
``SandboxFilter`` and ``ContainerFilter`` are list requests' filters; ``Condition``,
``SandboxStats`` and ``ContainerStats`` are answers on their way out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from vmsandbox import oci_spec, record_docs
from vmsandbox.agent_ops import CgroupStats
from vmsandbox.devices import DeviceGroup
from vmsandbox.errors import NotFound
from vmsandbox.image_ref import ImageReference
from vmsandbox.lifecycle import Sibling
from vmsandbox.network import DnsConfig, NamespaceOptions, PodNetwork, PortMapping
from vmsandbox.pod import PodMeta as PodMeta
from vmsandbox.pod import SandboxSpec as SandboxSpec
from vmsandbox.registries import Credentials
from vmsandbox.resize import Growth, grown
from vmsandbox.resources import ContainerResources, Mount, PodDeclaration
from vmsandbox.sizing import LinuxResources, PodDemand, VmShape

# the state names' one home is vmsandbox.states; the shim's modules take them from here too
from vmsandbox.states import CONTAINER_CREATED as CONTAINER_CREATED
from vmsandbox.states import CONTAINER_EXITED as CONTAINER_EXITED
from vmsandbox.states import CONTAINER_RUNNING as CONTAINER_RUNNING
from vmsandbox.states import CONTAINER_UNKNOWN as CONTAINER_UNKNOWN
from vmsandbox.states import SANDBOX_NOTREADY as SANDBOX_NOTREADY
from vmsandbox.states import SANDBOX_READY as SANDBOX_READY
from vmsandbox.userns import UserNamespace

PROPAGATIONS = ("private", "host-to-container", "bidirectional")
"""A mount's propagation as ``vmsandbox.adapters.binds`` names it, at the index of the CRI's
``MountPropagation`` value."""


@dataclass(frozen=True)
class ImageVolume:
    """What an image volume mounts (KEP-4639): an image's tree, or ``sub_path`` below its root."""

    image: str  # the reference or id the kubelet pulled it by (ImageSpec.image)
    sub_path: str = ""  # relative, no '..' ("": the image's root)


@dataclass(frozen=True)
class MountRequest:
    """A host path (or, with ``image``, an image's tree) a CreateContainer mounts, as validated
    by the translation layer. An image volume has no host path and is always read-only."""

    container_path: str
    host_path: str
    readonly: bool = False
    recursive: bool = False  # read-only for the mounts below host_path too (recursive_read_only)
    propagation: str = "private"  # one of PROPAGATIONS
    selinux_relabel: bool = False
    image: ImageVolume | None = None  # set: an image volume, mounted from the image's disk in the guest

    def declared(self) -> Mount:
        """The mount as a pod's declaration lists it, for admission to compare."""
        return Mount(
            container_path=self.container_path,
            host_path=self.host_path,
            readonly=self.readonly,
            recursive_read_only=self.recursive,
            selinux_relabel=self.selinux_relabel,
            propagation=PROPAGATIONS.index(self.propagation),
            image=self.image.image if self.image is not None else "",
            image_sub_path=self.image.sub_path if self.image is not None else "",
        )


def image_volumes(mounts: Iterable[MountRequest]) -> dict[int, ImageVolume]:
    """The image volumes among a container's mounts, by their index there."""
    return {i: m.image for i, m in enumerate(mounts) if m.image is not None}


@dataclass(frozen=True)
class ContainerSpec:
    """What a CreateContainer admits and records of the container (what it runs: ``CreateContainer.run``)."""

    name: str
    attempt: int = 0
    image: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    log_path: str = ""
    # requests/limits from kubernetes_resources (field 19); None when the kubelet did not send it
    resources: ContainerResources | None = None
    mounts: tuple[MountRequest, ...] = ()  # in the request's order
    attachments: ContainerResources = field(default_factory=ContainerResources)  # devices, CDI devices
    linux: LinuxResources = field(default_factory=LinuxResources)

    def asked_attachments(self) -> ContainerResources:
        """Its mounts, devices and CDI devices, as admission compares them with the declaration's."""
        return replace(self.attachments, mounts=frozenset(m.declared() for m in self.mounts))


# -- the RPCs' requests, translated (shim.translate) --------------------------------------------------
@dataclass(frozen=True)
class RunPodSandbox:
    spec: SandboxSpec
    sandbox_id: str = ""  # the id its caller chose (containerd's, in shim mode); "": a new one
    # the path of a network namespace the caller made and ran CNI in (containerd's sandbox API's
    # CreateSandboxRequest.netns_path): the pod's network is read there; None (the CRI, always):
    # the shim makes the pod's network (shim.pod_networks)
    given_netns: str | None = None


@dataclass(frozen=True)
class StopPodSandbox:
    sandbox_id: str | None  # an id or a prefix of one; None: another runtime's kind of id, naming nothing here


@dataclass(frozen=True)
class RemovePodSandbox:
    sandbox_id: str | None  # as StopPodSandbox's


@dataclass(frozen=True)
class UpdatePodSandboxResources:
    sandbox_id: str  # an id or a unique prefix of one
    overhead: LinuxResources
    resources: LinuxResources


@dataclass(frozen=True)
class CreateContainer:
    sandbox_id: str  # an id or a unique prefix of one
    spec: ContainerSpec
    run: oci_spec.ContainerRequest  # its hostname is the pod's, filled in when the pod is read
    user: str = ""  # run_as_user[:group] or a user name, resolved against the image ("": the image's)
    stop_signal: str = ""  # a signal's name ("": the image's, else TERM)
    container_id: str = ""  # the id its caller chose (containerd's, in shim mode); "": a new one


@dataclass(frozen=True)
class StartContainer:
    container_id: str  # an id or a unique prefix of one


@dataclass(frozen=True)
class StopContainer:
    container_id: str | None  # None: another runtime's kind of id, which names nothing here
    timeout_s: int = 0


@dataclass(frozen=True)
class RemoveContainer:
    container_id: str | None  # None: another runtime's kind of id, which names nothing here


@dataclass(frozen=True)
class UpdateContainerResources:
    container_id: str
    resources: ContainerResources | None  # None: the kubelet sent no kubernetes_resources
    linux: LinuxResources


@dataclass(frozen=True)
class PullImage:
    ref: ImageReference
    creds: Credentials | None = None  # for this pull only


@dataclass(frozen=True)
class RemoveImage:
    image: str  # a reference, an id or an id prefix


@dataclass(frozen=True)
class PassedGroup:
    """A passed-through IOMMU group as a sandbox record keeps it (what ``DeviceGroup.to_doc`` says)."""

    pool: str
    iommu_group: int
    node: int
    functions: tuple[str, ...]  # PCI addresses, the primary first

    @staticmethod
    def of(group: DeviceGroup) -> PassedGroup:
        return PassedGroup(group.pool, group.group, group.node, group.addresses)

    def to_doc(self) -> dict[str, Any]:
        return {
            "pool": self.pool,
            "iommu_group": self.iommu_group,
            "node": self.node,
            "functions": list(self.functions),
        }

    @staticmethod
    def from_doc(doc: dict[str, Any]) -> PassedGroup:
        return PassedGroup(
            str(doc.get("pool", "")),
            int(doc.get("iommu_group", -1)),
            int(doc.get("node", -1)),
            tuple(str(a) for a in doc.get("functions", ())),
        )


@dataclass(frozen=True)
class SandboxRecord:
    """A sandbox as the state database keeps it: typed values here, their documents (``to_doc``,
    ``from_doc``, the same JSON the database has always held) only at the database's edge."""

    id: str
    meta: PodMeta
    state: str
    created_ns: int
    runtime_handler: str
    profile: str
    domain: str
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    hostname: str = ""
    log_directory: str = ""
    declaration: PodDeclaration | None = None  # None: the pod was sized without a declaration
    shape: VmShape | None = None  # None only in records that never got as far as sizing
    cpus: tuple[int, ...] = ()
    emulator_cpus: tuple[int, ...] = ()
    hugepages: tuple[tuple[int, int, int], ...] = ()  # (node, page size, count)
    devices: tuple[PassedGroup, ...] = ()
    guest: dict[str, Any] = field(default_factory=dict)  # the guest's own report, shown as it is, and loss marks
    accel: str = ""
    boot_ms: int = 0
    linux_overhead: LinuxResources = field(default_factory=LinuxResources)  # LinuxPodSandboxConfig.overhead
    # the pod-level resources of the last accepted UpdatePodSandboxResources
    updated_resources: LinuxResources = field(default_factory=LinuxResources)
    # what the pod asked of its network and what it got (None until the network is set up)
    namespaces: NamespaceOptions = field(default_factory=NamespaceOptions)
    port_mappings: tuple[PortMapping, ...] = ()
    dns: DnsConfig = field(default_factory=DnsConfig)
    network: PodNetwork | None = None
    # the host uid (and gid) its QEMU runs as; 0: a sandbox of an earlier version, whose QEMU is root
    qemu_uid: int = 0
    # how far in-place resizes have grown the pod's envelope into its resize headroom
    growth: Growth = field(default_factory=Growth)
    # the pod's own user namespace (hostUsers: false); None: the node's
    userns: UserNamespace | None = None
    # the pod's cgroup on the host its QEMU is moved into (LinuxPodSandboxConfig.cgroup_parent); "": none
    cgroup_parent: str = ""
    # the pod's sysctls (LinuxPodSandboxConfig.sysctls): a container's when its creator does not
    # pass the pod's config along (containerd's task in shim mode)
    sysctls: dict[str, str] = field(default_factory=dict)

    def to_doc(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "meta": asdict(self.meta),
            "state": self.state,
            "created_ns": self.created_ns,
            "runtime_handler": self.runtime_handler,
            "profile": self.profile,
            "domain": self.domain,
            "labels": dict(self.labels),
            "annotations": dict(self.annotations),
            "hostname": self.hostname,
            "log_directory": self.log_directory,
            "declaration": record_docs.declaration_doc(self.declaration) if self.declaration is not None else None,
            "shape": record_docs.shape_doc(self.shape) if self.shape is not None else {},
            "cpus": list(self.cpus),
            "emulator_cpus": list(self.emulator_cpus),
            "hugepages": [list(h) for h in self.hugepages],
            "devices": [d.to_doc() for d in self.devices],
            "guest": dict(self.guest),
            "accel": self.accel,
            "boot_ms": self.boot_ms,
            "linux_overhead": record_docs.linux_doc(self.linux_overhead),
            "updated_resources": record_docs.linux_doc(self.updated_resources),
            "namespaces": asdict(self.namespaces),
            "port_mappings": [asdict(m) for m in self.port_mappings],
            "dns": {k: list(v) for k, v in asdict(self.dns).items()},
            "network": self.network.to_doc() if self.network is not None else {},
            "qemu_uid": self.qemu_uid,
            "growth": asdict(self.growth),
            "userns": self.userns.to_doc() if self.userns is not None else None,
            "cgroup_parent": self.cgroup_parent,
            "sysctls": dict(self.sysctls),
        }

    @staticmethod
    def from_doc(doc: dict[str, Any]) -> SandboxRecord:
        declaration, shape, network = doc.get("declaration"), doc.get("shape"), doc.get("network")
        dns = doc.get("dns") or {}
        return SandboxRecord(
            id=doc["id"],
            meta=PodMeta(**doc["meta"]),
            state=doc["state"],
            created_ns=int(doc["created_ns"]),
            runtime_handler=doc.get("runtime_handler", ""),
            profile=doc.get("profile", ""),
            domain=doc.get("domain", ""),
            labels=dict(doc.get("labels") or {}),
            annotations=dict(doc.get("annotations") or {}),
            hostname=doc.get("hostname", ""),
            log_directory=doc.get("log_directory", ""),
            declaration=record_docs.declaration_from_doc(declaration) if declaration else None,
            shape=record_docs.shape_from_doc(shape) if shape else None,
            cpus=tuple(int(c) for c in doc.get("cpus", ())),
            emulator_cpus=tuple(int(c) for c in doc.get("emulator_cpus", ())),
            hugepages=tuple((int(n), int(size), int(count)) for n, size, count in doc.get("hugepages", ())),
            devices=tuple(PassedGroup.from_doc(d) for d in doc.get("devices", ())),
            guest=dict(doc.get("guest") or {}),
            accel=doc.get("accel", ""),
            boot_ms=int(doc.get("boot_ms", 0)),
            linux_overhead=record_docs.linux_from_doc(doc.get("linux_overhead") or {}),
            updated_resources=record_docs.linux_from_doc(doc.get("updated_resources") or {}),
            namespaces=NamespaceOptions(**(doc.get("namespaces") or {})),
            port_mappings=tuple(PortMapping(**m) for m in doc.get("port_mappings", ())),
            dns=DnsConfig(**{k: tuple(v) for k, v in dns.items()}),
            network=PodNetwork.from_doc(network) if network else None,
            qemu_uid=int(doc.get("qemu_uid", 0)),
            growth=Growth(**(doc.get("growth") or {})),
            userns=UserNamespace.from_doc(doc["userns"]) if doc.get("userns") else None,
            cgroup_parent=str(doc.get("cgroup_parent", "")),
            sysctls={str(k): str(v) for k, v in (doc.get("sysctls") or {}).items()},
        )

    def with_state(self, state: str) -> SandboxRecord:
        return replace(self, state=state)

    @property
    def agent_instance(self) -> str:
        """The guest agent instance that reported at RunPodSandbox ("" for agents without one)."""
        return str(self.guest.get("instance", ""))

    @property
    def exclusive(self) -> bool:
        """Whether the pod's vCPUs are pinned to CPUs of its own (its record's ``cpus`` are claimed)."""
        return self.shape is not None and self.shape.cpu_policy == "exclusive"

    @property
    def init_container_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.declaration.init_containers) if self.declaration is not None else ()

    def sized_shape(self) -> VmShape:
        """The VM's shape; a record without one (never sized) is a broken record."""
        if self.shape is None:
            raise NotFound(f"pod sandbox {self.id[:12]} has no recorded VM shape")
        return self.shape

    def envelope(self) -> PodDemand:
        """What the pod's containers must fit in: the demand its VM was sized for, grown by its
        in-place resizes (``vmsandbox.resize``)."""
        return grown(self.sized_shape().demand, self.growth)


@dataclass(frozen=True)
class ContainerRecord:
    id: str
    sandbox_id: str
    name: str
    attempt: int
    state: str
    created_ns: int
    image: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    log_path: str = ""
    resources: ContainerResources = field(default_factory=ContainerResources)  # what was admitted
    linux: LinuxResources = field(default_factory=LinuxResources)  # its cgroup limits, updated on update
    reason: str = ""
    message: str = ""
    # set by shim.containers once the container exists in the guest
    image_id: str = ""
    image_ref: str = ""
    log_directory: str = ""
    stop_signal: str = ""
    started_ns: int = 0  # host clock
    finished_ns: int = 0  # host clock
    # host clock minus guest clock, measured at start: the guest's own times (exit) are mapped with it
    guest_clock_offset_ns: int = 0
    exit_code: int = 0
    tty: bool = False  # created with a terminal (ContainerConfig.tty)
    net_bind_service: bool = False  # holds CAP_NET_BIND_SERVICE: its pod's privileged node ports open
    # host paths of the atomic-writer volumes its guest keeps copies of for it (shim.pod_volumes)
    volume_copies: tuple[str, ...] = ()
    # ids of the images its image volumes mount, each held for it (by ``volume_holder``) until its removal
    volume_images: tuple[str, ...] = ()

    @property
    def volume_holder(self) -> str:
        """The name its image volumes hold their images by (its image is held by its id)."""
        return f"{self.id}/volumes"

    def to_doc(self) -> dict[str, Any]:
        doc = {f.name: getattr(self, f.name) for f in fields(self)}
        doc["labels"], doc["annotations"] = dict(self.labels), dict(self.annotations)
        doc["resources"] = record_docs.resources_doc(self.resources)
        doc["linux"] = record_docs.linux_doc(self.linux)
        return doc

    @staticmethod
    def from_doc(doc: dict[str, Any]) -> ContainerRecord:
        # records written while file mounts were copies carry the copies' write-back list
        known = {f.name for f in fields(ContainerRecord)}
        args = {k: v for k, v in doc.items() if k in known}
        args["resources"] = record_docs.resources_from_doc(doc.get("resources") or {}, f"container {doc.get('id', '')}")
        args["linux"] = record_docs.linux_from_doc(doc.get("linux") or {})
        args["volume_copies"] = tuple(str(p) for p in doc.get("volume_copies") or ())
        args["volume_images"] = tuple(str(i) for i in doc.get("volume_images") or ())
        return ContainerRecord(**args)


def _labels_match(labels: dict[str, str], selector: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@dataclass(frozen=True)
class SandboxFilter:
    """A list or stats request's filter on sandboxes: an id prefix, a state (None: any) and labels
    that must all match."""

    id_prefix: str = ""
    state: str | None = None
    labels: dict[str, str] = field(default_factory=dict)

    def matches_identity(self, r: SandboxRecord) -> bool:
        return r.id.startswith(self.id_prefix) and _labels_match(r.labels, self.labels)

    def matches(self, r: SandboxRecord) -> bool:
        return self.matches_identity(r) and (self.state is None or r.state == self.state)


@dataclass(frozen=True)
class ContainerFilter:
    """A list or stats request's filter on containers: an id prefix, the sandbox id (or a unique
    prefix of it), a state (None: any) and labels that must all match."""

    id_prefix: str = ""
    sandbox_id: str = ""
    state: str | None = None
    labels: dict[str, str] = field(default_factory=dict)

    def matches_identity(self, c: ContainerRecord) -> bool:
        return c.id.startswith(self.id_prefix) and _labels_match(c.labels, self.labels)

    def matches_state(self, c: ContainerRecord) -> bool:
        return self.state is None or c.state == self.state


@dataclass(frozen=True)
class Condition:
    """One condition of the runtime's status (RuntimeReady, NetworkReady, ...)."""

    type: str
    status: bool
    reason: str = ""
    message: str = ""


@dataclass(frozen=True)
class ContainerStats:
    """A running container's record with its guest's sample, and the CPU rate since the last one."""

    container: ContainerRecord
    sample: CgroupStats | None
    nano_cores: int | None
    # its part of what the sandbox's guest wrote on the host (shared_storage.split), reported in
    # its writable layer so that the kubelet counts it against the pod's ephemeral-storage
    shared_bytes: int = 0
    shared_inodes: int = 0


@dataclass(frozen=True)
class SandboxStats:
    sandbox: SandboxRecord
    sample: CgroupStats | None
    nano_cores: int | None
    containers: tuple[ContainerStats, ...]


def siblings_of(containers: Iterable[ContainerRecord]) -> list[Sibling]:
    """What the envelope rule (``lifecycle.check_fits_beside``) reads of a pod's containers."""
    return [Sibling(c.name, c.attempt, c.linux, c.state == CONTAINER_EXITED) for c in containers]
