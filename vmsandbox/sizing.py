"""From a pod's resources to an immutable VM shape (pure).

Two ways in:

* ``demand_from_declaration``: KEP-4112 ``pod_resources``. Per resource, a container counts its
  limit when set, else its request, else the profile default; the pod needs
  ``max(max over init containers, sum over app containers)`` (Kubernetes' effective-request
  rule), or the sum of all of them when the profile says init containers run concurrently.
* ``demand_from_linux``: today's kubelets, which send only the pod-level cgroup settings
  (``LinuxPodSandboxConfig.resources``) or containerd-style ``sandbox-*`` annotations.

``shape_for`` then applies the profile: vCPUs = ceil(cpu) + extra, within [min, max]; guest RAM
= memory + hugepages + guest overhead, at least the profile minimum, rounded up to the backing
page size. Same input, same shape.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from vmsandbox.errors import CannotFit, InvalidArgument, Shortfall
from vmsandbox.profile import Profile
from vmsandbox.resources import (
    CPU,
    EPHEMERAL_STORAGE,
    HUGEPAGES_PREFIX,
    MEMORY,
    ContainerDeclaration,
    PodDeclaration,
    hugepage_size,
    is_extended,
)
from vmsandbox.validation import quote

SizingMode = Literal["declared", "linux-resources", "annotations", "defaults"]

MIB = 1024 * 1024


@dataclass(frozen=True)
class PodDemand:
    """What the pod needs, in base units: millicores, bytes, pages and device counts."""

    cpu_millis: int
    memory_bytes: int
    hugepages: tuple[tuple[int, int], ...] = ()  # (page size in bytes, bytes), sorted by size
    ephemeral_storage_bytes: int = 0
    extended: tuple[tuple[str, int], ...] = ()  # (resource name, count), sorted by name
    mode: SizingMode = "declared"

    def hugepage_bytes(self, page_size: int) -> int:
        return dict(self.hugepages).get(page_size, 0)


@dataclass(frozen=True)
class VmShape:
    """The guest as it will be for its whole life."""

    vcpus: int
    memory_bytes: int
    backing_page_size: int  # 4096 means ordinary (not hugepage-backed) memory
    guest_hugepages: tuple[tuple[int, int], ...]  # (page size in bytes, page count) inside the guest
    cpu_policy: Literal["exclusive", "shared"]
    demand: PodDemand

    @property
    def hugepage_backed(self) -> bool:
        return self.backing_page_size > 4096

    @property
    def backing_pages(self) -> int:
        return self.memory_bytes // self.backing_page_size if self.hugepage_backed else 0


def _container_amount(decl: ContainerDeclaration, name: str, default: int, *, milli: bool) -> int:
    res = decl.resources
    q = res.limits.get(name) or res.requests.get(name)
    if q is None:
        return default
    return q.milli_value() if milli else q.value_int()


def _combine(per_init: Iterable[int], per_app: Iterable[int], policy: str) -> int:
    inits, apps = list(per_init), list(per_app)
    if policy == "concurrent":
        return sum(inits) + sum(apps)
    return max(max(inits, default=0), sum(apps))


def demand_from_declaration(decl: PodDeclaration, profile: Profile) -> PodDemand:
    """The pod's effective demand from its full declaration (DESIGN §3)."""

    def effective(name: str, default: int, *, milli: bool = False) -> int:
        return _combine(
            (_container_amount(c, name, default, milli=milli) for c in decl.init_containers),
            (_container_amount(c, name, default, milli=milli) for c in decl.containers),
            profile.init_containers,
        )

    names: set[str] = set()
    for c in decl.all_containers():
        names.update(c.resources.requests.names())
        names.update(c.resources.limits.names())
    hugepages = []
    extended = []
    for name in sorted(names):
        size = hugepage_size(name)
        if size is not None:
            # Per container, as Kubernetes validates it: each container's cgroup holds whole pages.
            for c in decl.all_containers():
                for kind, q in (("limits", c.resources.limits.get(name)), ("requests", c.resources.requests.get(name))):
                    if q is not None and q.value_int() % size:
                        raise InvalidArgument(
                            f'pod_resources: container "{c.name}": {kind}.{name} {q.canonical()} is not a whole '
                            f"number of {name[len(HUGEPAGES_PREFIX) :]} pages"
                        )
            amount = effective(name, 0)
            if amount:
                hugepages.append((size, amount))
        elif is_extended(name):
            amount = effective(name, 0)
            if amount:
                extended.append((name, amount))
    return PodDemand(
        cpu_millis=effective(CPU, profile.default_cpu_millis, milli=True),
        memory_bytes=effective(MEMORY, profile.default_memory_bytes),
        hugepages=tuple(sorted(hugepages)),
        ephemeral_storage_bytes=effective(EPHEMERAL_STORAGE, 0),
        extended=tuple(extended),
        mode="declared",
    )


@dataclass(frozen=True)
class LinuxResources:
    """What ``LinuxContainerResources`` says, for pods sized without a declaration."""

    cpu_period: int = 0
    cpu_quota: int = 0
    cpu_shares: int = 0
    memory_limit_bytes: int = 0
    hugepage_limits: tuple[tuple[int, int], ...] = ()  # (page size in bytes, limit in bytes)
    cpuset_cpus: str = ""

    @property
    def empty(self) -> bool:
        return self == LinuxResources()

    def cpu_millis(self) -> int:
        """CPU implied by quota/period (ceil to millicores); 0 when unlimited."""
        if self.cpu_quota > 0 and self.cpu_period > 0:
            return -(-self.cpu_quota * 1000 // self.cpu_period)
        return 0


_INTEGER = re.compile(r"-?[0-9]{1,19}")
SANDBOX_ANNOTATIONS = {
    "period": "io.kubernetes.cri.sandbox-cpu-period",
    "quota": "io.kubernetes.cri.sandbox-cpu-quota",
    "shares": "io.kubernetes.cri.sandbox-cpu-shares",
    "memory": "io.kubernetes.cri.sandbox-memory",
}


def linux_resources_from_annotations(annotations: Mapping[str, str]) -> LinuxResources:
    """containerd-style ``io.kubernetes.cri.sandbox-*`` annotations, validated."""

    def number(key: str) -> int:
        raw = annotations.get(SANDBOX_ANNOTATIONS[key], "")
        if raw == "":
            return 0
        # ASCII digits only, as Kubernetes: int() also takes Arabic-Indic and fullwidth digits, " 12", "1_2"
        if _INTEGER.fullmatch(raw) is None:
            raise InvalidArgument(f"annotation {SANDBOX_ANNOTATIONS[key]}: {quote(raw)} is not an integer")
        value = int(raw)
        if value < 0 and not (key == "quota" and value == -1):
            raise InvalidArgument(f"annotation {SANDBOX_ANNOTATIONS[key]}: {quote(raw)} is negative")
        return max(value, 0)

    return LinuxResources(
        cpu_period=number("period"),
        cpu_quota=number("quota"),
        cpu_shares=number("shares"),
        memory_limit_bytes=number("memory"),
    )


def demand_from_linux(resources: LinuxResources, annotations: Mapping[str, str], profile: Profile) -> PodDemand:
    """Size from the pod-level cgroup settings, falling back to annotations, then to defaults."""
    mode: SizingMode = "linux-resources"
    source = resources
    if resources.cpu_millis() == 0 and resources.memory_limit_bytes == 0 and not resources.hugepage_limits:
        source = linux_resources_from_annotations(annotations)
        mode = "annotations" if not source.empty else "defaults"
    cpu = source.cpu_millis() or profile.default_cpu_millis
    memory = source.memory_limit_bytes or profile.default_memory_bytes
    hugepages = tuple(sorted((size, limit) for size, limit in source.hugepage_limits if limit > 0))
    for size, limit in hugepages:
        if limit % size:
            raise InvalidArgument(f"hugepage limit of {limit} bytes is not a whole number of {size} byte pages")
    if mode != "linux-resources" and source.cpu_millis() == 0 and source.memory_limit_bytes == 0:
        mode = "defaults"
    return PodDemand(cpu_millis=cpu, memory_bytes=memory, hugepages=hugepages, mode=mode)


def _round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def shape_for(demand: PodDemand, profile: Profile) -> VmShape:
    """The VM shape for ``demand`` under ``profile``; a pod larger than the profile allows is refused."""
    vcpus = max(-(-demand.cpu_millis // 1000) + profile.vcpu_extra, profile.vcpu_min)
    if vcpus > profile.vcpu_max:
        message = (
            f"pod needs {vcpus} vCPUs ({demand.cpu_millis}m cpu + {profile.vcpu_extra} extra) but profile "
            f"{profile.name!r} allows at most {profile.vcpu_max}"
        )
        where = f"vcpu.max of profile {profile.name!r}"
        raise CannotFit(message, [Shortfall("vCPUs", where, str(vcpus), str(profile.vcpu_max), message)])
    backing = max((size for size, _ in demand.hugepages), default=profile.page_size_bytes)
    hugepage_total = sum(amount for _, amount in demand.hugepages)
    memory = max(demand.memory_bytes + hugepage_total + profile.memory_overhead_bytes, profile.memory_min_bytes)
    memory = _round_up(_round_up(memory, MIB), backing)
    guest_pages = tuple((size, amount // size) for size, amount in demand.hugepages)
    return VmShape(
        vcpus=vcpus,
        memory_bytes=memory,
        backing_page_size=backing,
        guest_hugepages=guest_pages,
        cpu_policy=profile.cpu_policy,
        demand=demand,
    )
