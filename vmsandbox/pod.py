"""A RunPodSandbox request as the core sees it: the pod's identity and everything that sizes it (pure).

``shim.translate`` builds it from the protobuf request, ``vmsandbox plan`` from a manifest; both
hand it to ``vmsandbox.lifecycle.plan_sandbox``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vmsandbox.network import DnsConfig, NamespaceOptions, PortMapping
from vmsandbox.resources import PodDeclaration
from vmsandbox.sizing import LinuxResources
from vmsandbox.userns import UserNamespace


@dataclass(frozen=True)
class PodMeta:
    name: str
    namespace: str
    uid: str
    attempt: int = 0


@dataclass(frozen=True)
class SandboxSpec:
    meta: PodMeta
    runtime_handler: str = ""
    hostname: str = ""
    log_directory: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    declaration: PodDeclaration | None = None  # KEP-4112 pod_resources; None from today's kubelets
    linux_resources: LinuxResources = field(default_factory=LinuxResources)
    linux_overhead: LinuxResources = field(default_factory=LinuxResources)  # RuntimeClass overhead
    namespaces: NamespaceOptions = field(default_factory=NamespaceOptions)
    port_mappings: tuple[PortMapping, ...] = ()
    dns: DnsConfig = field(default_factory=DnsConfig)
    userns: UserNamespace | None = None  # None: the node's user namespace (hostUsers unset or true)
    cgroup_parent: str = ""  # the pod's cgroup on the host (vmsandbox.pod_cgroup); "": none given
    sysctls: dict[str, str] = field(default_factory=dict)  # LinuxPodSandboxConfig.sysctls, for its containers
