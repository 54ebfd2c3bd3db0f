"""Tests of vmsandbox.placement: whole cores, best-fit NUMA node, hugepage budgets, shortfall messages."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vmsandbox.errors import CannotFit
from vmsandbox.host import HostCpu, HostInventory, HugepagePool
from vmsandbox.ledger import Ledger
from vmsandbox.placement import HugepageBudget, Placement, cpu_key, page_key, place
from vmsandbox.sizing import PodDemand, VmShape

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


def budgets(inv: HostInventory, **free: int) -> dict[tuple[int, int], HugepageBudget]:
    """Every pool fully in the shim's budget; ``node0_2M=10`` overrides the kernel's free count."""
    out = {}
    for p in inv.hugepages:
        label = f"node{p.node}_{'1G' if p.page_size == P1G else '2M'}"
        out[(p.node, p.page_size)] = HugepageBudget(p.node, p.page_size, p.total, free.get(label, p.free))
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


def cpus(*ids: int) -> tuple[str, ...]:
    return tuple(cpu_key(i) for i in ids)


def pages(size: int, node: int, indices: range) -> tuple[str, ...]:
    return tuple(page_key(size, node, i) for i in indices)


ALL_2 = (0, 1)
ALL_8 = tuple(range(8))

PLACEMENTS = [
    # (inventory, owned, taken, budgets, shape, expected)
    pytest.param(ONE_NODE, ALL_2, (), {}, shape(1), Placement((0,), (0,), cpus(0)), id="one-cpu"),
    pytest.param(ONE_NODE, ALL_2, cpus(0), {}, shape(1), Placement((1,), (0,), cpus(1)), id="next-free-cpu"),
    pytest.param(
        ONE_NODE,
        ALL_2,
        (),
        budgets(ONE_NODE),
        shape(2, 128 * MI, P2M),
        Placement((0, 1), (0,), cpus(0, 1) + pages(P2M, 0, range(64)), ((0, P2M, 64),)),
        id="whole-host-with-2Mi-pages",
    ),
    pytest.param(
        ONE_NODE,
        ALL_2,
        pages(P2M, 0, range(0, 64, 2)),
        budgets(ONE_NODE),
        shape(1, 32 * MI, P2M),
        Placement((0,), (0,), cpus(0) + pages(P2M, 0, range(1, 33, 2)), ((0, P2M, 16),)),
        id="pages-skip-taken-keys",
    ),
    pytest.param(TWO_NODES, ALL_8, (), {}, shape(2), Placement((0, 4), (0,), cpus(0, 4)), id="siblings-together"),
    pytest.param(
        TWO_NODES, ALL_8, (), {}, shape(3), Placement((0, 4, 1), (0,), cpus(0, 4, 1)), id="whole-core-then-a-thread"
    ),
    pytest.param(
        TWO_NODES, ALL_8, (), {}, shape(4), Placement((0, 4, 1, 5), (0,), cpus(0, 4, 1, 5)), id="two-whole-cores"
    ),
    pytest.param(
        TWO_NODES, ALL_8, cpus(0), {}, shape(1), Placement((4,), (0,), cpus(4)), id="lone-thread-before-breaking-a-core"
    ),
    # node 0 has 3 free CPUs, node 1 has 4: the fuller node that still fits wins
    pytest.param(TWO_NODES, ALL_8, cpus(0), {}, shape(2), Placement((1, 5), (0,), cpus(1, 5)), id="best-fit-node"),
    pytest.param(
        TWO_NODES, ALL_8, cpus(0, 1), {}, shape(3), Placement((2, 6, 3), (1,), cpus(2, 6, 3)), id="only-node-that-fits"
    ),
    pytest.param(TWO_NODES, (2, 3, 6, 7), (), {}, shape(2), Placement((2, 6), (1,), cpus(2, 6)), id="owned-subset"),
    pytest.param(TWO_NODES, (1, 5, 6), (), {}, shape(2), Placement((1, 5), (0,), cpus(1, 5)), id="owned-whole-core"),
    pytest.param(
        TWO_NODES,
        ALL_8,
        (),
        budgets(TWO_NODES, node0_2M=10),
        shape(2, 64 * MI, P2M),
        Placement((2, 6), (1,), cpus(2, 6) + pages(P2M, 1, range(32)), ((1, P2M, 32),)),
        id="kernel-free-pages-limit-the-budget",
    ),
    pytest.param(
        TWO_NODES,
        ALL_8,
        (),
        budgets(TWO_NODES),
        shape(2, GI, P1G),
        Placement((0, 4), (0,), cpus(0, 4) + pages(P1G, 0, range(1)), ((0, P1G, 1),)),
        id="1Gi-tie-on-cpus-lowest-node",
    ),
    pytest.param(
        TWO_NODES,
        ALL_8,
        (),
        budgets(TWO_NODES),
        shape(2, 2 * GI, P1G),
        Placement((0, 4), (0,), cpus(0, 4) + pages(P1G, 0, range(2)), ((0, P1G, 2),)),
        id="1Gi-only-node-with-two-free",
    ),
    pytest.param(
        TWO_NODES,
        ALL_8,
        cpus(0, 4),
        {},
        shape(4, policy="shared"),
        Placement((1, 2, 3, 5, 6, 7), (0,), ()),
        id="shared-floats-over-unclaimed-cpus",
    ),
    pytest.param(
        ONE_NODE,
        ALL_2,
        (),
        budgets(ONE_NODE),
        shape(4, 16 * MI, P2M, "shared"),
        Placement((0, 1), (0,), pages(P2M, 0, range(8)), ((0, P2M, 8),)),
        id="shared-claims-only-pages",
    ),
    pytest.param(
        HOST_64,
        range(64),
        (),
        {},
        shape(8),
        Placement((0, 32, 1, 33, 2, 34, 3, 35), (0,), cpus(0, 32, 1, 33, 2, 34, 3, 35)),
        id="64-threads-four-cores",
    ),
    # node 0 keeps 16 lone threads (their siblings are held): the fuller node still fits, so it is chosen
    pytest.param(
        HOST_64,
        range(64),
        cpus(*range(16)),
        {},
        shape(2),
        Placement((32, 33), (0,), cpus(32, 33)),
        id="64-threads-best-fit-takes-lone-threads",
    ),
    pytest.param(
        HOST_64,
        range(8, 64),
        cpus(*range(16, 32)),
        budgets(HOST_64),
        shape(3, 4 * MI, P2M),
        Placement((48, 49, 50), (1,), cpus(48, 49, 50) + pages(P2M, 1, range(2)), ((1, P2M, 2),)),
        id="64-threads-lone-threads-best-fit",
    ),
]


@pytest.mark.parametrize(("inv", "owned", "taken", "budget", "vm", "expected"), PLACEMENTS)
def test_place(
    inv: HostInventory,
    owned: tuple[int, ...],
    taken: tuple[str, ...],
    budget: dict[tuple[int, int], HugepageBudget],
    vm: VmShape,
    expected: Placement,
) -> None:
    assert place(vm, inv, owned, frozenset(taken), budget) == expected


SHORTFALLS = [
    pytest.param(
        ONE_NODE, ALL_2, (), {}, shape(3), "cannot place the VM: cpu on node 0: need 3, free 2 (short by 1)", id="cpus"
    ),
    pytest.param(
        ONE_NODE,
        (0,),
        (),
        {},
        shape(2),
        "cannot place the VM: cpu on node 0: need 2, free 1 (short by 1)",
        id="only-owned-cpus-count",
    ),
    pytest.param(
        ONE_NODE,
        ALL_2,
        (),
        budgets(ONE_NODE, node0_2M=10),
        shape(1, 128 * MI, P2M),
        "cannot place the VM: hugepages-2Mi on node 0: need 64 pages, free 10 (short by 54)",
        id="kernel-free-pages",
    ),
    pytest.param(
        ONE_NODE,
        ALL_2,
        pages(P2M, 0, range(60)),
        budgets(ONE_NODE),
        shape(1, 16 * MI, P2M),
        "cannot place the VM: hugepages-2Mi on node 0: need 8 pages, free 4 (short by 4)",
        id="budget-taken",
    ),
    pytest.param(
        ONE_NODE,
        ALL_2,
        (),
        {},
        shape(1, GI, P1G),
        "cannot place the VM: hugepages-1Gi on node 0: need 1 pages, free 0 (short by 1)",
        id="no-budget",
    ),
    pytest.param(
        ONE_NODE,
        ALL_2,
        cpus(0),
        {},
        shape(4, 256 * MI, P2M),
        "cannot place the VM: cpu on node 0: need 4, free 1 (short by 3); "
        "hugepages-2Mi on node 0: need 128 pages, free 0 (short by 128)",
        id="cpus-and-pages",
    ),
    pytest.param(
        TWO_NODES,
        ALL_8,
        cpus(0, 2),
        {},
        shape(4),
        "cannot place the VM: cpu on node 0: need 4, free 3 (short by 1); cpu on node 1: need 4, free 3 (short by 1)",
        id="no-single-node",
    ),
    pytest.param(
        TWO_NODES,
        ALL_8,
        (),
        budgets(TWO_NODES),
        shape(1, 3 * GI, P1G),
        "cannot place the VM: hugepages-1Gi on node 0: need 3 pages, free 2 (short by 1); "
        "hugepages-1Gi on node 1: need 3 pages, free 1 (short by 2)",
        id="1Gi-pages-on-both-nodes",
    ),
    pytest.param(
        ONE_NODE, (), (), {}, shape(1), "the shim owns no CPUs (check cpu_pool in its configuration)", id="owns-nothing"
    ),
    pytest.param(
        ONE_NODE,
        (),
        (),
        {},
        shape(1, policy="shared"),
        "the shim owns no CPUs (check cpu_pool in its configuration)",
        id="owns-nothing-shared",
    ),
    pytest.param(
        ONE_NODE,
        ALL_2,
        cpus(0, 1),
        {},
        shape(1, policy="shared"),
        "no shared CPU left: every owned CPU (0-1) is held exclusively",
        id="shared-pool-empty",
    ),
]


@pytest.mark.parametrize(("inv", "owned", "taken", "budget", "vm", "message"), SHORTFALLS)
def test_place_shortfall(
    inv: HostInventory,
    owned: tuple[int, ...],
    taken: tuple[str, ...],
    budget: dict[tuple[int, int], HugepageBudget],
    vm: VmShape,
    message: str,
) -> None:
    with pytest.raises(CannotFit) as exc:
        place(vm, inv, owned, frozenset(taken), budget)
    assert str(exc.value) == message


@pytest.mark.parametrize(
    ("size", "node", "index", "key"),
    [
        pytest.param(P2M, 0, 17, "hugepages-2048kB:node0:17", id="2Mi"),
        pytest.param(P1G, 1, 0, "hugepages-1048576kB:node1:0", id="1Gi"),
    ],
)
def test_page_key(size: int, node: int, index: int, key: str) -> None:
    assert page_key(size, node, index) == key


# -- property: place + claim / release on a real ledger ------------------------------------------
SHAPES = [
    shape(1),
    shape(2),
    shape(3),
    shape(1, 8 * MI, P2M),
    shape(2, 64 * MI, P2M),
    shape(1, GI, P1G),
    shape(2, 32 * MI, P2M, "shared"),
    shape(4, policy="shared"),
]
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("place"), st.sampled_from(range(len(SHAPES)))),
        st.tuples(st.just("release"), st.integers(0, 20)),
    ),
    max_size=25,
)
_db_names = itertools.count()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, owned=st.sampled_from([ALL_8, (0, 1, 2, 4, 5, 6), (1, 3, 5, 7)]))
def test_never_hands_out_a_key_twice(tmp_path: Path, ops: list[tuple[str, int]], owned: tuple[int, ...]) -> None:
    # 32 x 2Mi per node; 1Gi: 2 pages per node, of which the kernel has 2 (node 0) and 1 (node 1) free
    budget = {
        k: HugepageBudget(b.node, b.page_size, min(b.pages, 32), b.host_free) for k, b in budgets(TWO_NODES).items()
    }
    universe = {cpu_key(c) for c in owned} | {
        page_key(b.page_size, b.node, i) for b in budget.values() for i in range(b.pages)
    }
    ledger = Ledger(tmp_path / f"ledger-{next(_db_names)}.db")
    initial = [_try_place(vm, owned, frozenset(), budget) for vm in SHAPES]
    try:
        live: dict[str, Placement] = {}
        serial = itertools.count()
        for op, arg in ops:
            if op == "place":
                taken = ledger.taken()
                try:
                    p = place(SHAPES[arg], TWO_NODES, owned, taken, budget)
                except CannotFit:
                    continue
                assert not set(p.claims) & taken
                assert set(p.claims) <= universe
                assert len(set(p.claims)) == len(p.claims)
                sid = f"sb{next(serial)}"
                ledger.claim(sid, p.claims)
                live[sid] = p
            elif live:
                sid = sorted(live)[arg % len(live)]
                assert ledger.release(sid) == len(live.pop(sid).claims)
            held = [k for sid in live for k in ledger.claims_of(sid)]
            assert len(held) == len(set(held))
            assert ledger.taken() == frozenset(held) == frozenset(k for p in live.values() for k in p.claims)
            exclusive = [c for p in live.values() for c in p.cpus if cpu_key(c) in p.claims]
            assert len(exclusive) == len(set(exclusive))
        for sid in list(live):
            ledger.release(sid)
        assert ledger.taken() == frozenset()
        assert ledger.claim_owners() == frozenset()
        # everything is free again: every shape lands exactly where it would on a fresh host
        assert [_try_place(vm, owned, ledger.taken(), budget) for vm in SHAPES] == initial
    finally:
        ledger.close()


def _try_place(
    vm: VmShape, owned: tuple[int, ...], taken: frozenset[str], budget: dict[tuple[int, int], HugepageBudget]
) -> Placement | str:
    try:
        return place(vm, TWO_NODES, owned, taken, budget)
    except CannotFit as exc:
        return str(exc)
