"""What placement may hand out on a host, and what of it is free right now (pure).

``HostPools`` (built once per host by ``host_pools``) splits the CPUs the shim owns into the
exclusive, shared and housekeeping pools (``vmsandbox.placement`` says what each is for) and
records, per NUMA node, the exclusive pool's cores, the hugepage budgets, the device groups and
the ordinary memory the guests may take. ``FreeState`` keeps, per node, sorted lists of free whole
cores and lone threads, free page and memory counts and free device groups, updated in place by
``take``/``release`` (or built from held claims on start), so that ``placement.decide`` does no
per-page work and no scan of what is taken.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vmsandbox.claims import Claim
from vmsandbox.devices import NO_POOLS, DeviceGroup, DevicePools
from vmsandbox.errors import InvalidArgument
from vmsandbox.host import HostInventory, format_cpulist
from vmsandbox.resources import page_size_label

if TYPE_CHECKING:
    from vmsandbox.placement import Placement

NO_AFFINITY = -1  # node of devices the platform does not place


@dataclass(frozen=True)
class HugepageBudget:
    """How many pages of one size on one node the shim may hand out (``pages``: the pool, within the
    configured cap, less what others than the shim use), and what the kernel had free when it was made."""

    node: int
    page_size: int
    pages: int
    host_free: int


# -- what the shim may hand out (built once per host) ------------------------------------------------
@dataclass(frozen=True)
class HostPools:
    nodes: tuple[int, ...]
    owned: frozenset[int]
    exclusive_cpus: frozenset[int]
    shared_cpus: tuple[int, ...]
    housekeeping_cpus: tuple[int, ...]
    cpu_node: Mapping[int, int]
    cores: tuple[tuple[int, ...], ...]  # core index -> its exclusive-pool threads, sorted; by lowest id
    core_node: tuple[int, ...]
    core_whole: tuple[bool, ...]  # every online thread of the core is in the exclusive pool
    core_of: Mapping[int, int]  # exclusive CPU -> core index
    budgets: Mapping[tuple[int, int], HugepageBudget]
    devices: DevicePools = NO_POOLS
    cpu_capacity: Mapping[int, int] = field(default_factory=dict)  # exclusive CPUs per node
    shared_nodes: tuple[int, ...] = ()  # nodes with shared CPUs
    housekeeping_by_node: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    page_capacity: Mapping[int, Mapping[int, int]] = field(default_factory=dict)  # page size -> node -> pages
    device_capacity: Mapping[str, Mapping[int, int]] = field(default_factory=dict)  # pool -> node -> groups
    memory_capacity: Mapping[int, int] = field(default_factory=dict)  # node -> ordinary bytes; {}: not counted


def host_pools(
    inventory: HostInventory,
    owned_cpus: Iterable[int],
    *,
    shared_cpus: Iterable[int] = (),
    housekeeping_cpus: Iterable[int] = (),
    budgets: Mapping[tuple[int, int], HugepageBudget] | None = None,
    devices: DevicePools = NO_POOLS,
    memory: Mapping[int, int] | None = None,
) -> HostPools:
    """Split the owned CPUs into the exclusive, shared and housekeeping pools (InvalidArgument when
    shared or housekeeping CPUs are not owned). ``memory``: ordinary memory per node the guests
    may take (None: not counted)."""
    owned = frozenset(owned_cpus)
    shared = frozenset(shared_cpus)
    housekeeping = frozenset(housekeeping_cpus)
    for name, subset in (("shared_cpus", shared), ("housekeeping_cpus", housekeeping)):
        if not subset <= owned:
            raise InvalidArgument(
                f"{name} ({format_cpulist(subset)}) must be a subset of cpu_pool ({format_cpulist(owned)}): "
                f"{format_cpulist(subset - owned)} is not in it"
            )
    exclusive = owned - shared - housekeeping
    node_of = {c.id: c.node for c in inventory.cpus}
    threads: dict[tuple[int, int], list[int]] = {}
    for c in sorted(inventory.cpus):
        threads.setdefault((c.package, c.core), []).append(c.id)
    cores: list[tuple[int, ...]] = []
    whole: list[bool] = []
    for ids in sorted(threads.values()):
        mine = tuple(i for i in ids if i in exclusive)
        if mine:
            cores.append(mine)
            whole.append(len(mine) == len(ids))
    core_of = {cpu: i for i, ids in enumerate(cores) for cpu in ids}
    nodes = tuple(sorted({c.node for c in inventory.cpus} | {n for n, _ in (budgets or {})}))
    capacity = {n: 0 for n in nodes}
    for cpu in exclusive:
        capacity[node_of[cpu]] += 1
    page_capacity: dict[int, dict[int, int]] = {}
    for (node, size), budget in (budgets or {}).items():
        page_capacity.setdefault(size, {})[node] = budget.pages
    device_capacity: dict[str, dict[int, int]] = {}
    for pool, groups in devices.pools.items():
        per_node = device_capacity.setdefault(pool, {})
        for g in groups:
            key = g.node if g.node >= 0 else NO_AFFINITY
            per_node[key] = per_node.get(key, 0) + 1
    hk_by_node: dict[int, list[int]] = {}
    for cpu in sorted(housekeeping):
        hk_by_node.setdefault(node_of[cpu], []).append(cpu)
    return HostPools(
        nodes=nodes,
        owned=owned,
        exclusive_cpus=exclusive,
        shared_cpus=tuple(sorted(shared)),
        housekeeping_cpus=tuple(sorted(housekeeping)),
        cpu_node=node_of,
        cores=tuple(cores),
        core_node=tuple(node_of[ids[0]] for ids in cores),
        core_whole=tuple(whole),
        core_of=core_of,
        budgets=dict(budgets or {}),
        devices=devices,
        cpu_capacity=capacity,
        shared_nodes=tuple(sorted({node_of[c] for c in shared})),
        housekeeping_by_node={n: tuple(v) for n, v in hk_by_node.items()},
        page_capacity=page_capacity,
        device_capacity=device_capacity,
        memory_capacity={n: max(b, 0) for n, b in (memory or {}).items()},
    )


# -- what is free (sorted per-node structures) ------------------------------------------------------
class FreeState:
    """What is free right now, per node: whole cores, lone threads, page and memory counts, device
    groups. Kept up to date with ``take``/``release``; ``from_claims`` builds it from held claims."""

    def __init__(self, pools: HostPools) -> None:
        self.pools = pools
        # node -> core width -> sorted indexes of wholly free whole cores
        self.full: dict[int, dict[int, list[int]]] = {n: {} for n in pools.nodes}
        self.lone: dict[int, list[int]] = {n: [] for n in pools.nodes}  # free CPUs outside free whole cores
        self.ncpu: dict[int, int] = {n: 0 for n in pools.nodes}
        self.core_free: list[int] = [len(ids) for ids in pools.cores]
        for i, ids in enumerate(pools.cores):
            node = pools.core_node[i]
            self.ncpu[node] += len(ids)
            if pools.core_whole[i]:
                self.full[node].setdefault(len(ids), []).append(i)
            else:
                self.lone[node].extend(ids)
        for n in pools.nodes:
            self.lone[n].sort()
        self.npages: dict[tuple[int, int], int] = {k: max(b.pages, 0) for k, b in pools.budgets.items()}
        # the same counts by page size, then node: what ``decide`` reads (kept in step with npages)
        self.pages_free: dict[int, dict[int, int]] = {}
        for (node, size), free in self.npages.items():
            self.pages_free.setdefault(size, {})[node] = free
        self.memory: dict[int, int] = dict(pools.memory_capacity)
        # pool -> node (NO_AFFINITY included) -> sorted free group numbers
        self.groups: dict[str, dict[int, list[int]]] = {}
        for pool, groups in pools.devices.pools.items():
            per_node: dict[int, list[int]] = {}
            for g in groups:
                per_node.setdefault(g.node if g.node >= 0 else NO_AFFINITY, []).append(g.group)
            self.groups[pool] = {n: sorted(v) for n, v in per_node.items()}
        self.groups_taken: set[int] = set()

    @classmethod
    def from_claims(cls, pools: HostPools, held: Iterable[Claim]) -> FreeState:
        """The free state given what is held (``take_claim`` of each, leniently: see there)."""
        state = cls(pools)
        for claim in held:
            state.take_claim(claim, strict=False)
        return state

    # -- CPUs ---------------------------------------------------------------------------------------
    def take_cpu(self, cpu: int) -> None:
        pools = self.pools
        core = pools.core_of[cpu]
        node = pools.core_node[core]
        ids = pools.cores[core]
        if pools.core_whole[core] and self.core_free[core] == len(ids):
            bucket = self.full[node][len(ids)]
            del bucket[bisect_left(bucket, core)]
            for other in ids:
                if other != cpu:
                    insort(self.lone[node], other)
        else:
            lone = self.lone[node]
            at = bisect_left(lone, cpu)
            if at == len(lone) or lone[at] != cpu:
                raise ValueError(f"CPU {cpu} is not free")
            del lone[at]
        self.core_free[core] -= 1
        self.ncpu[node] -= 1

    def release_cpu(self, cpu: int) -> None:
        pools = self.pools
        core = pools.core_of[cpu]
        node = pools.core_node[core]
        ids = pools.cores[core]
        self.core_free[core] += 1
        self.ncpu[node] += 1
        lone = self.lone[node]
        if pools.core_whole[core] and self.core_free[core] == len(ids):
            for other in ids:
                if other != cpu:
                    del lone[bisect_left(lone, other)]
            insort(self.full[node].setdefault(len(ids), []), core)
        else:
            insort(lone, cpu)

    def pick_cpus(self, node: int, count: int) -> list[int]:
        """``count`` free CPUs of ``node``: whole cores (widest first), lone threads, then broken cores."""
        cores = self.pools.cores
        out: list[int] = []
        left = count
        used: set[int] = set()
        buckets = self.full[node]
        for width in sorted(buckets, reverse=True):
            if left < width:
                continue
            for core in buckets[width][: left // width]:
                out.extend(cores[core])
                used.add(core)
            left = count - len(out)
        if left:
            lone = self.lone[node][:left]
            out.extend(lone)
            left -= len(lone)
        if left:
            for width in sorted(buckets):
                for core in buckets[width]:
                    if core in used:
                        continue
                    take = cores[core][:left]
                    out.extend(take)
                    left -= len(take)
                    if not left:
                        return out
        return out

    # -- pages and memory ---------------------------------------------------------------------------
    def usable_pages(self, node: int, size: int) -> int:
        return max(self.npages.get((node, size), 0), 0)

    def take_pages(self, node: int, size: int, count: int, *, strict: bool = True) -> None:
        free = self.npages.get((node, size))
        if free is None:
            if strict:
                raise ValueError(f"no {page_size_label(size)} hugepage budget on node {node}")
            return
        if strict and free < count:
            raise ValueError(f"{count} {page_size_label(size)} pages on node {node} are not free ({free} are)")
        self.npages[(node, size)] = self.pages_free[size][node] = free - count

    def release_pages(self, node: int, size: int, count: int) -> None:
        if (node, size) in self.npages:
            self.npages[(node, size)] = self.pages_free[size][node] = self.npages[(node, size)] + count

    def take_memory(self, node: int, amount: int, *, strict: bool = True) -> None:
        free = self.memory.get(node)
        if free is None:
            return  # memory of this node is not counted
        if strict and free < amount:
            raise ValueError(f"{amount} bytes of memory on node {node} are not free ({free} are)")
        self.memory[node] = free - amount

    def release_memory(self, node: int, amount: int) -> None:
        if node in self.memory:
            self.memory[node] += amount

    # -- devices ------------------------------------------------------------------------------------
    def free_groups(self, pool: str, node: int) -> list[int]:
        return self.groups.get(pool, {}).get(node, [])

    def take_group(self, group: DeviceGroup) -> None:
        node = group.node if group.node >= 0 else NO_AFFINITY
        free = self.groups[group.pool][node]
        at = bisect_left(free, group.group)
        if at == len(free) or free[at] != group.group:
            raise ValueError(f"IOMMU group {group.group} is not free")
        del free[at]
        self.groups_taken.add(group.group)

    def release_group(self, group: DeviceGroup) -> None:
        node = group.node if group.node >= 0 else NO_AFFINITY
        insort(self.groups[group.pool].setdefault(node, []), group.group)
        self.groups_taken.discard(group.group)

    # -- whole claims -------------------------------------------------------------------------------
    def take_claim(self, claim: Claim, *, strict: bool = True) -> None:
        """Mark everything of ``claim`` taken. ``strict`` (the request path): ValueError when some of it
        is not free. Lenient (rebuilding from the ledger): what is outside the pools is ignored and a
        pool held beyond its budget (the configuration shrank) goes below zero, so nothing is handed
        out until enough is released."""
        by_address = self.pools.devices.by_address
        core_of = self.pools.core_of
        for cpu in claim.cpus:
            if cpu in core_of or strict:
                self.take_cpu(cpu)
        for node, size, count in claim.pages:
            self.take_pages(node, size, count, strict=strict)
        for node, amount in claim.memory:
            self.take_memory(node, amount, strict=strict)
        for address in claim.pci:
            group = by_address.get(address)
            if group is None:
                if strict:
                    raise ValueError(f"PCI function {address} is in no device pool")
                continue
            if group.group not in self.groups_taken:
                self.take_group(group)

    def release_claim(self, claim: Claim) -> None:
        by_address = self.pools.devices.by_address
        core_of = self.pools.core_of
        for cpu in claim.cpus:
            if cpu in core_of:
                self.release_cpu(cpu)
        for node, size, count in claim.pages:
            self.release_pages(node, size, count)
        for node, amount in claim.memory:
            self.release_memory(node, amount)
        for address in claim.pci:
            group = by_address.get(address)
            if group is not None and group.group in self.groups_taken:
                self.release_group(group)

    def take(self, placement: Placement) -> None:
        self.take_claim(placement.claim)

    def release(self, placement: Placement) -> None:
        self.release_claim(placement.claim)

    def snapshot(self) -> tuple[object, ...]:
        """A comparable picture of everything free (tests: incremental == rebuilt from claims)."""
        return (
            {n: {w: list(v) for w, v in b.items() if v} for n, b in self.full.items()},
            {n: list(v) for n, v in self.lone.items()},
            dict(self.ncpu),
            dict(self.npages),
            dict(self.memory),
            {p: {n: list(v) for n, v in g.items() if v} for p, g in self.groups.items()},
            frozenset(self.groups_taken),
        )
