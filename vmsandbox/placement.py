"""Choose host CPUs and hugepages for a VM shape (pure).

Everything a sandbox holds is a *claim key*, a string the ledger stores under a unique
constraint: ``cpu:<id>`` for an exclusively owned CPU and ``hugepages-<kib>kB:node<n>:<i>`` for
one page of the shim's hugepage budget. Placement reads the free keys and returns the ones to
claim; the ledger makes double-booking impossible.

Exclusive pods get whole cores first (thread siblings together), on one NUMA node when one can
hold the CPUs and the pages, best fit first (the fullest node that still fits); shared pods float
over the owned CPUs that no exclusive pod holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from vmsandbox.errors import CannotFit
from vmsandbox.host import HostCpu, HostInventory, format_cpulist
from vmsandbox.sizing import VmShape


def cpu_key(cpu: int) -> str:
    return f"cpu:{cpu}"


def page_key(page_size: int, node: int, index: int) -> str:
    return f"hugepages-{page_size // 1024}kB:node{node}:{index}"


@dataclass(frozen=True)
class HugepageBudget:
    """How many pages of one size on one node the shim may hand out, and how many the kernel has free."""

    node: int
    page_size: int
    pages: int
    host_free: int


@dataclass(frozen=True)
class Placement:
    cpus: tuple[int, ...]  # one per vCPU (exclusive) or the pool to float over (shared)
    nodes: tuple[int, ...]  # NUMA nodes of the CPUs and pages
    claims: tuple[str, ...]  # keys to insert into the ledger
    hugepages: tuple[tuple[int, int, int], ...] = ()  # (node, page size, count)


def _size_label(page_size: int) -> str:
    return f"{page_size >> 30}Gi" if page_size >= 1 << 30 else f"{page_size >> 20}Mi"


def _pick_cpus(free: list[HostCpu], count: int) -> list[int] | None:
    """Whole free cores first (siblings together), then the rest, lowest ids first."""
    if len(free) < count:
        return None
    cores: dict[tuple[int, int], list[int]] = {}
    for c in sorted(free, key=lambda c: c.id):
        cores.setdefault((c.package, c.core), []).append(c.id)
    groups = sorted(cores.values(), key=lambda ids: (-len(ids), ids[0]))
    chosen: list[int] = []
    for ids in groups:
        if len(chosen) >= count:
            break
        if len(chosen) + len(ids) <= count:
            chosen.extend(ids)
    for ids in groups:
        for cpu in ids:
            if len(chosen) >= count:
                break
            if cpu not in chosen:
                chosen.append(cpu)
    return chosen[:count]


def _free_pages(budget: HugepageBudget, taken: frozenset[str]) -> list[str]:
    keys = [page_key(budget.page_size, budget.node, i) for i in range(budget.pages)]
    return [k for k in keys if k not in taken]


def place(
    shape: VmShape,
    inventory: HostInventory,
    owned_cpus: Iterable[int],
    taken: frozenset[str],
    budgets: Mapping[tuple[int, int], HugepageBudget],
) -> Placement:
    """Where the VM goes, or ``CannotFit`` naming the short resource, the node and the shortfall."""
    owned = set(owned_cpus)
    if not owned:
        raise CannotFit("the shim owns no CPUs (check cpu_pool in its configuration)")
    pages_needed = shape.backing_pages
    page_size = shape.backing_page_size
    shortfalls: list[str] = []
    candidates = []
    for node in inventory.nodes:
        node_cpus = [c for c in inventory.cpus if c.node == node and c.id in owned]
        free_cpus = [c for c in node_cpus if cpu_key(c.id) not in taken]
        budget = budgets.get((node, page_size))
        free_pages = _free_pages(budget, taken) if budget and pages_needed else []
        usable_pages = min(len(free_pages), budget.host_free) if budget else 0
        ok = True
        if shape.cpu_policy == "exclusive" and len(free_cpus) < shape.vcpus:
            shortfalls.append(
                f"cpu on node {node}: need {shape.vcpus}, free {len(free_cpus)} "
                f"(short by {shape.vcpus - len(free_cpus)})"
            )
            ok = False
        if pages_needed and usable_pages < pages_needed:
            label = f"hugepages-{_size_label(page_size)}"
            shortfalls.append(
                f"{label} on node {node}: need {pages_needed} pages, free {usable_pages} "
                f"(short by {pages_needed - usable_pages})"
            )
            ok = False
        if ok:
            candidates.append((len(free_cpus), node, free_cpus, free_pages))
    if not candidates:
        raise CannotFit("cannot place the VM: " + "; ".join(shortfalls))
    candidates.sort(key=lambda c: (c[0], c[1]))  # best fit: fewest free CPUs that still fit
    _, node, free_cpus, free_pages = candidates[0]
    claims: list[str] = []
    if shape.cpu_policy == "exclusive":
        picked = _pick_cpus(free_cpus, shape.vcpus)
        assert picked is not None  # candidates only hold nodes with enough CPUs
        cpus = tuple(picked)
        claims.extend(cpu_key(c) for c in cpus)
    else:
        shared = sorted(c.id for c in inventory.cpus if c.id in owned and cpu_key(c.id) not in taken)
        if not shared:
            raise CannotFit(f"no shared CPU left: every owned CPU ({format_cpulist(owned)}) is held exclusively")
        cpus = tuple(shared)
    hugepages: tuple[tuple[int, int, int], ...] = ()
    if pages_needed:
        claims.extend(free_pages[:pages_needed])
        hugepages = ((node, page_size, pages_needed),)
    return Placement(cpus=cpus, nodes=(node,), claims=tuple(claims), hugepages=hugepages)
