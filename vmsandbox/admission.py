"""Admission: does a container (or an update) match what the pod declared? (pure)

A running VM cannot grow, so CreateContainer must ask for exactly what ``pod_resources``
declared for that name, and an update must stay inside the VM. Every function returns or
raises with messages naming the container, the resource, the declared and the requested value.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction

from vmsandbox.errors import AlreadyExists, Diverged
from vmsandbox.quantity import Quantity, format_quantity
from vmsandbox.resources import (
    CPU,
    MEMORY,
    ContainerResources,
    PodDeclaration,
    ResourceList,
    hugepage_resource,
    hugepage_size,
)
from vmsandbox.sizing import LinuxResources, PodDemand

MIN_SHARES = 2
DEFAULT_PERIOD = 100_000
MIN_QUOTA = 1_000


def _q(q: Quantity | None) -> str:
    return q.canonical() if q is not None else "nothing"


def _list_differences(name: str, kind: str, declared: ResourceList, requested: ResourceList) -> list[str]:
    if declared == requested:
        return []
    want, got = declared.exact_values(), requested.exact_values()  # a missing key differs too
    return [
        f'container "{name}": {kind}.{key} declared {_q(declared.get(key))}, requested {_q(requested.get(key))}'
        for key in sorted(want.keys() | got.keys())
        if want.get(key) != got.get(key)
    ]


def _set_differences(name: str, kind: str, declared: Iterable[object], requested: Iterable[object]) -> list[str]:
    d, r = set(declared), set(requested)
    if d == r:
        return []
    out = []
    for item in sorted(d - r, key=repr):
        out.append(f'container "{name}": {kind} {item.describe()} declared, not requested')  # type: ignore[attr-defined]
    for item in sorted(r - d, key=repr):
        out.append(f'container "{name}": {kind} {item.describe()} requested, not declared')  # type: ignore[attr-defined]
    return out


def differences(name: str, declared: ContainerResources, requested: ContainerResources) -> list[str]:
    """Every way ``requested`` differs from ``declared``; empty means identical."""
    if requested == declared:  # the common case, decided by one structural comparison of canonical values
        return []
    return [
        *_list_differences(name, "requests", declared.requests, requested.requests),
        *_list_differences(name, "limits", declared.limits, requested.limits),
        *attachment_differences(name, declared, requested),
    ]


@dataclass(frozen=True)
class Existing:
    """A container already created in the sandbox."""

    name: str
    attempt: int


def check_name(declaration: PodDeclaration, name: str, attempt: int, existing: Sequence[Existing]) -> None:
    """The name must be declared, and not be created twice under the same attempt."""
    if declaration.find(name) is None:
        declared = ", ".join(repr(c.name) for c in declaration.all_containers())
        raise Diverged(f'container "{name}" was not declared at RunPodSandbox (declared: {declared})')
    for e in existing:
        if e.name == name and e.attempt == attempt:
            raise AlreadyExists(
                f'container "{name}" (attempt {attempt}) already exists in this sandbox; '
                "a retry must carry a higher attempt"
            )


def admit_declared(
    declaration: PodDeclaration,
    name: str,
    attempt: int,
    requested: ContainerResources,
    existing: Sequence[Existing],
) -> None:
    """CreateContainer with ``kubernetes_resources``: accept iff identical to the declaration."""
    check_name(declaration, name, attempt, existing)
    decl = declaration.find(name)
    assert decl is not None
    diffs = differences(name, decl.resources, requested)
    if diffs:
        raise Diverged("resources diverge from the pod's declaration: " + "; ".join(diffs))


# -- containers that only carry LinuxContainerResources ------------------------------------------
def cfs_quota(limit_millis: int) -> int:
    """kubelet's milliCPUToQuota over ``DEFAULT_PERIOD``: no (or a zero) limit means no quota; else
    at least 1000us."""
    return max(MIN_QUOTA, limit_millis * DEFAULT_PERIOD // 1000) if limit_millis else 0


def implied_linux(resources: ContainerResources) -> LinuxResources:
    """The cgroup settings a kubelet derives from requests/limits (shares, quota, memory, pages)."""
    req_cpu = resources.requests.get(CPU) or resources.limits.get(CPU)
    lim_cpu = resources.limits.get(CPU)
    shares = max(MIN_SHARES, req_cpu.milli_value() * 1024 // 1000) if req_cpu is not None else MIN_SHARES
    quota = cfs_quota(lim_cpu.milli_value() if lim_cpu is not None else 0)
    mem = resources.limits.get(MEMORY)
    pages = []
    for key, q in resources.limits:
        size = hugepage_size(key)
        if size is not None and q.value_int():
            pages.append((size, q.value_int()))
    return LinuxResources(
        cpu_period=DEFAULT_PERIOD if quota else 0,
        cpu_quota=quota,
        cpu_shares=shares,
        memory_limit_bytes=mem.value_int() if mem is not None else 0,
        hugepage_limits=tuple(sorted(pages)),
    )


def _cpu_from_quota(lr: LinuxResources) -> str:
    if lr.cpu_quota <= 0 or lr.cpu_period <= 0:
        return "nothing"
    # quota/period need not be a decimal fraction (10000/30000): print it in whole millicores, rounded up
    return format_quantity(Fraction(lr.cpu_millis(), 1000), "DecimalSI")


def linux_differences(name: str, declared: ContainerResources, requested: LinuxResources) -> list[str]:
    """Compare a declaration with what a container's LinuxContainerResources says."""
    want = implied_linux(declared)
    out = []
    if want.cpu_shares != requested.cpu_shares and requested.cpu_shares != 0:
        out.append(
            f'container "{name}": requests.cpu declared {_q(declared.requests.get(CPU))} '
            f"(cpu shares {want.cpu_shares}), requested cpu shares {requested.cpu_shares}"
        )
    period = requested.cpu_period or DEFAULT_PERIOD
    requested_quota = requested.cpu_quota if requested.cpu_quota > 0 else 0
    if Fraction(want.cpu_quota, DEFAULT_PERIOD) != Fraction(requested_quota, period):
        out.append(
            f'container "{name}": limits.cpu declared {_q(declared.limits.get(CPU))}, '
            f"requested {_cpu_from_quota(requested)} (cpu quota {requested.cpu_quota}/{requested.cpu_period})"
        )
    if want.memory_limit_bytes != requested.memory_limit_bytes:
        got = format_quantity(requested.memory_limit_bytes, "BinarySI") if requested.memory_limit_bytes else "nothing"
        out.append(f'container "{name}": limits.memory declared {_q(declared.limits.get(MEMORY))}, requested {got}')
    want_pages = dict(want.hugepage_limits)
    got_pages = {s: v for s, v in requested.hugepage_limits if v}
    for size in sorted(set(want_pages) | set(got_pages)):
        if want_pages.get(size, 0) != got_pages.get(size, 0):
            label = hugepage_resource(size)
            d = format_quantity(want_pages[size], "BinarySI") if size in want_pages else "nothing"
            r = format_quantity(got_pages[size], "BinarySI") if size in got_pages else "nothing"
            out.append(f'container "{name}": limits.{label} declared {d}, requested {r}')
    return out


# -- pods sized without a declaration: stay inside the VM ---------------------------------------
@dataclass(frozen=True)
class Usage:
    cpu_millis: int = 0
    memory_bytes: int = 0
    hugepages: tuple[tuple[int, int], ...] = ()

    @staticmethod
    def of_linux(lr: LinuxResources) -> Usage:
        return Usage(cpu_millis=lr.cpu_millis(), memory_bytes=lr.memory_limit_bytes, hugepages=lr.hugepage_limits)

    @staticmethod
    def of_resources(res: ContainerResources) -> Usage:
        return Usage.of_linux(implied_linux(res))


def _counted(demand: PodDemand, amount: int, envelope: int) -> int:
    """What a container's limit adds to its siblings' (``check_envelope``): nothing when it is the
    pod-level limit the kubelet handed it."""
    return 0 if demand.mode == "linux-resources" and amount == envelope else amount


def totals(demand: PodDemand, others: Sequence[Usage], new: Usage) -> tuple[int, int]:
    """The cpu (millicores) and memory (bytes) the containers' limits add up to against ``demand``."""
    usages = (*others, new)
    return (
        sum(_counted(demand, u.cpu_millis, demand.cpu_millis) for u in usages),
        sum(_counted(demand, u.memory_bytes, demand.memory_bytes) for u in usages),
    )


def check_envelope(demand: PodDemand, others: Sequence[Usage], new: Usage, *, who: str) -> None:
    """The containers' limits, summed, must stay within what the VM was sized for.

    A pod sized from LinuxPodSandboxConfig (``linux-resources``: what a kubelet sends) follows the
    kubelet's cgroup model, where the sandbox's limits are the pod's and the VM is the pod's
    cgroup. A container whose limit of a resource equals the pod's own is one the kubelet gave the
    pod-level limit because it has none of its own (KEP-2837 ``spec.resources``): it shares the
    envelope with its siblings and does not add to their sum."""
    cpu, mem = totals(demand, others, new)
    problems = []
    if cpu > demand.cpu_millis:
        problems.append(
            f"cpu: {format_quantity(Fraction(cpu, 1000), 'DecimalSI')} in all > VM's "
            f"{format_quantity(Fraction(demand.cpu_millis, 1000), 'DecimalSI')} "
            f"(it would have to grow by {format_quantity(Fraction(cpu - demand.cpu_millis, 1000), 'DecimalSI')})"
        )
    if mem > demand.memory_bytes:
        problems.append(
            f"memory: {format_quantity(mem, 'BinarySI')} in all > "
            f"VM's {format_quantity(demand.memory_bytes, 'BinarySI')} "
            f"(it would have to grow by {format_quantity(mem - demand.memory_bytes, 'BinarySI')})"
        )
    for size, _ in new.hugepages:
        have = demand.hugepage_bytes(size)
        used = sum(_counted(demand, dict(u.hugepages).get(size, 0), have) for u in (*others, new))
        if used > have:
            problems.append(
                f"{hugepage_resource(size)}: {format_quantity(used, 'BinarySI')} in all > VM's "
                f"{format_quantity(have, 'BinarySI') if have else 'nothing'} "
                f"(it would have to grow by {format_quantity(used - have, 'BinarySI')})"
            )
    if problems:
        raise Diverged(f"{who} does not fit in the VM, which cannot grow: " + "; ".join(problems))


def attachment_differences(name: str, declared: ContainerResources, requested: ContainerResources) -> list[str]:
    """Mounts, devices and CDI devices only (for containers that carry no kubernetes_resources)."""
    return [
        *_set_differences(name, "mount", declared.mounts, requested.mounts),
        *_set_differences(name, "device", declared.devices, requested.devices),
        *_set_differences(name, "CDI device", declared.cdi_devices, requested.cdi_devices),
    ]
