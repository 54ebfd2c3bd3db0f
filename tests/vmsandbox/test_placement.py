"""Tests of vmsandbox.placement: whole cores, pools, NUMA policies, hugepage budgets, IOMMU groups,
shortfall messages, and (hypothesis) that nothing is ever held twice on any fixture host."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vmsandbox.adapters.sysfs import read_inventory
from vmsandbox.claims import Claim
from vmsandbox.devices import NO_DEVICES, NO_POOLS, DevicePools, DeviceRequest, resolve_pools
from vmsandbox.errors import CannotFit, InvalidArgument
from vmsandbox.host import HostCpu, HostInventory, HugepagePool
from vmsandbox.host_pools import FreeState, HostPools, HugepageBudget, host_pools
from vmsandbox.placement import GuestCell, NumaPolicy, Packing, Placement, decide, place
from vmsandbox.sizing import PodDemand, VmShape

FIXTURES = Path(__file__).parents[1] / "fixtures" / "sysfs"
MI, GI = 1024**2, 1024**3
P2M, P1G = 2 * MI, GI

#: this machine: one node, two CPUs, no SMT, 64 x 2Mi pages
ONE_NODE = HostInventory(
    cpus=(HostCpu(0, node=0, package=0, core=0), HostCpu(1, node=0, package=0, core=1)),
    hugepages=(HugepagePool(node=0, page_size=P2M, total=64, free=64),),
)
#: two nodes (one per socket), two cores per socket, two threads per core; siblings are n and n+4
TWO_NODES = HostInventory(
    cpus=tuple(
        HostCpu(cpu, node=package, package=package, core=core)
        for thread in (0, 1)
        for package in (0, 1)
        for core in (0, 1)
        for cpu in [thread * 4 + package * 2 + core]
    ),
    hugepages=(
        HugepagePool(node=0, page_size=P2M, total=256, free=256),
        HugepagePool(node=1, page_size=P2M, total=256, free=256),
        HugepagePool(node=0, page_size=P1G, total=2, free=2),
        HugepagePool(node=1, page_size=P1G, total=2, free=1),
    ),
)
#: two sockets x 16 cores x 2 threads (siblings n and n+32), node = socket
HOST_64 = HostInventory(
    cpus=tuple(HostCpu(i, node=(i // 16) % 2, package=(i // 16) % 2, core=i % 16) for i in range(64)),
    hugepages=tuple(HugepagePool(n, P2M, 1024, 1024) for n in (0, 1)),
)
#: the VFIO fixture: TWO_NODES' CPUs, 512 x 2Mi per node, GPUs in shared IOMMU groups (README there)
VFIO = read_inventory(FIXTURES / "vfio-two-node" / "sys", FIXTURES / "vfio-two-node" / "proc")
VFIO_POOLS = resolve_pools(
    {
        "gpu": ["10de:2330", "10de:22a3"],  # groups 12 (node 0), 40 and 41 (node 1; 41 has a bridge)
        "nic": ["0000:86:00.0"],  # group 30 also holds 86:00.1 (driver ice): left out
        "accel": ["8086:0b25"],  # group 7, no NUMA node
    },
    VFIO,
)


def budgets(inv: HostInventory, **free: int) -> dict[tuple[int, int], HugepageBudget]:
    """Every pool in the shim's budget as far as the kernel has it free; ``node0_2M=10`` overrides the
    kernel's free count (the ResourceManager leaves pages others use out of the budget)."""
    out = {}
    for p in inv.hugepages:
        label = f"node{p.node}_{'1G' if p.page_size == P1G else '2M'}"
        host_free = free.get(label, p.free)
        out[(p.node, p.page_size)] = HugepageBudget(p.node, p.page_size, min(p.total, host_free), host_free)
    return out


def shape(vcpus: int, memory: int = 128 * MI, page: int = 4096, policy: str = "exclusive") -> VmShape:
    return VmShape(
        vcpus=vcpus,
        memory_bytes=memory,
        backing_page_size=page,
        guest_hugepages=(),
        cpu_policy=policy,  # type: ignore[arg-type]
        demand=PodDemand(vcpus * 1000, memory),
    )


def cpus(*ids: int) -> Claim:
    return Claim.of(cpus=ids)


def pages(size: int, node: int, indices: range) -> Claim:
    """As many pages as ``indices`` has (pages are counted; the indices only say how many)."""
    return Claim.of(pages=[(node, size, len(indices))])


def pci(*addresses: str) -> Claim:
    return Claim.of(pci=addresses)


ALL_2 = (0, 1)
ALL_8 = tuple(range(8))


@dataclass(frozen=True)
class Want:
    """What a placement must be: CPUs (in vCPU order), nodes, its claim, hugepages (node, size, count)."""

    cpus: tuple[int, ...]
    nodes: tuple[int, ...]
    claims: Claim
    hugepages: tuple[tuple[int, int, int], ...] = ()
    emulator: tuple[int, ...] | None = None  # default: the vCPUs' CPUs
    cells: tuple[GuestCell, ...] = ()


def check(p: Placement, want: Want) -> None:
    assert (p.cpus, p.nodes, p.claim, p.hugepages, p.cells) == (
        want.cpus,
        want.nodes,
        want.claims,
        want.hugepages,
        want.cells,
    )
    assert p.emulator_cpus == (want.emulator if want.emulator is not None else tuple(sorted(want.cpus)))


@dataclass(frozen=True)
class Case:
    inv: HostInventory
    vm: VmShape
    owned: tuple[int, ...] | range = ALL_8
    taken: Claim = field(default_factory=Claim)
    budget: Mapping[tuple[int, int], HugepageBudget] = field(default_factory=dict)
    shared: tuple[int, ...] = ()
    housekeeping: tuple[int, ...] = ()
    policy: NumaPolicy = "single-numa-node"
    emulator: str = "vcpus"
    devices: DeviceRequest = NO_DEVICES
    pools: DevicePools = NO_POOLS
    packing: Packing = "best-fit"  # these tables check best fit; spread and first fit: test_resource_manager

    def place(self) -> Placement:
        return place(
            self.vm,
            self.inv,
            self.owned,
            [self.taken],
            self.budget,
            shared_cpus=self.shared,
            housekeeping_cpus=self.housekeeping,
            numa_policy=self.policy,
            emulator=self.emulator,  # type: ignore[arg-type]
            devices=self.devices,
            device_pools=self.pools,
            packing=self.packing,
        )


PLACEMENTS = [
    pytest.param(Case(ONE_NODE, shape(1), ALL_2), Want((0,), (0,), cpus(0)), id="one-cpu"),
    pytest.param(Case(ONE_NODE, shape(1), ALL_2, cpus(0)), Want((1,), (0,), cpus(1)), id="next-free-cpu"),
    pytest.param(
        Case(ONE_NODE, shape(2, 128 * MI, P2M), ALL_2, budget=budgets(ONE_NODE)),
        Want((0, 1), (0,), cpus(0, 1) + pages(P2M, 0, range(64)), ((0, P2M, 64),)),
        id="whole-host-with-2Mi-pages",
    ),
    pytest.param(
        Case(ONE_NODE, shape(1, 32 * MI, P2M), ALL_2, pages(P2M, 0, range(0, 64, 2)), budgets(ONE_NODE)),
        Want((0,), (0,), cpus(0) + pages(P2M, 0, range(1, 33, 2)), ((0, P2M, 16),)),
        id="pages-skip-taken-keys",
    ),
    # -- SMT siblings
    pytest.param(Case(TWO_NODES, shape(2)), Want((0, 4), (0,), cpus(0, 4)), id="siblings-together"),
    pytest.param(Case(TWO_NODES, shape(3)), Want((0, 4, 1), (0,), cpus(0, 4, 1)), id="whole-core-then-a-thread"),
    pytest.param(Case(TWO_NODES, shape(4)), Want((0, 4, 1, 5), (0,), cpus(0, 4, 1, 5)), id="two-whole-cores"),
    pytest.param(
        Case(TWO_NODES, shape(1), taken=cpus(0)), Want((4,), (0,), cpus(4)), id="lone-thread-before-breaking-a-core"
    ),
    pytest.param(
        Case(TWO_NODES, shape(3), taken=cpus(0, 2)),
        Want((1, 5, 4), (0,), cpus(1, 5, 4)),
        id="odd-count-takes-a-lone-thread-not-a-core",
    ),
    # node 0 has 3 free CPUs, node 1 has 4: the fuller node that still fits wins
    pytest.param(Case(TWO_NODES, shape(2), taken=cpus(0)), Want((1, 5), (0,), cpus(1, 5)), id="best-fit-node"),
    pytest.param(
        Case(TWO_NODES, shape(3), taken=cpus(0, 1)), Want((2, 6, 3), (1,), cpus(2, 6, 3)), id="only-node-that-fits"
    ),
    pytest.param(Case(TWO_NODES, shape(2), (2, 3, 6, 7)), Want((2, 6), (1,), cpus(2, 6)), id="owned-subset"),
    # 6's sibling 2 is not owned: 6 is a lone thread, (1, 5) the only whole core
    pytest.param(Case(TWO_NODES, shape(2), (1, 5, 6)), Want((1, 5), (0,), cpus(1, 5)), id="owned-whole-core"),
    pytest.param(Case(TWO_NODES, shape(1), (1, 5, 6)), Want((6,), (1,), cpus(6)), id="owned-lone-thread-best-fit"),
    pytest.param(
        Case(TWO_NODES, shape(2, 64 * MI, P2M), budget=budgets(TWO_NODES, node0_2M=10)),
        Want((2, 6), (1,), cpus(2, 6) + pages(P2M, 1, range(32)), ((1, P2M, 32),)),
        id="kernel-free-pages-limit-the-budget",
    ),
    # CPUs tie; node 1 has 1 free 1Gi page (of 2), node 0 has 2: the tighter node wins
    pytest.param(
        Case(TWO_NODES, shape(2, GI, P1G), budget=budgets(TWO_NODES)),
        Want((2, 6), (1,), cpus(2, 6) + pages(P1G, 1, range(1)), ((1, P1G, 1),)),
        id="best-fit-counts-pages",
    ),
    pytest.param(
        Case(TWO_NODES, shape(2, 2 * GI, P1G), budget=budgets(TWO_NODES)),
        Want((0, 4), (0,), cpus(0, 4) + pages(P1G, 0, range(2)), ((0, P1G, 2),)),
        id="1Gi-only-node-with-two-free",
    ),
    # -- pools: shared and housekeeping CPUs are never taken exclusively
    pytest.param(
        Case(TWO_NODES, shape(4, policy="shared"), taken=cpus(0, 4), shared=(3, 7)),
        Want((3, 7), (1,), Claim()),
        id="shared-floats-over-the-shared-pool",
    ),
    pytest.param(
        Case(TWO_NODES, shape(2), shared=(3, 7)), Want((2, 6), (1,), cpus(2, 6)), id="exclusive-avoids-shared-pool"
    ),
    pytest.param(
        Case(TWO_NODES, shape(4), shared=(3, 7)),
        Want((0, 4, 1, 5), (0,), cpus(0, 4, 1, 5)),
        id="exclusive-where-no-shared-cpu",
    ),
    pytest.param(
        Case(ONE_NODE, shape(4, 16 * MI, P2M, "shared"), ALL_2, budget=budgets(ONE_NODE), shared=(1,)),
        Want((1,), (0,), pages(P2M, 0, range(8)), ((0, P2M, 8),)),
        id="shared-claims-only-pages",
    ),
    # node 0 fits the pages better, but the shared pod's CPUs are all on node 1
    pytest.param(
        Case(
            TWO_NODES,
            shape(1, 64 * MI, P2M, "shared"),
            taken=pages(P2M, 0, range(200)),
            budget=budgets(TWO_NODES),
            shared=(2, 6),
        ),
        Want((2, 6), (1,), pages(P2M, 1, range(32)), ((1, P2M, 32),)),
        id="shared-pages-on-a-node-of-its-cpus",
    ),
    pytest.param(
        Case(TWO_NODES, shape(2), housekeeping=(0,)),
        Want((1, 5), (0,), cpus(1, 5)),
        id="housekeeping-cpu-breaks-its-core",
    ),
    pytest.param(
        Case(TWO_NODES, shape(2), housekeeping=(0, 2), emulator="housekeeping"),
        Want((1, 5), (0,), cpus(1, 5), emulator=(0,)),
        id="emulator-on-housekeeping-cpu-of-the-node",
    ),
    pytest.param(
        Case(TWO_NODES, shape(2), ALL_8, cpus(1, 5), housekeeping=(0,), emulator="housekeeping"),
        Want((2, 6), (1,), cpus(2, 6), emulator=(0,)),
        id="emulator-on-any-housekeeping-cpu",
    ),
    pytest.param(
        Case(TWO_NODES, shape(2, policy="shared"), shared=(3, 7), housekeeping=(3,), emulator="housekeeping"),
        Want((3, 7), (1,), Claim(), emulator=(3,)),
        id="housekeeping-may-overlap-the-shared-pool",
    ),
    # -- 64 threads
    pytest.param(
        Case(HOST_64, shape(8), range(64)),
        Want((0, 32, 1, 33, 2, 34, 3, 35), (0,), cpus(0, 32, 1, 33, 2, 34, 3, 35)),
        id="64-threads-four-cores",
    ),
    # node 0 keeps 16 lone threads (their siblings are held): the fuller node still fits, so it is chosen
    pytest.param(
        Case(HOST_64, shape(2), range(64), cpus(*range(16))),
        Want((32, 33), (0,), cpus(32, 33)),
        id="64-threads-best-fit-takes-lone-threads",
    ),
    pytest.param(
        Case(HOST_64, shape(3, 4 * MI, P2M), range(8, 64), cpus(*range(16, 32)), budgets(HOST_64)),
        Want((48, 49, 50), (1,), cpus(48, 49, 50) + pages(P2M, 1, range(2)), ((1, P2M, 2),)),
        id="64-threads-lone-threads-best-fit",
    ),
]


@pytest.mark.parametrize(("case", "want"), PLACEMENTS)
def test_place(case: Case, want: Want) -> None:
    check(case.place(), want)


# -- NUMA policies -----------------------------------------------------------------------------------
HALF_FULL = cpus(0, 4, 2, 6)  # node 0 keeps core (1, 5), node 1 keeps core (3, 7)
TIGHT = budgets(TWO_NODES, node0_2M=10)  # node 0: 10 free 2Mi pages, node 1: 256

POLICIES = [
    # a VM that fits one node lands on one node under every aligned policy
    *(
        pytest.param(
            Case(TWO_NODES, shape(2), policy=p),
            Want((0, 4), (0,), cpus(0, 4)),
            id=f"{p}-one-node",
        )
        for p in ("single-numa-node", "restricted", "best-effort", "none")
    ),
    # 6 vCPUs cannot fit one 4-CPU node: restricted spans the fewest nodes its capacity allows
    pytest.param(
        Case(TWO_NODES, shape(6), policy="restricted"),
        Want((0, 4, 1, 5, 2, 6), (0, 1), cpus(0, 4, 1, 5, 2, 6)),
        id="restricted-spans-a-vm-bigger-than-a-node",
    ),
    pytest.param(
        Case(TWO_NODES, shape(6), policy="best-effort"),
        Want((0, 4, 1, 5, 2, 6), (0, 1), cpus(0, 4, 1, 5, 2, 6)),
        id="best-effort-spans-a-vm-bigger-than-a-node",
    ),
    # 3 vCPUs fit one node but no node has 3 free: best-effort and none spread, restricted refuses
    pytest.param(
        Case(TWO_NODES, shape(3), taken=HALF_FULL, policy="best-effort"),
        Want((1, 5, 3), (0, 1), cpus(1, 5, 3)),
        id="best-effort-spreads-when-fragmented",
    ),
    pytest.param(
        Case(TWO_NODES, shape(3), taken=HALF_FULL, policy="none"),
        Want((1, 5, 3), (0, 1), cpus(1, 5, 3)),
        id="none-spreads-when-fragmented",
    ),
    # pages: aligned policies keep them with the CPUs; none places CPUs first, then pages wherever they fit
    pytest.param(
        Case(TWO_NODES, shape(2, 64 * MI, P2M), budget=TIGHT, policy="best-effort"),
        Want((2, 6), (1,), cpus(2, 6) + pages(P2M, 1, range(32)), ((1, P2M, 32),)),
        id="best-effort-keeps-pages-with-cpus",
    ),
    pytest.param(
        Case(TWO_NODES, shape(2, 64 * MI, P2M), budget=TIGHT, policy="none"),
        Want((0, 4), (0, 1), cpus(0, 4) + pages(P2M, 1, range(32)), ((1, P2M, 32),)),
        id="none-places-pages-apart",
    ),
    pytest.param(
        Case(TWO_NODES, shape(2, 16 * MI, P2M), budget=TIGHT, policy="none"),
        Want((0, 4), (0,), cpus(0, 4) + pages(P2M, 0, range(8)), ((0, P2M, 8),)),
        id="none-prefers-pages-on-the-cpus-node",
    ),
    # spanning memory: one guest NUMA cell per host node, its vCPUs and its pages
    pytest.param(
        Case(TWO_NODES, shape(6, 768 * MI, P2M), budget=budgets(TWO_NODES), policy="restricted"),
        Want(
            (0, 4, 1, 5, 2, 6),
            (0, 1),
            cpus(0, 4, 1, 5, 2, 6) + pages(P2M, 0, range(256)) + pages(P2M, 1, range(128)),
            ((0, P2M, 256), (1, P2M, 128)),
            cells=(GuestCell(0, (0, 1, 2, 3), 256), GuestCell(1, (4, 5), 128)),
        ),
        id="restricted-cells-per-node",
    ),
    pytest.param(
        Case(TWO_NODES, shape(2, 768 * MI, P2M), budget=budgets(TWO_NODES), policy="best-effort"),
        Want(
            (0, 4),
            (0, 1),
            cpus(0, 4) + pages(P2M, 0, range(256)) + pages(P2M, 1, range(128)),
            ((0, P2M, 256), (1, P2M, 128)),
            cells=(GuestCell(0, (0, 1), 256), GuestCell(1, (), 128)),
        ),
        id="best-effort-memory-only-cell",
    ),
]


@pytest.mark.parametrize(("case", "want"), POLICIES)
def test_numa_policy(case: Case, want: Want) -> None:
    check(case.place(), want)


# -- devices: IOMMU groups ------------------------------------------------------------------------------
GPU_12 = pci("0000:3b:00.0", "0000:3b:00.1")
GPU_40 = pci("0000:af:00.0", "0000:af:00.1")
GPU_41 = pci("0000:d8:00.0")  # its group's bridge (0000:d7:00.0) stays with the host
VFIO_PAGES = budgets(VFIO)


def gpus(n: int = 0, *named: int) -> DeviceRequest:
    return DeviceRequest(named=tuple(named), counts=(("gpu", n),) if n else ())


def vfio(vm: VmShape, devices: DeviceRequest, policy: NumaPolicy = "single-numa-node", **kw: object) -> Case:
    return Case(VFIO, vm, ALL_8, budget=VFIO_PAGES, policy=policy, devices=devices, pools=VFIO_POOLS, **kw)  # type: ignore[arg-type]


DEVICES = [
    # node 0 has one GPU group, node 1 two: one GPU fits node 0 tightest
    pytest.param(vfio(shape(2), gpus(1)), Want((0, 4), (0,), cpus(0, 4) + GPU_12), id="whole-group-best-fit"),
    pytest.param(vfio(shape(2), gpus(2)), Want((2, 6), (1,), cpus(2, 6) + GPU_40 + GPU_41), id="two-groups-one-node"),
    pytest.param(
        vfio(shape(2), gpus(3), "best-effort"),
        Want((0, 4), (0,), cpus(0, 4) + GPU_12 + GPU_40 + GPU_41),
        id="best-effort-devices-across-nodes",
    ),
    pytest.param(vfio(shape(2), gpus(0, 40)), Want((2, 6), (1,), cpus(2, 6) + GPU_40), id="named-group-picks-node"),
    # the pod names group 40 and asks for 2 GPUs: group 40 counts as one of them
    pytest.param(
        vfio(shape(1), DeviceRequest(named=(40,), counts=(("gpu", 1),))),
        Want((2,), (1,), cpus(2) + GPU_40 + GPU_41),
        id="named-and-counted",
    ),
    pytest.param(
        vfio(shape(1), gpus(1), taken=GPU_12),
        Want((2,), (1,), cpus(2) + GPU_40),
        id="held-group-skipped",
    ),
    # a group without NUMA node fits any node; the CPUs go where they fit best
    pytest.param(
        vfio(shape(1), DeviceRequest(counts=(("accel", 1),)), taken=cpus(0, 4, 1)),
        Want((5,), (0,), cpus(5) + pci("0000:17:00.0")),
        id="unaffined-group",
    ),
    pytest.param(
        vfio(shape(1, policy="shared"), gpus(1), shared=(3, 7)),
        Want((3, 7), (1,), GPU_40),
        id="shared-pod-devices-on-its-cpus-node",
    ),
]


@pytest.mark.parametrize(("case", "want"), DEVICES)
def test_devices(case: Case, want: Want) -> None:
    p = case.place()
    check(p, want)
    assert all(g.group in VFIO_POOLS.by_group for g in p.devices)
    assert sorted(p.hostdevs) == list(p.claim.pci)


def test_partial_and_unselected_groups_are_never_handed_out() -> None:
    assert sorted(VFIO_POOLS.by_group) == [7, 12, 40, 41]
    assert VFIO_POOLS.pools["nic"] == ()
    with pytest.raises(CannotFit) as exc:
        vfio(shape(1), DeviceRequest(counts=(("nic", 1),)), "none").place()
    assert str(exc.value) == (
        "cannot place the VM: device pool nic on nodes 0-1: need 1 IOMMU groups, free 0 (short by 1); its pool "
        "there is only 0 IOMMU groups (device_pools.nic): waiting will not help"
    )


# -- refusals --------------------------------------------------------------------------------------------
SHORTFALLS = [
    pytest.param(
        Case(ONE_NODE, shape(3), ALL_2),
        (
            "cannot place the VM: cpu on node 0: need 3, free 2 (short by 1); its pool there is only 2 "
            "(exclusive CPUs: cpu_pool less shared_cpus and housekeeping_cpus): waiting will not help"
        ),
        id="cpus",
    ),
    pytest.param(
        Case(ONE_NODE, shape(2), (0,)),
        (
            "cannot place the VM: cpu on node 0: need 2, free 1 (short by 1); its pool there is only 1 "
            "(exclusive CPUs: cpu_pool less shared_cpus and housekeeping_cpus): waiting will not help"
        ),
        id="only-owned-cpus-count",
    ),
    pytest.param(
        Case(ONE_NODE, shape(1, 128 * MI, P2M), ALL_2, budget=budgets(ONE_NODE, node0_2M=10)),
        (
            "cannot place the VM: hugepages-2Mi on node 0: need 64 pages, free 10 (short by 54); its pool "
            "there is only 10 pages (what the host reserved, within the hugepages cap): waiting will not "
            "help"
        ),
        id="kernel-free-pages",
    ),
    pytest.param(
        Case(ONE_NODE, shape(1, 16 * MI, P2M), ALL_2, pages(P2M, 0, range(60)), budgets(ONE_NODE)),
        "cannot place the VM: hugepages-2Mi on node 0: need 8 pages, free 4 (short by 4)",
        id="budget-taken",
    ),
    pytest.param(
        Case(ONE_NODE, shape(1, GI, P1G), ALL_2),
        (
            "cannot place the VM: hugepages-1Gi on node 0: need 1 pages, free 0 (short by 1); its pool "
            "there is only 0 pages (what the host reserved, within the hugepages cap): waiting will not help"
        ),
        id="no-budget",
    ),
    pytest.param(
        Case(ONE_NODE, shape(4, 256 * MI, P2M), ALL_2, cpus(0)),
        (
            "cannot place the VM: cpu on node 0: need 4, free 1 (short by 3); its pool there is only 2 "
            "(exclusive CPUs: cpu_pool less shared_cpus and housekeeping_cpus): waiting will not help; "
            "hugepages-2Mi on node 0: need 128 pages, free 0 (short by 128); its pool there is only 0 pages "
            "(what the host reserved, within the hugepages cap): waiting will not help"
        ),
        id="cpus-and-pages",
    ),
    pytest.param(
        Case(TWO_NODES, shape(4), taken=cpus(0, 2)),
        "cannot place the VM: cpu on node 0: need 4, free 3 (short by 1); cpu on node 1: need 4, free 3 (short by 1)",
        id="no-single-node",
    ),
    pytest.param(
        Case(TWO_NODES, shape(1, 3 * GI, P1G), budget=budgets(TWO_NODES)),
        (
            "cannot place the VM: hugepages-1Gi on node 0: need 3 pages, free 2 (short by 1); its pool "
            "there is only 2 pages (what the host reserved, within the hugepages cap): waiting will not "
            "help; hugepages-1Gi on node 1: need 3 pages, free 1 (short by 2); its pool there is only 1 "
            "pages (what the host reserved, within the hugepages cap): waiting will not help"
        ),
        id="1Gi-pages-on-both-nodes",
    ),
    pytest.param(
        Case(ONE_NODE, shape(1), ()), "the shim owns no CPUs (check cpu_pool in its configuration)", id="owns-nothing"
    ),
    pytest.param(
        Case(ONE_NODE, shape(1, policy="shared"), ()),
        "the shim owns no CPUs (check cpu_pool in its configuration)",
        id="owns-nothing-shared",
    ),
    pytest.param(
        Case(ONE_NODE, shape(1, policy="shared"), ALL_2),
        "shared pods float over the shim's shared CPU pool, and none is configured "
        "(set shared_cpus, a subset of cpu_pool, in the shim's configuration)",
        id="no-shared-pool",
    ),
    pytest.param(
        Case(ONE_NODE, shape(1), ALL_2, shared=(0,), housekeeping=(1,)),
        "no CPU is left for exclusive pods: cpu_pool (0-1) minus shared_cpus and housekeeping_cpus is empty",
        id="no-exclusive-pool",
    ),
    pytest.param(
        Case(ONE_NODE, shape(1), ALL_2, emulator="housekeeping"),
        "the profile pins emulator threads to housekeeping CPUs, and none are configured "
        "(set housekeeping_cpus, a subset of cpu_pool, in the shim's configuration)",
        id="no-housekeeping-cpus",
    ),
    pytest.param(
        Case(TWO_NODES, shape(5), shared=(2, 3, 6, 7)),
        (
            "cannot place the VM: cpu on node 0: need 5, free 4 (short by 1); its pool there is only 4 "
            "(exclusive CPUs: cpu_pool less shared_cpus and housekeeping_cpus): waiting will not help; cpu "
            "on node 1: need 5, free 0 (short by 5); its pool there is only 0 (exclusive CPUs: cpu_pool "
            "less shared_cpus and housekeeping_cpus): waiting will not help"
        ),
        id="shared-pool-is-not-exclusive",
    ),
    pytest.param(
        Case(TWO_NODES, shape(1, 64 * MI, P2M, "shared"), budget=TIGHT, shared=(0, 4)),
        (
            "cannot place the VM: hugepages-2Mi on node 0: need 32 pages, free 10 (short by 22); its pool "
            "there is only 10 pages (what the host reserved, within the hugepages cap): waiting will not "
            "help"
        ),
        id="shared-pages-only-on-shared-nodes",
    ),
    # -- NUMA policies
    pytest.param(
        Case(TWO_NODES, shape(6)),
        (
            "cannot place the VM: cpu on node 0: need 6, free 4 (short by 2); its pool there is only 4 "
            "(exclusive CPUs: cpu_pool less shared_cpus and housekeeping_cpus): waiting will not help; cpu "
            "on node 1: need 6, free 4 (short by 2); its pool there is only 4 (exclusive CPUs: cpu_pool "
            "less shared_cpus and housekeeping_cpus): waiting will not help"
        ),
        id="single-numa-node-refuses-a-vm-bigger-than-a-node",
    ),
    pytest.param(
        Case(TWO_NODES, shape(3), taken=HALF_FULL, policy="restricted"),
        "cannot place the VM: cpu on node 0: need 3, free 2 (short by 1); cpu on node 1: need 3, free 2 (short by 1) "
        "(numa_policy restricted: one NUMA node can hold it, so it is not spread over several)",
        id="restricted-does-not-spread-what-fits-one-node",
    ),
    pytest.param(
        Case(TWO_NODES, shape(8), taken=cpus(0), policy="restricted"),
        "cannot place the VM: numa_policy restricted: it needs 2 NUMA nodes and no 2 have it free together: "
        "cpu on nodes 0-1: need 8, free 7 (short by 1)",
        id="restricted-needs-the-nodes-free-together",
    ),
    pytest.param(
        Case(TWO_NODES, shape(9), policy="best-effort"),
        (
            "cannot place the VM: cpu on nodes 0-1: need 9, free 8 (short by 1); its pool there is only 8 "
            "(exclusive CPUs: cpu_pool less shared_cpus and housekeeping_cpus): waiting will not help"
        ),
        id="best-effort-host-too-small",
    ),
    pytest.param(
        Case(TWO_NODES, shape(9), policy="restricted"),
        (
            "cannot place the VM: cpu on nodes 0-1: need 9, free 8 (short by 1); its pool there is only 8 "
            "(exclusive CPUs: cpu_pool less shared_cpus and housekeeping_cpus): waiting will not help"
        ),
        id="restricted-host-too-small",
    ),
    pytest.param(
        Case(TWO_NODES, shape(9), policy="none"),
        (
            "cannot place the VM: cpu on nodes 0-1: need 9, free 8 (short by 1); its pool there is only 8 "
            "(exclusive CPUs: cpu_pool less shared_cpus and housekeeping_cpus): waiting will not help"
        ),
        id="none-host-too-small",
    ),
    # -- devices
    pytest.param(
        vfio(shape(1), gpus(3)),
        (
            "cannot place the VM: device pool gpu on node 0: need 3 IOMMU groups, free 1 (short by 2); its "
            "pool there is only 1 IOMMU groups (device_pools.gpu): waiting will not help; device pool gpu "
            "on node 1: need 3 IOMMU groups, free 2 (short by 1); its pool there is only 2 IOMMU groups "
            "(device_pools.gpu): waiting will not help"
        ),
        id="gpus-on-no-single-node",
    ),
    pytest.param(
        vfio(shape(1), gpus(0, 12, 40)),
        "cannot place the VM: IOMMU group 40 (pool gpu) is on node 1, not node 0; "
        "IOMMU group 12 (pool gpu) is on node 0, not node 1",
        id="named-groups-on-two-nodes",
    ),
    pytest.param(
        vfio(shape(4), gpus(0, 40), taken=cpus(2)),
        "cannot place the VM: IOMMU group 40 (pool gpu) is on node 1, not node 0; "
        "cpu on node 1: need 4, free 3 (short by 1)",
        id="named-group-node-too-full",
    ),
    pytest.param(
        vfio(shape(1), gpus(0, 40), taken=GPU_40),
        "IOMMU group 40 (0000:af:00.0 10de:2330 + 1 more, pool gpu, node 1) is held by another sandbox",
        id="named-group-held",
    ),
    pytest.param(
        vfio(shape(1), gpus(0, 30)),
        "IOMMU group 30 is in no configured device pool on this host",
        id="named-group-not-in-a-pool",
    ),
    pytest.param(
        vfio(shape(1), gpus(1), taken=GPU_12 + GPU_40 + GPU_41, policy="best-effort"),
        "cannot place the VM: device pool gpu on nodes 0-1: need 1 IOMMU groups, free 0 (short by 1)",
        id="pool-exhausted",
    ),
]


@pytest.mark.parametrize(("case", "message"), SHORTFALLS)
def test_place_shortfall(case: Case, message: str) -> None:
    with pytest.raises(CannotFit) as exc:
        case.place()
    assert str(exc.value) == message


@pytest.mark.parametrize(
    ("shared", "housekeeping", "message"),
    [
        pytest.param((8,), (), "shared_cpus (8) must be a subset of cpu_pool (0-7): 8 is not in it", id="shared"),
        pytest.param(
            (), (6, 9, 10), "housekeeping_cpus (6,9-10) must be a subset of cpu_pool (0-7): 9-10 is not in it", id="hk"
        ),
    ],
)
def test_pools_must_be_owned(shared: tuple[int, ...], housekeeping: tuple[int, ...], message: str) -> None:
    with pytest.raises(InvalidArgument) as exc:
        host_pools(TWO_NODES, ALL_8, shared_cpus=shared, housekeeping_cpus=housekeeping)
    assert str(exc.value) == message


def test_free_state_ignores_what_it_does_not_own() -> None:
    pools = host_pools(TWO_NODES, (0, 1, 4, 5), budgets={(0, P2M): HugepageBudget(0, P2M, 4, 4)})
    foreign = Claim.of(cpus=(2,), pci=("0000:00:00.0",), pages=[(1, P2M, 3), (0, P1G, 1)])
    assert FreeState.from_claims(pools, [foreign]).snapshot() == FreeState(pools).snapshot()
    state = FreeState.from_claims(pools, [Claim.of(cpus=(0,), pages=[(0, P2M, 2)])])
    assert state.lone[0] == [4] and state.full[0] == {2: [1]} and state.ncpu[0] == 3
    assert state.npages[(0, P2M)] == 2
    # held beyond the budget (the configuration shrank): nothing is handed out until enough is released
    over = FreeState.from_claims(pools, [Claim.of(pages=[(0, P2M, 3)]), Claim.of(pages=[(0, P2M, 3)])])
    assert over.npages[(0, P2M)] == -2 and over.usable_pages(0, P2M) == 0


def test_claim_of_a_placement() -> None:
    p = Placement(cpus=(3, 1), nodes=(1,), hugepages=((1, P2M, 3),), exclusive=True)
    assert p.claim == Claim(cpus=(1, 3), pages=((1, P2M, 3),))
    assert replace(p, exclusive=False).claim == Claim(pages=((1, P2M, 3),))
    assert (cpus(1) + pages(P2M, 0, range(2)) + pages(P2M, 0, range(3))).pages == ((0, P2M, 5),)


# -- properties: claim / release on every fixture host ---------------------------------------------------
def _fixture(name: str) -> HostInventory:
    return read_inventory(FIXTURES / name / "sys", FIXTURES / name / "proc")


@dataclass(frozen=True)
class Host:
    name: str
    pools: HostPools
    shapes: tuple[tuple[VmShape, DeviceRequest], ...]


def _host(
    name: str,
    inv: HostInventory,
    shared: tuple[int, ...] = (),
    housekeeping: tuple[int, ...] = (),
    devices: DevicePools = NO_POOLS,
    page_cap: int = 64,
) -> Host:
    budget = {k: replace(b, pages=min(b.pages, page_cap)) for k, b in budgets(inv).items()}
    pools = host_pools(
        inv,
        [c.id for c in inv.cpus],
        shared_cpus=shared,
        housekeeping_cpus=housekeeping,
        budgets=budget,
        devices=devices,
        memory={n: 512 * MI for n in inv.nodes},
    )
    vms: list[tuple[VmShape, DeviceRequest]] = [
        (shape(1), NO_DEVICES),
        (shape(2), NO_DEVICES),
        (shape(3), NO_DEVICES),
        (shape(5), NO_DEVICES),
        (shape(1, 8 * MI, P2M), NO_DEVICES),
        (shape(2, 64 * MI, P2M), NO_DEVICES),
        (shape(4, 160 * MI, P2M), NO_DEVICES),
        (shape(1, GI, P1G), NO_DEVICES),
    ]
    if shared:
        vms += [(shape(2, 32 * MI, P2M, "shared"), NO_DEVICES), (shape(4, policy="shared"), NO_DEVICES)]
    if devices.pools:
        vms += [(shape(1), gpus(1)), (shape(2), gpus(2)), (shape(1), gpus(0, 40)), (shape(1, policy="shared"), gpus(1))]
        vms += [(shape(1), DeviceRequest(counts=(("accel", 1),)))]
    return Host(name, pools, tuple(vms))


HOSTS = [
    _host("one-node-2cpu", _fixture("one-node-2cpu"), shared=(1,)),
    _host("two-socket-64-thread", _fixture("two-socket-64-thread"), (30, 31, 62, 63), (0, 32), page_cap=200),
    _host("no-numa-4cpu-smt", _fixture("no-numa-4cpu-smt")),
    _host("vfio-two-node", VFIO, (3, 7), (7,), VFIO_POOLS),
    _host("two-nodes-no-pools", TWO_NODES),
]
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("place"), st.integers(0, 30), st.sampled_from(["single-numa-node", "restricted"])),
        st.tuples(st.just("place"), st.integers(0, 30), st.sampled_from(["best-effort", "none"])),
        st.tuples(st.just("release"), st.integers(0, 30), st.just("")),
    ),
    max_size=30,
)


def _check_placement(host: Host, vm: VmShape, p: Placement) -> None:
    pools = host.pools
    if vm.cpu_policy == "exclusive":
        assert len(p.cpus) == vm.vcpus and set(p.cpus) <= pools.exclusive_cpus
    else:
        assert p.cpus == pools.shared_cpus and not p.claim.cpus
        assert {n for n, _, _ in p.hugepages} <= set(pools.shared_nodes)  # pages on a node of its CPUs
    assert sum(n for _, _, n in p.hugepages) == vm.backing_pages
    if not vm.hugepage_backed:
        assert sum(b for _, b in p.memory) == vm.memory_bytes
    for g in p.devices:  # whole groups
        assert g.addresses == pools.devices.by_group[g.group].addresses


def _check_held(pools: HostPools, held: list[Claim]) -> None:
    """Nothing held twice: CPUs and PCI functions by one claim at most, amounts within their pools."""
    cpu_list = [c for h in held for c in h.cpus]
    pci_list = [a for h in held for a in h.pci]
    assert len(cpu_list) == len(set(cpu_list)) and set(cpu_list) <= pools.exclusive_cpus
    assert len(pci_list) == len(set(pci_list))
    total = sum(held, Claim())
    for node, size, count in total.pages:
        assert count <= pools.budgets[(node, size)].pages
    for node, amount in total.memory:
        assert amount <= pools.memory_capacity[node]


@settings(max_examples=200, deadline=None)
@given(host=st.sampled_from(HOSTS), ops=OPS)
def test_free_state_round_trips(host: Host, ops: list[tuple[str, int, str]]) -> None:
    """Placing and releasing in any order: the free state kept in place equals the one rebuilt from
    the held claims, nothing is held twice, and the same decision comes from either."""
    pools = host.pools
    state = FreeState(pools)
    initial = state.snapshot()
    live: list[Placement] = []

    def attempt(vm: VmShape, req: DeviceRequest, policy: str, s: FreeState) -> Placement | str:
        try:
            return decide(vm, pools, s, policy=policy, devices=req)  # type: ignore[arg-type]
        except CannotFit as exc:
            return str(exc)

    first = [attempt(vm, req, "best-effort", FreeState(pools)) for vm, req in host.shapes]
    for op, arg, policy in ops:
        if op == "place":
            vm, req = host.shapes[arg % len(host.shapes)]
            rebuilt = FreeState.from_claims(pools, [p.claim for p in live])
            assert rebuilt.snapshot() == state.snapshot()
            p = attempt(vm, req, policy, state)
            assert p == attempt(vm, req, policy, rebuilt)  # same decision either way
            if isinstance(p, str):
                continue
            _check_placement(host, vm, p)
            state.take(p)
            live.append(p)
            _check_held(pools, [q.claim for q in live])
        elif live:
            state.release(live.pop(arg % len(live)))
        assert FreeState.from_claims(pools, [p.claim for p in live]).snapshot() == state.snapshot()
    for p in live:
        state.release(p)
    assert state.snapshot() == initial
    # everything is free again: every shape lands exactly where it would on a fresh host
    assert [attempt(vm, req, "best-effort", state) for vm, req in host.shapes] == first
