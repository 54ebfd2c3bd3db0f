"""Tests of shim.host_resources.ResourceManager: reserve/release/rebuild against a real sqlite ledger, threads
and a second process racing for the same host, ordinary memory per NUMA node, packing policies."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shim.config import ANY_NODE, ShimConfig, config_from_mapping
from shim.host_resources import ResourceManager
from vmsandbox.adapters.ledger import Ledger
from vmsandbox.adapters.sysfs import read_inventory
from vmsandbox.claims import Claim
from vmsandbox.errors import CannotFit, InvalidArgument
from vmsandbox.host import HostCpu, HostInventory, HugepagePool
from vmsandbox.host_pools import FreeState, HugepageBudget, host_pools
from vmsandbox.placement import Packing, decide
from vmsandbox.profile import Profile
from vmsandbox.sizing import PodDemand, VmShape

FIXTURES = Path(__file__).parents[1] / "fixtures" / "sysfs"
MI, GI = 1 << 20, 1 << 30
P2M = 2 * MI
ONE_NODE = read_inventory(FIXTURES / "one-node-2cpu" / "sys", FIXTURES / "one-node-2cpu" / "proc")
_TWO_SOCKET = read_inventory(FIXTURES / "two-socket-64-thread" / "sys", FIXTURES / "two-socket-64-thread" / "proc")
#: the two-socket fixture with every page free: a fixture's kernel counts do not move when a guest
#: "starts", so budgets computed at two different opens agree only when nothing is used by others
TWO_SOCKET = replace(_TWO_SOCKET, hugepages=tuple(replace(p, free=p.total) for p in _TWO_SOCKET.hugepages))
PROFILE = Profile(name="p", handler="vmsandbox")
BEST_EFFORT = Profile(name="b", handler="vmsandbox", numa_policy="best-effort")
TWO_SOCKET_CONFIG = ShimConfig(shared_cpus=(30, 31, 62, 63), housekeeping_cpus=(0, 32))


def shape(vcpus: int, memory: int = 128 * MI, page: int = P2M, policy: str = "exclusive") -> VmShape:
    return VmShape(vcpus, memory, page, (), policy, PodDemand(vcpus * 1000, memory))  # type: ignore[arg-type]


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    db = Ledger(tmp_path / "state.db")
    yield db
    db.close()


def _check_nothing_twice(manager: ResourceManager, held: dict[str, Claim]) -> None:
    cpus = [c for claim in held.values() for c in claim.cpus]
    assert len(cpus) == len(set(cpus)) and set(cpus) <= manager.pools.exclusive_cpus
    total = sum(held.values(), Claim())
    for node, size, count in total.pages:
        assert count <= manager.pools.budgets[(node, size)].pages
    for node, amount in total.memory:
        assert amount <= manager.pools.memory_capacity[node]


# -- reserve, release, rebuild ----------------------------------------------------------------------
def test_reserve_release_and_rebuild_from_the_ledger(ledger: Ledger) -> None:
    manager = ResourceManager.open(TWO_SOCKET_CONFIG, TWO_SOCKET, ledger)
    empty = manager.snapshot()
    a = manager.reserve("a", shape(4, 512 * MI), PROFILE)
    b = manager.reserve("b", shape(2, GI, GI), PROFILE)
    c = manager.reserve("c", shape(2, 3 * GI, 4096), PROFILE)  # ordinary memory
    assert ledger.held() == {"a": a.claim, "b": b.claim, "c": c.claim}
    assert c.memory == ((c.nodes[0], 3 * GI),) and c.claim.memory == c.memory
    assert manager.owners() == {"a", "b", "c"} and manager.held("b") == b.claim
    # a restart: the free state rebuilt from the ledger is the one kept in place
    again = ResourceManager.open(TWO_SOCKET_CONFIG, TWO_SOCKET, ledger)
    assert again.snapshot() == manager.snapshot() != empty
    assert again.owners() == {"a", "b", "c"}
    # the same next decision either way
    assert again.place(shape(3), PROFILE) == manager.place(shape(3), PROFILE)
    assert manager.release("a") == 5  # 4 CPUs and one page amount
    assert manager.release("a") == 0 and manager.release("unknown") == 0
    assert ledger.held() == {"b": b.claim, "c": c.claim}
    manager.release("b")
    manager.release("c")
    assert manager.snapshot() == empty and ledger.held() == {}
    assert all(u.held == 0 for u in manager.usage())


def test_usage_per_node(ledger: Ledger) -> None:
    manager = ResourceManager.open(ShimConfig(), ONE_NODE, ledger)
    manager.reserve("a", shape(1, 32 * MI), PROFILE)
    manager.reserve("b", shape(1, GI, 4096), PROFILE)
    # 8Gi MemTotal - 64 x 2Mi pages - 1Gi reserved; 60 of the 64 pages are free in the fixture
    assert [(u.node, u.resource, u.capacity, u.held) for u in manager.usage()] == [
        (0, "cpu", 2, 2),
        (0, "hugepages-2Mi", 60, 16),
        (0, "hugepages-1Gi", 0, 0),
        (0, "memory", 8 * GI - 128 * MI - GI, GI),
    ]


def test_pages_used_by_others_stay_out_of_the_budget(ledger: Ledger) -> None:
    """The kernel's used pages beyond the shim's own claims belong to someone else: not handed out."""
    inv = HostInventory(cpus=(HostCpu(0), HostCpu(1, core=1)), hugepages=(HugepagePool(0, P2M, 100, 70),))
    ledger.claim("ours", Claim(pages=((0, P2M, 20),)), page_limits={(0, P2M): 100}, memory_limits={})
    manager = ResourceManager.open(ShimConfig(), inv, ledger)
    assert manager.pools.budgets[(0, P2M)].pages == 90  # 30 used: 20 ours, 10 someone else's
    with pytest.raises(CannotFit, match=r"need 71 pages, free 70 \(short by 1\)"):
        manager.reserve("x", shape(1, 142 * MI), PROFILE)
    manager.reserve("x", shape(1, 140 * MI), PROFILE)


def test_read_only_manager_places_but_never_reserves() -> None:
    held = {"a": Claim(cpus=(0,))}
    manager = ResourceManager.open(ShimConfig(), ONE_NODE, held=held)
    assert manager.place(shape(1, 32 * MI), PROFILE).cpus == (1,)
    with pytest.raises(RuntimeError, match="read-only"):
        manager.reserve("b", shape(1, 32 * MI), PROFILE)


def test_another_process_claiming_meanwhile_is_caught_by_the_ledger(tmp_path: Path) -> None:
    """Two managers on one state database (two shims by mistake): the second one's stale free state
    offers CPUs the first holds; the ledger refuses, it re-reads the ledger and places elsewhere."""
    a_db, b_db = Ledger(tmp_path / "state.db"), Ledger(tmp_path / "state.db")
    try:
        a = ResourceManager.open(TWO_SOCKET_CONFIG, TWO_SOCKET, a_db)
        b = ResourceManager.open(TWO_SOCKET_CONFIG, TWO_SOCKET, b_db)
        first = a.reserve("a", shape(2, 64 * MI), PROFILE)
        assert b.place(shape(2, 64 * MI), PROFILE).cpus == first.cpus  # b does not know yet
        second = b.reserve("b", shape(2, 64 * MI), PROFILE)
        assert set(second.cpus).isdisjoint(first.cpus)
        assert b_db.held() == {"a": first.claim, "b": second.claim}
        _check_nothing_twice(b, b_db.held())
    finally:
        a_db.close()
        b_db.close()


SHAPES = [
    shape(1, 64 * MI),
    shape(2, 256 * MI),
    shape(4, 512 * MI),
    shape(8, 1024 * MI),
    shape(1, GI, GI),
    shape(2, 2 * GI, 4096),
    shape(2, 64 * MI, P2M, "shared"),
]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    plans=st.lists(
        st.lists(st.tuples(st.integers(0, len(SHAPES) - 1), st.booleans()), min_size=1, max_size=25),
        min_size=2,
        max_size=6,
    )
)
def test_threads_never_get_the_same_resource(tmp_path: Path, plans: list[list[tuple[int, bool]]]) -> None:
    """Several threads reserve (and sometimes release) at once: every moment's claims are disjoint and
    within their pools, and the free state at the end is the one rebuilt from the ledger."""
    db = Ledger(tmp_path / f"threads-{random.getrandbits(64):016x}.db")
    try:
        manager = ResourceManager.open(TWO_SOCKET_CONFIG, TWO_SOCKET, db)
        empty = manager.snapshot()
        errors: list[BaseException] = []
        start = threading.Barrier(len(plans))

        def worker(t: int, plan: list[tuple[int, bool]]) -> None:
            try:
                start.wait()
                for i, (which, release) in enumerate(plan):
                    sid = f"t{t}-{i}"
                    try:
                        manager.reserve(sid, SHAPES[which], BEST_EFFORT)
                    except CannotFit:
                        continue
                    _check_nothing_twice(manager, db.held())
                    if release:
                        manager.release(sid)
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(t, plan)) for t, plan in enumerate(plans)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert errors == []
        held = db.held()
        _check_nothing_twice(manager, held)
        assert set(held) == manager.owners()
        assert ResourceManager.open(TWO_SOCKET_CONFIG, TWO_SOCKET, db).snapshot() == manager.snapshot()
        for sid in held:
            manager.release(sid)
        assert manager.snapshot() == empty and db.held() == {}
    finally:
        db.close()


# -- ordinary memory per NUMA node ------------------------------------------------------------------
ONE_NODE_MEMORY = 8 * GI - 64 * P2M  # MemTotal less the node's hugepage pool


@pytest.mark.parametrize(
    ("reserved", "memory", "held", "refusal"),
    [
        pytest.param({}, GI, 0, None, id="fits"),
        pytest.param({}, ONE_NODE_MEMORY - GI, 0, None, id="exactly-what-is-left-after-the-default-1Gi"),
        pytest.param(
            {},
            ONE_NODE_MEMORY - GI + 2 * MI,
            0,
            "memory on node 0: need 7042Mi, free 7040Mi (short by 2Mi); its pool there is only 7040Mi "
            "(MemTotal less hugepages and memory_reserved): waiting will not help",
            id="one-page-too-many",
        ),
        pytest.param(
            {},
            1000 * GI,
            0,
            "memory on node 0: need 1000Gi, free 7040Mi (short by 1016960Mi); its pool there is only 7040Mi "
            "(MemTotal less hugepages and memory_reserved): waiting will not help",
            id="1000Gi",
        ),
        pytest.param(
            {ANY_NODE: 4 * GI},
            4 * GI,
            0,
            "memory on node 0: need 4Gi, free 3968Mi (short by 128Mi); its pool there is only 3968Mi "
            "(MemTotal less hugepages and memory_reserved): waiting will not help",
            id="admin-reserved-more",
        ),
        pytest.param({0: 0}, ONE_NODE_MEMORY, 0, None, id="nothing-reserved-on-node-0"),
        pytest.param(
            {},
            4 * GI,
            4 * GI,
            "memory on node 0: need 4Gi, free 2944Mi (short by 1152Mi)",
            id="held-by-another-guest: wait",
        ),
    ],
)
def test_ordinary_memory_per_node(
    ledger: Ledger, reserved: dict[int, int], memory: int, held: int, refusal: str | None
) -> None:
    config = ShimConfig(memory_reserved={ANY_NODE: GI, **reserved})
    manager = ResourceManager.open(config, ONE_NODE, ledger)
    if held:
        manager.reserve("other", shape(1, held, 4096), PROFILE)
    if refusal is None:
        p = manager.reserve("vm", shape(1, memory, 4096), PROFILE)
        assert p.memory == ((0, memory),) and p.hugepages == ()
        assert ledger.claims_of("vm").memory == ((0, memory),)
        return
    with pytest.raises(CannotFit) as exc:
        manager.reserve("vm", shape(1, memory, 4096), PROFILE)
    assert str(exc.value) == "cannot place the VM: " + refusal
    assert exc.value.shortfalls[0].resource == "memory"
    assert ledger.claims_of("vm") == Claim()


def test_hugepage_backed_guests_do_not_take_ordinary_memory(ledger: Ledger) -> None:
    manager = ResourceManager.open(ShimConfig(), ONE_NODE, ledger)
    p = manager.reserve("vm", shape(1, 64 * MI), PROFILE)
    assert p.memory == () and p.hugepages == ((0, P2M, 32),)


def test_memory_on_two_nodes_goes_where_the_cpus_are(ledger: Ledger) -> None:
    config = ShimConfig(memory_reserved={ANY_NODE: 0})
    manager = ResourceManager.open(config, TWO_SOCKET, ledger)
    per_node = 128 * GI - 1024 * P2M - 8 * GI
    assert manager.pools.memory_capacity == {0: per_node, 1: per_node}
    big = manager.reserve("big", shape(2, per_node, 4096), PROFILE)
    assert big.memory == ((big.nodes[0], per_node),)
    other = manager.reserve("other", shape(2, GI, 4096), PROFILE)
    assert other.nodes != big.nodes  # the first node has no memory left
    with pytest.raises(CannotFit) as exc:
        manager.reserve("third", shape(1, per_node, 4096), PROFILE)
    assert str(exc.value) == (
        "cannot place the VM: memory on node 0: need 118Gi, free 0 (short by 118Gi); "
        "memory on node 1: need 118Gi, free 117Gi (short by 1Gi)"
    )


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        pytest.param("2Gi", {ANY_NODE: 2 * GI}, id="every-node"),
        pytest.param(0, {ANY_NODE: 0}, id="nothing"),
        pytest.param({0: "4Gi", 1: "512Mi"}, {ANY_NODE: GI, 0: 4 * GI, 1: 512 * MI}, id="per-node"),
    ],
)
def test_memory_reserved_config(value: object, expected: dict[int, int]) -> None:
    config = config_from_mapping({"memory_reserved": value}, "c.yaml")
    assert config.memory_reserved == expected
    assert config.memory_reserved_on(5) == expected.get(5, expected[ANY_NODE])


@pytest.mark.parametrize(
    ("value", "message"),
    [
        pytest.param("-1Gi", "c.yaml: memory_reserved: ", id="negative"),
        pytest.param("lots", "c.yaml: memory_reserved: ", id="junk"),
        pytest.param({"node0": "1Gi"}, "keys are NUMA node numbers", id="bad-key"),
        pytest.param([1], "must be a memory quantity", id="list"),
    ],
)
def test_memory_reserved_config_errors(value: object, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        config_from_mapping({"memory_reserved": value}, "c.yaml")


# -- packing --------------------------------------------------------------------------------------
TWO_NODES = HostInventory(
    cpus=tuple(HostCpu(c, node=c // 4, package=c // 4, core=c % 4) for c in range(8)),
    hugepages=(HugepagePool(0, P2M, 100, 100), HugepagePool(1, P2M, 100, 100)),
)


@pytest.mark.parametrize(
    ("packing", "node"),
    [
        pytest.param("best-fit", 1, id="best-fit-fullest-node"),
        pytest.param("spread", 0, id="spread-emptiest-node"),
        pytest.param("first-fit", 0, id="first-fit-lowest-node"),
    ],
)
def test_packing_chooses_the_node(packing: Packing, node: int) -> None:
    """Node 1 has less left than node 0 (one CPU and 40 pages are held there)."""
    pools = host_pools(TWO_NODES, range(8), budgets={(n, P2M): HugepageBudget(n, P2M, 100, 100) for n in (0, 1)})
    state = FreeState.from_claims(pools, [Claim(cpus=(4,), pages=((1, P2M, 40),))])
    assert decide(shape(1, 32 * MI), pools, state, packing=packing).nodes == (node,)
