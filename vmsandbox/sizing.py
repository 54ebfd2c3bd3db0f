"""From a pod's resources to an immutable VM shape (pure).

Two ways in:

* ``demand_from_declaration``: KEP-4112 ``pod_resources``. Per resource, a container counts its
  limit when set, else its request, else the profile default, and the pod needs Kubernetes'
  effective amount (KEP-753, sidecars included)::

      max( max over init containers i of (init_i + sum of sidecars declared before i),
           sum of sidecars + sum of app containers )

  Sidecars are init containers with ``restartPolicy: Always``: they start in init order and run
  for the pod's life. The declaration carries no restart policy, so the caller names them
  (``vmsandbox plan`` from the manifest, RunPodSandbox from ``SIDECARS_ANNOTATION``); without a
  name every init container runs to completion before the next one starts.
* ``demand_from_linux``: today's kubelets, which send only the pod-level cgroup settings
  (``LinuxPodSandboxConfig.resources``, already computed by the kubelet with the rule above) or
  containerd-style ``sandbox-*`` annotations.

Both take the RuntimeClass overhead (``LinuxPodSandboxConfig.overhead``), which the scheduler
reserved beyond the containers for the runtime's own cost. ``shape_for`` then applies the profile:
vCPUs = max(ceil(cpu) + vcpu.extra, ceil(cpu + overhead cpu)), within [min, max]; guest RAM =
memory + hugepages + max(memory.overhead, overhead memory), at least the profile minimum, rounded
up to the backing page size. The two overheads describe the same thing, the guest's cost beyond
its containers (``vmsandbox profile runtimeclass`` declares the profile's as the RuntimeClass
overhead), so the larger is taken, never the sum. Same input, same shape.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from vmsandbox.errors import CannotFit, InvalidArgument, Shortfall
from vmsandbox.profile import SIDECARS_ANNOTATION, Profile
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
    # RuntimeClass overhead (LinuxPodSandboxConfig.overhead): reserved beyond the containers, not theirs
    overhead_cpu_millis: int = 0
    overhead_memory_bytes: int = 0

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
    # the profile's resize headroom: reserved on the host with the rest, offline (vCPUs) or absent
    # (RAM) in the guest at boot, brought into it by a resize (``vmsandbox.resize``)
    headroom_vcpus: int = 0
    headroom_memory_bytes: int = 0

    @property
    def hugepage_backed(self) -> bool:
        return self.backing_page_size > 4096

    @property
    def backing_pages(self) -> int:
        """Pages backing the guest's RAM at boot."""
        return self.memory_bytes // self.backing_page_size if self.hugepage_backed else 0

    @property
    def has_headroom(self) -> bool:
        """Whether the profile reserved resize headroom for this VM."""
        return bool(self.headroom_vcpus or self.headroom_memory_bytes)

    @property
    def reserved_vcpus(self) -> int:
        """vCPUs the host reserves for the VM: those it boots with and its headroom."""
        return self.vcpus + self.headroom_vcpus

    @property
    def reserved_memory_bytes(self) -> int:
        """Guest RAM the host reserves: the boot RAM and the headroom."""
        return self.memory_bytes + self.headroom_memory_bytes

    @property
    def reserved_pages(self) -> int:
        """Backing pages the host reserves (boot RAM and headroom); 0 for ordinary memory."""
        return self.reserved_memory_bytes // self.backing_page_size if self.hugepage_backed else 0


def _container_amount(decl: ContainerDeclaration, name: str, default: int, *, milli: bool) -> int:
    res = decl.resources
    q = res.limits.get(name) or res.requests.get(name)
    if q is None:
        return default
    return q.milli_value() if milli else q.value_int()


def effective_amount(per_init: Iterable[tuple[int, bool]], per_app: Iterable[int]) -> int:
    """Kubernetes' effective pod amount of one resource (KEP-753).

    ``per_init`` is each init container's amount with whether it is a sidecar, in declaration
    order. A plain init container runs beside the sidecars declared before it; a sidecar joins
    them and stays; the app containers run beside all sidecars.
    """
    sidecars = 0
    peak = 0
    for amount, sidecar in per_init:
        if sidecar:
            sidecars += amount
            peak = max(peak, sidecars)
        else:
            peak = max(peak, amount + sidecars)
    return max(peak, sidecars + sum(per_app))


def declared_amount(
    decl: PodDeclaration, sidecars: Collection[str], amount: Callable[[ContainerDeclaration], int]
) -> int:
    """``effective_amount`` over the declaration's containers, each counting ``amount`` of it;
    ``sidecars`` names the init containers with ``restartPolicy: Always``."""
    return effective_amount(
        ((amount(c), c.name in sidecars) for c in decl.init_containers), (amount(c) for c in decl.containers)
    )


def sidecar_names(annotations: Mapping[str, str]) -> tuple[str, ...]:
    """The names ``SIDECARS_ANNOTATION`` lists, as written (stripped, empty entries kept as ''), unchecked."""
    raw = annotations.get(SIDECARS_ANNOTATION)
    return () if raw is None else tuple(part.strip() for part in raw.split(","))


def sidecars_from_annotations(annotations: Mapping[str, str], decl: PodDeclaration) -> frozenset[str]:
    """The init containers ``SIDECARS_ANNOTATION`` names, each checked against the declaration.

    Absent: none (each init container runs to completion before the next starts, as Kubernetes
    runs init containers without ``restartPolicy: Always``).
    """
    inits = [c.name for c in decl.init_containers]
    names: list[str] = []
    for name in sidecar_names(annotations):
        shown = repr(name[:64] + ("..." if len(name) > 64 else ""))
        if not name:
            raise InvalidArgument(
                f"annotation {SIDECARS_ANNOTATION}: an empty name (expected init container names separated by commas)"
            )
        if name in names:
            raise InvalidArgument(f"annotation {SIDECARS_ANNOTATION}: {shown} is named twice")
        if name not in inits:
            declared = ", ".join(repr(n) for n in inits[:16]) + (", ..." if len(inits) > 16 else "")
            raise InvalidArgument(
                f"annotation {SIDECARS_ANNOTATION}: {shown} is not an init container of pod_resources "
                f"(init containers: {declared or 'none'})"
            )
        names.append(name)
    return frozenset(names)


def running_alongside(
    name: str, init_order: Sequence[str], sidecars: frozenset[str], others: Iterable[str]
) -> list[frozenset[str]]:
    """The sets of containers that may run together with ``name``, one per phase of the pod's life.

    ``init_order`` lists the init containers in declaration order; every other name in ``others``
    is an app container. A plain init container runs beside the sidecars declared before it; a
    sidecar beside each later plain init container (with the sidecars declared before that one)
    and beside the app containers and all other sidecars; an app container beside the other app
    containers and all sidecars.
    """
    apps = frozenset(o for o in others if o not in init_order and o != name)
    if name in init_order:
        index = init_order.index(name)
        before = frozenset(s for s in init_order[:index] if s in sidecars)
        if name not in sidecars:
            return [before]
        phases = [(sidecars - {name}) | apps]
        for j in range(index + 1, len(init_order)):
            if init_order[j] not in sidecars:
                phases.append(frozenset(s for s in init_order[:j] if s in sidecars and s != name) | {init_order[j]})
        return phases
    return [sidecars | apps]


def demand_from_declaration(
    decl: PodDeclaration,
    profile: Profile,
    *,
    sidecars: frozenset[str] = frozenset(),
    overhead: LinuxResources | None = None,
) -> PodDemand:
    """The pod's effective demand from its full declaration; ``sidecars`` names the init containers
    with ``restartPolicy: Always``, ``overhead`` is the RuntimeClass overhead."""
    unknown = sorted(sidecars - {c.name for c in decl.init_containers})
    if unknown:
        raise InvalidArgument(f"sidecar {unknown[0]!r} is not an init container of pod_resources")

    def effective(name: str, default: int, *, milli: bool = False) -> int:
        return declared_amount(decl, sidecars, lambda c: _container_amount(c, name, default, milli=milli))

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
    demand = PodDemand(
        cpu_millis=effective(CPU, profile.default_cpu_millis, milli=True),
        memory_bytes=effective(MEMORY, profile.default_memory_bytes),
        hugepages=tuple(sorted(hugepages)),
        ephemeral_storage_bytes=effective(EPHEMERAL_STORAGE, 0),
        extended=tuple(extended),
        mode="declared",
    )
    return with_overhead(demand, overhead)


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


def with_overhead(demand: PodDemand, overhead: LinuxResources | None) -> PodDemand:
    """``demand`` with the RuntimeClass overhead of ``LinuxPodSandboxConfig.overhead``: the kubelet
    sends the RuntimeClass's cpu as quota/period and its memory as the memory limit."""
    if overhead is None:
        return demand
    return replace(
        demand,
        overhead_cpu_millis=overhead.cpu_millis(),
        overhead_memory_bytes=max(overhead.memory_limit_bytes, 0),
    )


def demand_from_linux(
    resources: LinuxResources,
    annotations: Mapping[str, str],
    profile: Profile,
    *,
    overhead: LinuxResources | None = None,
) -> PodDemand:
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
    return with_overhead(PodDemand(cpu_millis=cpu, memory_bytes=memory, hugepages=hugepages, mode=mode), overhead)


#: The least RAM a guest with memory hot-plug slots boots in: the guest kernel (Debian 6.1) sets
#: more aside for a guest with a hot-pluggable range, and ran out of memory unpacking its
#: initramfs at 128 and 160 MiB (booted at 192 MiB), where a guest without the range boots at 128.
HOTPLUG_BOOT_MIN_BYTES = 192 * MIB


def _round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def shape_for(demand: PodDemand, profile: Profile) -> VmShape:
    """The VM shape for ``demand`` under ``profile``; a pod larger than the profile allows is refused."""
    by_extra = -(-demand.cpu_millis // 1000) + profile.vcpu_extra
    by_overhead = -(-(demand.cpu_millis + demand.overhead_cpu_millis) // 1000)
    vcpus = max(by_extra, by_overhead, profile.vcpu_min)
    if vcpus > profile.vcpu_max:
        added = (
            f"{demand.overhead_cpu_millis}m RuntimeClass overhead"
            if by_overhead > by_extra
            else f"{profile.vcpu_extra} extra"
        )
        message = (
            f"pod needs {vcpus} vCPUs ({demand.cpu_millis}m cpu + {added}) but profile "
            f"{profile.name!r} allows at most {profile.vcpu_max}"
        )
        where = f"vcpu.max of profile {profile.name!r}"
        raise CannotFit(message, [Shortfall("vCPUs", where, str(vcpus), str(profile.vcpu_max), message)])
    backing = max((size for size, _ in demand.hugepages), default=profile.page_size_bytes)
    hugepage_total = sum(amount for _, amount in demand.hugepages)
    overhead = max(profile.memory_overhead_bytes, demand.overhead_memory_bytes)
    memory = max(demand.memory_bytes + hugepage_total + overhead, profile.memory_min_bytes)
    if profile.resize_headroom_memory_bytes:
        memory = max(memory, HOTPLUG_BOOT_MIN_BYTES)
    memory = _round_up(_round_up(memory, MIB), backing)
    guest_pages = tuple((size, amount // size) for size, amount in demand.hugepages)
    return VmShape(
        vcpus=vcpus,
        memory_bytes=memory,
        backing_page_size=backing,
        guest_hugepages=guest_pages,
        cpu_policy=profile.cpu_policy,
        demand=demand,
        headroom_vcpus=profile.resize_headroom_vcpus,
        headroom_memory_bytes=profile.resize_headroom_memory_bytes,
    )
