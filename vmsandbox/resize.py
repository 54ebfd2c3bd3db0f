"""In-place resize of a running VM pod: how far its envelope has grown, and the resize headroom
that must be plugged into the guest for it (pure).

A VM cannot grow beyond what the host reserved for it at RunPodSandbox. A profile's
``resize_headroom`` reserves more (``VmShape.headroom_vcpus`` / ``headroom_memory_bytes``: host
CPUs and pages claimed with the rest, the vCPUs present but offline and no DIMM in the guest at
boot). A resize whose limits no longer fit the pod's demand grows its envelope (``Growth``); the
hardware that growth needs (``needed``) is brought online in the guest (vCPUs) or plugged into it
(RAM), never taken back: a resize down shrinks the
envelope and releases nothing reserved. A growth beyond the headroom is refused, naming both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from vmsandbox.admission import Usage, check_envelope, totals
from vmsandbox.domain import hotplug_block
from vmsandbox.errors import Diverged
from vmsandbox.quantity import format_quantity
from vmsandbox.sizing import PodDemand, VmShape


@dataclass(frozen=True)
class Growth:
    """How far a pod's limits have grown beyond the demand its VM was sized for."""

    cpu_millis: int = 0
    memory_bytes: int = 0

    @property
    def none(self) -> bool:
        return not (self.cpu_millis or self.memory_bytes)


@dataclass(frozen=True)
class Plugged:
    """Resize headroom plugged into a guest: vCPUs online beyond its boot count, RAM in DIMMs."""

    vcpus: int = 0
    memory_bytes: int = 0

    def covers(self, other: Plugged) -> bool:
        return self.vcpus >= other.vcpus and self.memory_bytes >= other.memory_bytes


def grown(demand: PodDemand, growth: Growth) -> PodDemand:
    """The envelope of a pod whose limits have grown by ``growth``."""
    if growth.none:
        return demand
    return replace(
        demand,
        cpu_millis=demand.cpu_millis + growth.cpu_millis,
        memory_bytes=demand.memory_bytes + growth.memory_bytes,
    )


def needed(shape: VmShape, growth: Growth) -> Plugged:
    """The headroom a growth needs plugged: the vCPUs that keep the boot's margin over the grown
    cpu (``shape.vcpus`` less what the demand itself rounds up to), the RAM in whole hot-plug blocks."""
    demand = shape.demand
    margin = shape.vcpus - -(-demand.cpu_millis // 1000)
    vcpus = max(0, -(-(demand.cpu_millis + growth.cpu_millis) // 1000) + margin - shape.vcpus)
    block = hotplug_block(shape.backing_page_size)
    memory = -(-max(0, growth.memory_bytes) // block) * block
    return Plugged(vcpus=vcpus, memory_bytes=memory)


def _refuse(shape: VmShape, want: Plugged, who: str) -> Diverged:
    problems = []
    if want.vcpus > shape.headroom_vcpus:
        problems.append(f"{want.vcpus} more vCPUs, the VM ({shape.vcpus} vCPUs) can grow by {shape.headroom_vcpus}")
    if want.memory_bytes > shape.headroom_memory_bytes:
        problems.append(
            f"{format_quantity(want.memory_bytes, 'BinarySI')} more memory, the VM "
            f"({format_quantity(shape.memory_bytes, 'BinarySI')}) can grow by "
            f"{format_quantity(shape.headroom_memory_bytes, 'BinarySI')}"
        )
    return Diverged(
        f"{who} does not fit in the VM: it needs {'; '.join(problems)} "
        "(the resize_headroom its profile reserved at RunPodSandbox; a VM grows no further)"
    )


def _fits(shape: VmShape, growth: Growth, who: str) -> Growth:
    want = needed(shape, growth)
    if not Plugged(shape.headroom_vcpus, shape.headroom_memory_bytes).covers(want):
        raise _refuse(shape, want, who)
    return growth


def pod_growth(shape: VmShape, new: Usage, *, who: str) -> Growth:
    """UpdatePodSandboxResources: the growth the pod's new limits are (none when they fit the
    demand; a resize down shrinks it), refused beyond the headroom. Hugepage limits cannot grow."""
    demand = shape.demand
    if not shape.has_headroom:
        check_envelope(demand, [], new, who=who)
        return Growth()
    growth = Growth(
        cpu_millis=max(0, new.cpu_millis - demand.cpu_millis),
        memory_bytes=max(0, new.memory_bytes - demand.memory_bytes),
    )
    check_envelope(grown(demand, growth), [], replace(new, cpu_millis=0, memory_bytes=0), who=who)
    return _fits(shape, growth, who)


def container_growth(shape: VmShape, growth: Growth, others: Sequence[Usage], new: Usage, *, who: str) -> Growth:
    """UpdateContainerResources: ``growth`` when the containers' limits fit the envelope it gives,
    else the growth they need (never less than ``growth``), refused beyond the headroom."""
    envelope = grown(shape.demand, growth)
    cpu, memory = totals(envelope, others, new)
    if not shape.has_headroom or (cpu <= envelope.cpu_millis and memory <= envelope.memory_bytes):
        check_envelope(envelope, others, new, who=who)  # fits, or refused as a VM without headroom
        return growth
    want = Growth(
        cpu_millis=max(growth.cpu_millis, cpu - shape.demand.cpu_millis),
        memory_bytes=max(growth.memory_bytes, memory - shape.demand.memory_bytes),
    )
    check_envelope(grown(shape.demand, want), others, new, who=who)
    return _fits(shape, want, who)


def describe(shape: VmShape, plugged: Plugged) -> str:
    """What of the headroom is plugged, for logs and errors: "1 of 2 headroom vCPUs, 128Mi of
    256Mi headroom memory plugged"."""
    return (
        f"{plugged.vcpus} of {shape.headroom_vcpus} headroom vCPUs, "
        f"{format_quantity(plugged.memory_bytes, 'BinarySI')} of "
        f"{format_quantity(shape.headroom_memory_bytes, 'BinarySI')} headroom memory plugged"
    )
