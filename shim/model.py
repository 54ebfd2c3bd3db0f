"""What the shim knows about sandboxes and containers: requests in, records kept (no protobuf).

``ContainerSpec`` is a CreateContainer request after translation (``SandboxSpec``, the
RunPodSandbox request, is the core's own: ``vmsandbox.pod``); ``SandboxRecord`` and
``ContainerRecord`` are what the state database keeps.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from vmsandbox.network import DnsConfig, NamespaceOptions, PodNetwork, PortMapping
from vmsandbox.pod import PodMeta as PodMeta
from vmsandbox.pod import SandboxSpec as SandboxSpec
from vmsandbox.resources import ContainerResources
from vmsandbox.sizing import LinuxResources

SANDBOX_READY = "SANDBOX_READY"
SANDBOX_NOTREADY = "SANDBOX_NOTREADY"
CONTAINER_CREATED = "CONTAINER_CREATED"
CONTAINER_RUNNING = "CONTAINER_RUNNING"
CONTAINER_EXITED = "CONTAINER_EXITED"
CONTAINER_UNKNOWN = "CONTAINER_UNKNOWN"


@dataclass(frozen=True)
class MountRequest:
    """A host path a CreateContainer mounts, as validated by the translation layer."""

    container_path: str
    host_path: str
    readonly: bool = False
    recursive: bool = False  # read-only for the mounts below host_path too (recursive_read_only)
    propagation: str = "private"  # a key of vmsandbox.adapters.binds.PROPAGATION


@dataclass(frozen=True)
class ContainerSpec:
    name: str
    attempt: int = 0
    image: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    log_path: str = ""
    # requests/limits from kubernetes_resources (field 19); None when the kubelet did not send it
    resources: ContainerResources | None = None
    attachments: ContainerResources = field(default_factory=ContainerResources)  # mounts, devices, CDI
    linux: LinuxResources = field(default_factory=LinuxResources)


@dataclass(frozen=True)
class SandboxRecord:
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
    declaration: dict[str, Any] | None = None  # records.declaration_doc
    shape: dict[str, Any] = field(default_factory=dict)  # records.shape_doc
    cpus: list[int] = field(default_factory=list)
    emulator_cpus: list[int] = field(default_factory=list)
    hugepages: list[list[int]] = field(default_factory=list)  # [node, page size, count]
    devices: list[dict[str, Any]] = field(default_factory=list)  # DeviceGroup.to_doc() of each group
    guest: dict[str, Any] = field(default_factory=dict)  # the guest's own report
    accel: str = ""
    boot_ms: int = 0
    linux_overhead: dict[str, Any] = field(default_factory=dict)  # LinuxPodSandboxConfig.overhead, recorded
    # the pod-level resources of the last accepted UpdatePodSandboxResources (LinuxResources fields)
    updated_resources: dict[str, Any] = field(default_factory=dict)
    # what the pod asked of its network (NamespaceOptions, PortMapping, DnsConfig fields) and what it
    # got (PodNetwork.to_doc(); empty until the network is set up)
    namespaces: dict[str, Any] = field(default_factory=dict)
    port_mappings: list[dict[str, Any]] = field(default_factory=list)
    dns: dict[str, Any] = field(default_factory=dict)
    network: dict[str, Any] = field(default_factory=dict)
    # the host uid (and gid) its QEMU runs as; 0: a sandbox of an earlier version, whose QEMU is root
    qemu_uid: int = 0

    def to_doc(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_doc(doc: dict[str, Any]) -> SandboxRecord:
        return SandboxRecord(**{**doc, "meta": PodMeta(**doc["meta"])})

    def with_state(self, state: str) -> SandboxRecord:
        return replace(self, state=state)

    @property
    def agent_instance(self) -> str:
        """The guest agent instance that reported at RunPodSandbox ("" for agents without one)."""
        return str(self.guest.get("instance", ""))

    def namespace_options(self) -> NamespaceOptions:
        return NamespaceOptions(**self.namespaces)

    def port_mapping_list(self) -> tuple[PortMapping, ...]:
        return tuple(PortMapping(**m) for m in self.port_mappings)

    def dns_config(self) -> DnsConfig:
        return DnsConfig(**{k: tuple(v) for k, v in self.dns.items()})

    def pod_network(self) -> PodNetwork | None:
        """What the pod's network set-up gave it; None before it ran (or for records older than it)."""
        return PodNetwork.from_doc(self.network) if self.network else None


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
    resources: dict[str, Any] = field(default_factory=dict)  # records.resources_doc of what was admitted
    linux: dict[str, Any] = field(default_factory=dict)  # LinuxResources fields, updated on update
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

    def to_doc(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_doc(doc: dict[str, Any]) -> ContainerRecord:
        # records written while file mounts were copies carry the copies' write-back list
        return ContainerRecord(**{k: v for k, v in doc.items() if k != "copy_back"})
