"""Tests of vmsandbox.sysfs (fixture trees under tests/fixtures/sysfs) and the cpulist helpers of vmsandbox.host."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vmsandbox.host import HostCpu, HostInventory, HugepagePool, choose_accel, format_cpulist, parse_cpulist
from vmsandbox.sysfs import hugepages_free, read_inventory

FIXTURES = Path(__file__).parents[1] / "fixtures" / "sysfs"
MI, GI = 1024**2, 1024**3

ONE_NODE_2CPU = HostInventory(
    cpus=(HostCpu(0, node=0, package=0, core=0), HostCpu(1, node=0, package=0, core=1)),
    hugepages=(HugepagePool(0, GI, 0, 0), HugepagePool(0, 2 * MI, 64, 60)),
    hw_virt=False,
)
TWO_SOCKET_64 = HostInventory(
    # 0-15 socket 0, 16-31 socket 1, 32-63 their SMT siblings (n and n+32 share a core)
    cpus=tuple(HostCpu(i, node=(i // 16) % 2, package=(i // 16) % 2, core=i % 16) for i in range(64)),
    hugepages=(
        HugepagePool(0, GI, 8, 8),
        HugepagePool(0, 2 * MI, 1024, 1000),
        HugepagePool(1, GI, 8, 6),
        HugepagePool(1, 2 * MI, 1024, 1024),
    ),
    hw_virt=True,
)
NO_NUMA_4CPU = HostInventory(
    cpus=tuple(HostCpu(i, node=0, package=0, core=i % 2) for i in range(4)),
    hugepages=(HugepagePool(0, 2 * MI, 16, 16),),
    hw_virt=True,
)


@pytest.mark.parametrize(
    ("tree", "expected"),
    [
        pytest.param("one-node-2cpu", ONE_NODE_2CPU, id="one-node-2cpu"),
        pytest.param("two-socket-64-thread", TWO_SOCKET_64, id="two-socket-64-thread"),
        pytest.param("no-numa-4cpu-smt", NO_NUMA_4CPU, id="no-numa-dir"),
    ],
)
def test_read_inventory(tree: str, expected: HostInventory) -> None:
    got = read_inventory(FIXTURES / tree / "sys", FIXTURES / tree / "proc")
    assert got == expected


def test_two_socket_topology() -> None:
    inv = read_inventory(FIXTURES / "two-socket-64-thread" / "sys", FIXTURES / "two-socket-64-thread" / "proc")
    assert inv.nodes == (0, 1)
    assert inv.cpu(40) == HostCpu(40, node=0, package=0, core=8)
    assert inv.cpu(64) is None
    assert inv.pool(1, GI) == HugepagePool(1, GI, 8, 6)
    assert inv.pool(2, GI) is None
    siblings: dict[tuple[int, int], list[int]] = {}
    for c in inv.cpus:
        siblings.setdefault((c.package, c.core), []).append(c.id)
    assert len(siblings) == 32
    assert siblings[(1, 3)] == [19, 51]
    assert format_cpulist([c.id for c in inv.cpus if c.node == 1]) == "16-31,48-63"


def test_hugepages_free() -> None:
    assert hugepages_free(FIXTURES / "two-socket-64-thread" / "sys") == {
        (0, 2 * MI): 1000,
        (0, GI): 8,
        (1, 2 * MI): 1024,
        (1, GI): 6,
    }


def test_empty_root_is_one_cpu_without_pools(tmp_path: Path) -> None:
    assert read_inventory(tmp_path / "sys", tmp_path / "proc") == HostInventory(cpus=(HostCpu(0, 0, 0, 0),))


# -- cpulist syntax -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "cpus"),
    [
        pytest.param("", (), id="empty"),
        pytest.param("\n", (), id="newline"),
        pytest.param("0", (0,), id="single"),
        pytest.param("0-3", (0, 1, 2, 3), id="range"),
        pytest.param("0-1,8,10-11\n", (0, 1, 8, 10, 11), id="mixed"),
        pytest.param("5,1-2,2", (1, 2, 5), id="unsorted-overlapping"),
        pytest.param("7-7", (7,), id="one-element-range"),
    ],
)
def test_parse_cpulist(text: str, cpus: tuple[int, ...]) -> None:
    assert parse_cpulist(text) == cpus


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param("3-1", "bad cpu range '3-1'", id="reversed"),
        pytest.param("a", "invalid literal for int() with base 10: 'a'", id="junk"),
        pytest.param("-1", "invalid literal for int() with base 10: ''", id="negative"),
        pytest.param("1-2-3", "invalid literal for int() with base 10: '2-3'", id="double-range"),
    ],
)
def test_parse_cpulist_rejects(text: str, message: str) -> None:
    with pytest.raises(ValueError) as exc:
        parse_cpulist(text)
    assert str(exc.value) == message


@pytest.mark.parametrize(
    ("cpus", "text"),
    [
        pytest.param((), "", id="empty"),
        pytest.param((3,), "3", id="single"),
        pytest.param((0, 1), "0-1", id="pair"),
        pytest.param({5, 0, 1, 2, 9, 10}, "0-2,5,9-10", id="set"),
        pytest.param([2, 2, 3], "2-3", id="duplicates"),
    ],
)
def test_format_cpulist(cpus: tuple[int, ...], text: str) -> None:
    assert format_cpulist(cpus) == text


@settings(max_examples=200, deadline=None)
@given(st.sets(st.integers(0, 300)))
def test_cpulist_round_trip(cpus: set[int]) -> None:
    text = format_cpulist(cpus)
    assert parse_cpulist(text) == tuple(sorted(cpus))
    assert format_cpulist(parse_cpulist(text)) == text


@pytest.mark.parametrize(
    ("requested", "hw_virt", "kvm_device", "accel"),
    [
        pytest.param("auto", True, True, "kvm", id="auto-with-vmx-and-dev-kvm"),
        pytest.param("auto", False, True, "tcg", id="auto-paravirtual-dev-kvm"),
        pytest.param("auto", True, False, "tcg", id="auto-without-dev-kvm"),
        pytest.param("kvm", False, False, "kvm", id="forced-kvm"),
        pytest.param("tcg", True, True, "tcg", id="forced-tcg"),
    ],
)
def test_choose_accel(requested: str, hw_virt: bool, kvm_device: bool, accel: str) -> None:
    assert choose_accel(requested, hw_virt, kvm_device) == accel
