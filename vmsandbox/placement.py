"""Choose host CPUs, hugepages, ordinary memory and PCI devices for a VM shape (pure).

What a sandbox holds is a ``vmsandbox.claims.Claim``: exclusive CPUs, PCI functions, hugepages
counted per (node, page size) and ordinary guest memory counted per node. Placement reads what is
free and returns what to claim; the ResourceManager (``shim.host_resources``) keeps the free state and
the ledger records the claims, which makes double-booking impossible.

**Pools.** The shim owns ``cpu_pool``. Of it, ``shared_cpus`` is the shared pool (non-exclusive
pods float over all of it, whatever else runs there) and ``housekeeping_cpus`` is where emulator
threads may be pinned (profile ``emulator: housekeeping``; it may overlap the shared pool). The
rest is the exclusive pool: exclusive placement never takes a shared or housekeeping CPU. With no
shared pool configured, shared pods are refused (RESOURCE_EXHAUSTED, saying so): floating them over
"whatever no exclusive pod holds right now" would let a later exclusive pod take those CPUs.

**Exclusive CPUs** are taken whole cores first (thread siblings together; a core counts as whole
only when all its online threads are in the exclusive pool), then lone threads, then, only when
needed, threads of a core that gets broken; lowest ids first.

**Memory.** A guest backed by hugepages takes pages of its page size; any other guest takes its
RAM from the node's ordinary memory (``HostPools.memory_capacity``: the node's MemTotal minus its
hugepage pools minus what the admin reserved), so a guest larger than a node's memory is refused
like one short of pages. An inventory without memory figures leaves ordinary memory unaccounted.

**NUMA policy** (profile ``numa_policy``, after the kubelet Topology Manager's):

* ``single-numa-node``: CPUs, memory and devices on one node, or refused per node.
* ``restricted``: one node when one can hold the VM; a VM too big for any one node spans the fewest
  nodes whose *capacity* can hold it, and is refused when those are not free together.
* ``best-effort``: one node when one fits now, else the fewest nodes that fit now.
* ``none``: no alignment: CPUs where they fit best, memory preferably on the CPUs' nodes, devices
  anywhere.

Pages always come from the nodes of the CPUs under the aligned policies (``<numatune>`` strict;
spanning VMs get one guest NUMA cell per node, each bound to its node's pages), and so do devices.
Shared pods float over the whole shared pool under every policy (as the kubelet's shared pool);
the policy places their memory and devices, on nodes that have shared CPUs. Devices with no NUMA
node (``numa_node`` -1) fit any node.

**Packing** (which of the nodes that fit; the shim's ``packing`` setting): ``spread`` (default)
takes the emptiest node, the largest sum over the resources the VM asks for of (free left after it
/ capacity); ``best-fit`` the node left fullest (the smallest such sum); ``first-fit`` the lowest
node id. Device groups count as best fit under both ``spread`` and ``best-fit``: a one-GPU pod goes
where it leaves the fewest GPUs idle, so a pod that needs two on one node still finds them. Ties go
to the lowest node ids. ``bench/placement.py`` measures what each leaves unusable
on a full host: on its hosts ``spread`` left no 2 MiB page unusable where ``best-fit`` and
``first-fit`` (which fill node after node alike) left up to 2.3 % on small nodes, and it strands
no more CPUs.

**Cost.** ``HostPools`` (what may be handed out, ``vmsandbox.host_pools``) is built once per
host; ``FreeState`` keeps, per node, sorted lists of free whole cores and lone threads, free page
and memory counts and free device groups, and is updated in place by ``take``/``release`` (or
built from held claims on start). ``decide`` then costs O(nodes + vCPUs + devices): no per-page
work and no scan of what is taken (a VM spanning nodes also weighs the node sets of the smallest
size that can hold it, at most C(nodes, k)).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Literal, NamedTuple

from vmsandbox.claims import Claim
from vmsandbox.devices import NO_DEVICES, NO_POOLS, DeviceGroup, DevicePools, DeviceRequest
from vmsandbox.errors import CannotFit, Shortfall
from vmsandbox.host import HostInventory, format_cpulist
from vmsandbox.host_pools import NO_AFFINITY, FreeState, HostPools, HugepageBudget, host_pools
from vmsandbox.profile import EmulatorPolicy as EmulatorPolicy
from vmsandbox.profile import NumaPolicy as NumaPolicy
from vmsandbox.quantity import format_quantity
from vmsandbox.resources import hugepage_resource
from vmsandbox.sizing import VmShape

Packing = Literal["best-fit", "first-fit", "spread"]
PACKINGS: tuple[Packing, ...] = ("best-fit", "first-fit", "spread")
DEFAULT_PACKING: Packing = "spread"


@dataclass(frozen=True)
class GuestCell:
    """A guest NUMA cell of a VM whose memory spans host nodes: its vCPUs and its pages' host node."""

    host_node: int
    vcpus: tuple[int, ...]  # guest vCPU indexes (may be empty: a memory-only cell)
    pages: int  # backing pages from ``host_node``


@dataclass(frozen=True)
class Placement:
    cpus: tuple[int, ...]  # one per vCPU (exclusive) or the pool to float over (shared)
    nodes: tuple[int, ...]  # NUMA nodes of the CPUs and memory
    hugepages: tuple[tuple[int, int, int], ...] = ()  # (node, page size, count)
    emulator_cpus: tuple[int, ...] = ()  # where QEMU's own threads run
    devices: tuple[DeviceGroup, ...] = ()  # IOMMU groups passed through, whole
    exclusive: bool = True  # cpus are held (claimed), not floated over
    cells: tuple[GuestCell, ...] = ()  # guest NUMA cells when the pages span nodes
    memory: tuple[tuple[int, int], ...] = ()  # (node, bytes) of ordinary memory (guests not on hugepages)

    @cached_property
    def claim(self) -> Claim:
        """What the sandbox holds: its CPUs (exclusive only), pages, ordinary memory, PCI functions."""
        return Claim.of(
            self.cpus if self.exclusive else (),
            (a for g in self.devices for a in g.addresses),
            self.hugepages,
            self.memory,
        )

    @property
    def hostdevs(self) -> tuple[str, ...]:
        """PCI addresses of every function passed through, group by group."""
        return tuple(a for g in self.devices for a in g.addresses)


# -- the decision ------------------------------------------------------------------------------------
class _Resource(NamedTuple):
    """One thing the VM needs per node set: CPUs, pages of one size, ordinary memory or groups of one
    device pool."""

    label: str
    unit: str
    need: int
    free: Mapping[int, int]
    cap: Mapping[int, int]
    free_anywhere: int = 0  # devices without a NUMA node fit any node set
    cap_anywhere: int = 0
    pool: str = ""  # what to change when the pool itself is too small
    in_bytes: bool = False  # amounts are bytes (ordinary memory)
    packed: bool = False  # always best fit (scarce devices), whatever the packing

    def free_on(self, nodes: Sequence[int]) -> int:
        free = self.free  # below zero where more is held than the budget (see FreeState.take_claim)
        return sum([max(free.get(n, 0), 0) for n in nodes]) + self.free_anywhere

    def cap_on(self, nodes: Sequence[int]) -> int:
        cap = self.cap
        return sum([cap.get(n, 0) for n in nodes]) + self.cap_anywhere

    def capacity(self) -> _Resource:
        return self._replace(free=self.cap, free_anywhere=self.cap_anywhere)

    def amount(self, value: int) -> str:
        if not self.in_bytes:
            return str(value)
        if value % (1 << 30) == 0:
            return format_quantity(value, "BinarySI")
        return f"{value >> 20}Mi"  # whole MiB, rounded down


def _where(nodes: Sequence[int]) -> str:
    return f"node {nodes[0]}" if len(nodes) == 1 else f"nodes {format_cpulist(list(nodes))}"


def _shortfalls(nodes: Sequence[int], resources: Sequence[_Resource], named: Sequence[DeviceGroup]) -> list[Shortfall]:
    out = []
    where = _where(nodes)
    single = nodes[0] if len(nodes) == 1 else None
    for r in resources:
        free = max(r.free.get(single, 0), 0) + r.free_anywhere if single is not None else max(r.free_on(nodes), 0)
        if free >= r.need:
            continue
        need = f"{r.amount(r.need)}{r.unit}"
        text = f"{r.label} on {where}: need {need}, free {r.amount(free)} (short by {r.amount(r.need - free)})"
        cap = r.cap.get(single, 0) + r.cap_anywhere if single is not None else r.cap_on(nodes)
        if cap < r.need:  # waiting for other pods to go will not help: the configuration must change
            text += f"; its pool there is only {r.amount(cap)}{r.unit} ({r.pool}): waiting will not help"
        out.append(Shortfall(r.label, where, need, r.amount(free), text))
    for g in named:
        if g.node >= 0 and g.node not in nodes:
            group = f"IOMMU group {g.group} (pool {g.pool})"
            out.append(Shortfall(group, where, f"node {g.node}", where, f"{group} is on node {g.node}, not {where}"))
    return out


def _refuse(shortfalls: Sequence[Shortfall], prefix: str = "cannot place the VM: ", suffix: str = "") -> CannotFit:
    return CannotFit(prefix + "; ".join(map(str, shortfalls)) + suffix, shortfalls)


def _fewest_nodes(eligible: Sequence[int], resources: Sequence[_Resource], must: frozenset[int]) -> int:
    """A lower bound on how many of ``eligible`` can hold everything (len + 1: none can)."""
    bound = max(len(must), 1)
    for r in resources:
        missing = r.need - r.free_anywhere
        if missing <= 0:
            continue
        held = 0
        for k, free in enumerate(sorted([r.free.get(n, 0) for n in eligible], reverse=True), 1):
            held += free
            if held >= missing:
                bound = max(bound, k)
                break
        else:
            return len(eligible) + 1
    return bound


def _search(
    eligible: Sequence[int],
    resources: Sequence[_Resource],
    must: frozenset[int],
    sizes: Iterable[int],
    sign: float = 1.0,
) -> tuple[int, ...] | None:
    """The node set of the smallest size in ``sizes`` that holds everything and has the smallest
    ``sign`` x (sum over the resources of free left / capacity): best fit for 1, spread for -1,
    first fit for 0, devices always best fit (but for first fit); lowest node ids on ties."""
    best: tuple[float, tuple[int, ...]] | None = None
    bound = 0
    for k in sizes:
        if k == 1:
            for n in eligible:
                if must and not must <= {n}:
                    continue
                score = 0.0
                for r in resources:
                    left = r.free.get(n, 0) + r.free_anywhere - r.need
                    if left < 0:
                        break
                    weight = 1.0 if r.packed and sign else sign
                    score += weight * left / max(r.cap.get(n, 0) + r.cap_anywhere, 1)
                else:
                    if best is None or score < best[0]:
                        best = (score, (n,))
        else:
            if not bound:
                bound = _fewest_nodes(eligible, resources, must)
            if k < bound:
                continue
            if k > len(eligible):
                return None
            for nodes in itertools.combinations(eligible, k):
                if must and not must.issubset(nodes):
                    continue
                if all(r.free_on(nodes) >= r.need for r in resources):
                    score = sum(
                        (1.0 if r.packed and sign else sign) * (r.free_on(nodes) - r.need) / max(r.cap_on(nodes), 1)
                        for r in resources
                    )
                    if best is None or score < best[0]:
                        best = (score, nodes)
        if best is not None:
            return best[1]
    return None


def decide(
    shape: VmShape,
    pools: HostPools,
    state: FreeState,
    *,
    policy: NumaPolicy = "single-numa-node",
    emulator: EmulatorPolicy = "vcpus",
    devices: DeviceRequest = NO_DEVICES,
    packing: Packing = DEFAULT_PACKING,
) -> Placement:
    """Where the VM goes given what is free, or ``CannotFit`` naming each short resource, its node(s)
    and the shortfall. Reads ``state``, never changes it (``state.take(placement)`` does)."""
    sign = {"best-fit": 1.0, "first-fit": 0.0, "spread": -1.0}[packing]
    exclusive = shape.cpu_policy == "exclusive"
    if not pools.owned:
        raise CannotFit("the shim owns no CPUs (check cpu_pool in its configuration)")
    if exclusive and not pools.exclusive_cpus:
        raise CannotFit(
            f"no CPU is left for exclusive pods: cpu_pool ({format_cpulist(pools.owned)}) minus shared_cpus and "
            "housekeeping_cpus is empty"
        )
    if not exclusive and not pools.shared_cpus:
        raise CannotFit(
            "shared pods float over the shim's shared CPU pool, and none is configured "
            "(set shared_cpus, a subset of cpu_pool, in the shim's configuration)"
        )
    if emulator == "housekeeping" and not pools.housekeeping_cpus:
        raise CannotFit(
            "the profile pins emulator threads to housekeeping CPUs, and none are configured "
            "(set housekeeping_cpus, a subset of cpu_pool, in the shim's configuration)"
        )
    size = shape.backing_page_size
    pages = shape.reserved_pages
    named: list[DeviceGroup] = []
    for number in devices.named:
        group = pools.devices.group(number)
        if group is None:
            raise CannotFit(f"IOMMU group {number} is in no configured device pool on this host")
        if group.group in state.groups_taken:
            raise CannotFit(f"{group.describe()} is held by another sandbox")
        named.append(group)

    resources: list[_Resource] = []
    cpu_res = page_res = None
    if exclusive:
        cpu_res = _Resource(
            "cpu",
            "",
            shape.reserved_vcpus,
            state.ncpu,
            pools.cpu_capacity,
            pool="exclusive CPUs: cpu_pool less shared_cpus and housekeeping_cpus",
        )
        resources.append(cpu_res)
    if pages:
        page_free = state.pages_free.get(size, {})  # may be below zero (see take_claim): never fits
        page_res = _Resource(
            hugepage_resource(size),
            " pages",
            pages,
            page_free,
            pools.page_capacity.get(size, {}),
            pool="what the host reserved, within the hugepages cap",
        )
        resources.append(page_res)
    elif pools.memory_capacity:  # ordinary memory, counted per node like pages
        page_res = _Resource(
            "memory",
            "",
            shape.reserved_memory_bytes,
            state.memory,
            pools.memory_capacity,
            pool="MemTotal less hugepages and memory_reserved",
            in_bytes=True,
        )
        resources.append(page_res)
    dev_res: list[_Resource] = []
    for pool, count in devices.counts:
        free = {n: len(v) for n, v in state.groups.get(pool, {}).items()}
        for g in named:
            if g.pool == pool:
                key = g.node if g.node >= 0 else NO_AFFINITY
                free[key] = free.get(key, 0) - 1
        cap = pools.device_capacity.get(pool, {})
        dev_res.append(
            _Resource(
                f"device pool {pool}",
                " IOMMU groups",
                count,
                free,
                cap,
                free.get(NO_AFFINITY, 0),
                cap.get(NO_AFFINITY, 0),
                pool=f"device_pools.{pool}",
                packed=True,
            )
        )
    resources.extend(dev_res)

    eligible = pools.nodes if exclusive else pools.shared_nodes
    named_nodes = frozenset(g.node for g in named if g.node >= 0)
    all_sizes = range(1, len(eligible) + 1)

    if policy == "none":
        cpu_nodes: tuple[int, ...] = ()
        if cpu_res is not None:
            found = _search(eligible, [cpu_res], frozenset(), all_sizes, sign)
            if found is None:
                raise _refuse(_shortfalls(eligible, [cpu_res], ()))
            cpu_nodes = found
        page_nodes: tuple[int, ...] = ()
        if page_res is not None:
            found = _search(cpu_nodes or eligible, [page_res], frozenset(), (1,), sign)
            if found is None:
                found = _search(eligible, [page_res], frozenset(), all_sizes, sign)
            if found is None:
                raise _refuse(_shortfalls(eligible, [page_res], ()))
            page_nodes = found
        short = _shortfalls(pools.nodes, dev_res, ())
        if short:
            raise _refuse(short)
        device_order = [*cpu_nodes, *(n for n in pools.nodes if n not in cpu_nodes)]
        return _assemble(shape, pools, state, cpu_nodes, page_nodes, device_order, named, devices, emulator)

    must = named_nodes if policy != "best-effort" else named_nodes & frozenset(eligible)
    chosen = _search(eligible, resources, must, (1,), sign) if resources or named else tuple(eligible)
    if chosen is None:
        if policy == "single-numa-node" or len(eligible) < 2:
            raise _refuse([s for n in eligible for s in _shortfalls((n,), resources, named)])
        if policy == "restricted":
            by_capacity = _search(eligible, [r.capacity() for r in resources], must, all_sizes)
            if by_capacity is None:
                raise _refuse(_shortfalls(eligible, resources, named))
            k = len(by_capacity)
            if k == 1:
                raise _refuse(
                    [s for n in eligible for s in _shortfalls((n,), resources, named)],
                    suffix=" (numa_policy restricted: one NUMA node can hold it, so it is not spread over several)",
                )
            chosen = _search(eligible, resources, must, (k,), sign)
            if chosen is None:
                closest = min(
                    itertools.combinations(eligible, k),
                    key=lambda ns: sum(max(r.need - r.free_on(ns), 0) for r in resources),
                )
                raise _refuse(
                    _shortfalls(closest, resources, named),
                    prefix=f"cannot place the VM: numa_policy restricted: it needs {k} NUMA nodes and no {k} "
                    "have it free together: ",
                )
        else:  # best-effort
            chosen = _search(eligible, resources, must, range(2, len(eligible) + 1), sign)
            if chosen is None:
                raise _refuse(_shortfalls(eligible, resources, named))
    cpu_nodes = tuple(sorted(chosen, key=lambda n: (-state.ncpu.get(n, 0), n))) if exclusive else ()
    page_nodes = chosen if page_res is not None else ()
    return _assemble(shape, pools, state, cpu_nodes, page_nodes, list(chosen), named, devices, emulator)


def _assemble(
    shape: VmShape,
    pools: HostPools,
    state: FreeState,
    cpu_nodes: Sequence[int],
    page_nodes: Sequence[int],
    device_order: Sequence[int],
    named: Sequence[DeviceGroup],
    devices: DeviceRequest,
    emulator: EmulatorPolicy,
) -> Placement:
    """Pick the actual CPUs, page or memory amounts and groups on the chosen nodes (enough is known to
    be free)."""
    exclusive = shape.cpu_policy == "exclusive"
    cpus: list[int] = []
    on_node: dict[int, int] = {}
    if exclusive:
        left = shape.reserved_vcpus
        for n in cpu_nodes:
            take = min(state.ncpu[n], left)
            if take:
                cpus.extend(state.pick_cpus(n, take))
                on_node[n] = take
                left -= take
            if not left:
                break
    size = shape.backing_page_size
    counts: dict[int, int] = {}  # pages (hugepage-backed) or bytes (ordinary memory) per node
    if page_nodes:
        backed = shape.hugepage_backed
        left = shape.reserved_pages if backed else shape.reserved_memory_bytes

        def free_on(n: int) -> int:
            return state.usable_pages(n, size) if backed else max(state.memory.get(n, 0), 0)

        for n in sorted(page_nodes, key=lambda n: (-on_node.get(n, 0), -free_on(n), n)):
            take = min(free_on(n), left)
            if take:
                counts[n] = take
                left -= take
            if not left:
                break
    memory: dict[int, int] = {}
    if not shape.hugepage_backed:
        memory, counts = counts, {}
    chosen: list[DeviceGroup] = list(named)
    if devices.counts:
        skip = set(devices.named)
        by_group = pools.devices.by_group
        order = [*sorted(device_order, key=lambda n: (-on_node.get(n, 0), n)), NO_AFFINITY]
        for pool, count in devices.counts:
            left = count
            for n in order:
                for number in state.free_groups(pool, n):
                    if number in skip:
                        continue
                    chosen.append(by_group[number])
                    left -= 1
                    if not left:
                        break
                if not left:
                    break
    cpu_tuple = tuple(cpus) if exclusive else pools.shared_cpus
    nodes = (
        tuple(sorted(set(on_node) | set(counts) | set(memory))) if exclusive else tuple(sorted(set(pools.shared_nodes)))
    )
    if emulator == "housekeeping":
        near = [c for n in nodes for c in pools.housekeeping_by_node.get(n, ())]
        emulator_cpus = tuple(sorted(near)) if near else pools.housekeeping_cpus
    else:
        emulator_cpus = tuple(sorted(cpu_tuple))
    cells: tuple[GuestCell, ...] = ()
    if len(counts) > 1 and shape.headroom_memory_bytes:
        raise CannotFit(
            f"the guest's RAM and its resize headroom ({shape.headroom_memory_bytes >> 20} MiB) would span "
            f"{len(counts)} NUMA nodes; hot-plugged memory goes to one guest node, so a pod with memory headroom "
            "must fit on one host node (numa_policy: single-numa-node, or a smaller headroom)"
        )
    if len(counts) > 1:
        page_order = sorted(counts)
        vcpus_of: dict[int, list[int]] = {n: [] for n in page_order}
        for i, cpu in enumerate(cpu_tuple if exclusive else ()):
            vcpus_of.get(pools.cpu_node[cpu], vcpus_of[page_order[0]]).append(i)
        if not exclusive:
            vcpus_of[page_order[0]].extend(range(shape.reserved_vcpus))
        cells = tuple(GuestCell(n, tuple(sorted(vcpus_of[n])), counts[n]) for n in page_order)
    return Placement(
        cpus=cpu_tuple,
        nodes=nodes,
        hugepages=tuple((n, size, counts[n]) for n in sorted(counts)),
        emulator_cpus=emulator_cpus,
        devices=tuple(chosen),
        exclusive=exclusive,
        cells=cells,
        memory=tuple(sorted(memory.items())),
    )


def place(
    shape: VmShape,
    inventory: HostInventory,
    owned_cpus: Iterable[int],
    held: Iterable[Claim],
    budgets: Mapping[tuple[int, int], HugepageBudget],
    *,
    shared_cpus: Iterable[int] = (),
    housekeeping_cpus: Iterable[int] = (),
    numa_policy: NumaPolicy = "single-numa-node",
    emulator: EmulatorPolicy = "vcpus",
    devices: DeviceRequest = NO_DEVICES,
    device_pools: DevicePools = NO_POOLS,
    memory: Mapping[int, int] | None = None,
    packing: Packing = DEFAULT_PACKING,
) -> Placement:
    """One decision from scratch: the pools and the free state built from what is held."""
    pools = host_pools(
        inventory,
        owned_cpus,
        shared_cpus=shared_cpus,
        housekeeping_cpus=housekeeping_cpus,
        budgets=budgets,
        devices=device_pools,
        memory=memory,
    )
    return decide(
        shape,
        pools,
        FreeState.from_claims(pools, held),
        policy=numa_policy,
        emulator=emulator,
        devices=devices,
        packing=packing,
    )
