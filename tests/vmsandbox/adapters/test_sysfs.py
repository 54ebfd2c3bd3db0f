"""Tests of vmsandbox.adapters.sysfs (fixture trees under tests/fixtures/sysfs) and vmsandbox.host's cpulists."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vmsandbox.adapters.sysfs import hugepages_free, read_inventory, read_pci
from vmsandbox.host import (
    HostCpu,
    HostInventory,
    HugepagePool,
    PciFunction,
    choose_accel,
    format_cpulist,
    parse_cpulist,
    parse_pci_address,
)

FIXTURES = Path(__file__).parents[2] / "fixtures" / "sysfs"
MI, GI = 1024**2, 1024**3

ONE_NODE_2CPU = HostInventory(
    cpus=(HostCpu(0, node=0, package=0, core=0), HostCpu(1, node=0, package=0, core=1)),
    hugepages=(HugepagePool(0, GI, 0, 0), HugepagePool(0, 2 * MI, 64, 60)),
    hw_virt=False,
    memory=((0, 8 * GI),),  # node0/meminfo MemTotal
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
    memory=((0, 128 * GI), (1, 128 * GI)),
)
NO_NUMA_4CPU = HostInventory(
    cpus=tuple(HostCpu(i, node=0, package=0, core=i % 2) for i in range(4)),
    hugepages=(HugepagePool(0, 2 * MI, 16, 16),),
    hw_virt=True,
    memory=((0, 16 * GI),),  # /proc/meminfo: no node directories
)


def fn(address: str, ids: str, cls: str, node: int, group: int, driver: str) -> PciFunction:
    vendor, device = ids.split(":")
    return PciFunction(address, vendor, device, node, group, driver, cls)


VFIO_TWO_NODE = HostInventory(
    # 2 packages x 2 cores x 2 threads, node = package, siblings n and n+4
    cpus=tuple(HostCpu(n, node=(n // 2) % 2, package=(n // 2) % 2, core=n % 2) for n in range(8)),
    hugepages=(
        HugepagePool(0, GI, 0, 0),
        HugepagePool(0, 2 * MI, 512, 512),
        HugepagePool(1, GI, 0, 0),
        HugepagePool(1, 2 * MI, 512, 512),
    ),
    hw_virt=True,
    memory=((0, 64 * GI), (1, 64 * GI)),
    pci=(
        fn("0000:00:00.0", "8086:2020", "060000", -1, 0, ""),  # host bridge, no driver
        fn("0000:17:00.0", "8086:0b25", "088000", -1, 7, "vfio-pci"),  # no NUMA node
        fn("0000:3b:00.0", "10de:2330", "030200", 0, 12, "vfio-pci"),  # GPU ...
        fn("0000:3b:00.1", "10de:22a3", "040300", 0, 12, "vfio-pci"),  # ... and its audio function: one group
        fn("0000:5e:00.0", "15b3:101d", "020000", 0, 20, "mlx5_core"),  # the host's NIC, two ports, one group
        fn("0000:5e:00.1", "15b3:101d", "020000", 0, 20, "mlx5_core"),
        fn("0000:86:00.0", "8086:1592", "020000", 1, 30, "vfio-pci"),  # a group half on vfio-pci ...
        fn("0000:86:00.1", "8086:1592", "020000", 1, 30, "ice"),  # ... half on the host driver
        fn("0000:af:00.0", "10de:2330", "030200", 1, 40, "vfio-pci"),
        fn("0000:af:00.1", "10de:22a3", "040300", 1, 40, "vfio-pci"),
        fn("0000:d7:00.0", "8086:2030", "060400", 1, 41, "pcieport"),  # a PCI bridge ...
        fn("0000:d8:00.0", "10de:2330", "030200", 1, 41, "vfio-pci"),  # ... in the group of the GPU behind it
    ),
)


@pytest.mark.parametrize(
    ("tree", "expected"),
    [
        pytest.param("one-node-2cpu", ONE_NODE_2CPU, id="one-node-2cpu"),
        pytest.param("two-socket-64-thread", TWO_SOCKET_64, id="two-socket-64-thread"),
        pytest.param("no-numa-4cpu-smt", NO_NUMA_4CPU, id="no-numa-dir"),
        pytest.param("vfio-two-node", VFIO_TWO_NODE, id="vfio-two-node"),
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


def test_iommu_groups_of_the_vfio_host() -> None:
    inv = read_inventory(FIXTURES / "vfio-two-node" / "sys", FIXTURES / "vfio-two-node" / "proc")
    groups = inv.iommu_groups()
    assert sorted(groups) == [0, 7, 12, 20, 30, 40, 41]
    assert [f.address for f in groups[12]] == ["0000:3b:00.0", "0000:3b:00.1"]
    assert [(f.address, f.is_bridge) for f in groups[41]] == [("0000:d7:00.0", True), ("0000:d8:00.0", False)]
    assert inv.pci_function("0000:86:00.1") == fn("0000:86:00.1", "8086:1592", "020000", 1, 30, "ice")
    assert inv.pci_function("0000:99:00.0") is None
    assert groups[12][0].ids == "10de:2330"
    assert groups[12][0].describe() == "0000:3b:00.0 (10de:2330, driver vfio-pci)"
    assert groups[0][0].describe() == "0000:00:00.0 (8086:2020, no driver)"


def test_pci_without_iommu_and_junk_entries(tmp_path: Path) -> None:
    """A host without IOMMU (this development machine): functions have no group; junk names are skipped."""
    base = tmp_path / "bus/pci/devices"
    (base / "0000:00:02.0").mkdir(parents=True)
    (base / "0000:00:02.0" / "vendor").write_text("0x1AF4\n")
    (base / "0000:00:02.0" / "numa_node").write_text("junk\n")
    (base / "not-an-address").mkdir()
    assert read_pci(tmp_path) == (PciFunction("0000:00:02.0", "1af4", "", -1, None, "", ""),)
    assert read_pci(tmp_path / "missing") == ()


@pytest.mark.parametrize(
    ("text", "address"),
    [
        pytest.param("0000:3b:00.0", "0000:3b:00.0", id="full"),
        pytest.param("3b:00.1", "0000:3b:00.1", id="no-domain"),
        pytest.param(" 0001:AF:1f.7 ", "0001:af:1f.7", id="upper-case-and-spaces"),
    ],
)
def test_parse_pci_address(text: str, address: str) -> None:
    assert parse_pci_address(text) == address


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("3b:00", id="no-function"),
        pytest.param("3b:00.8", id="function-above-7"),
        pytest.param("3b:20.0", id="slot-above-1f"),
        pytest.param("10de:2330", id="vendor-device-ids"),
        pytest.param("0000:3b:00.0.0", id="junk"),
    ],
)
def test_parse_pci_address_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="bad PCI address"):
        parse_pci_address(text)


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


@pytest.mark.parametrize(
    ("files", "memory"),
    [
        pytest.param({"node0": "Node 0 MemTotal:  1024 kB\nNode 0 MemFree: 12 kB\n"}, ((0, 1 << 20),), id="one-node"),
        pytest.param(
            {"node0": "Node 0 MemTotal: 2048 kB\n", "node1": "Node 1 MemTotal: 4096 kB\n"},
            ((0, 2 << 20), (1, 4 << 20)),
            id="two-nodes",
        ),
        pytest.param({"node0": "Node 0 MemTotal: 2048 kB\n", "node1": ""}, (), id="a-node-without-figures"),
        pytest.param({"node0": "Node 0 MemFree: 2048 kB\n"}, (), id="no-memtotal-line"),
        pytest.param({"node0": None}, (), id="no-meminfo-file"),
    ],
)
def test_memory_per_node(tmp_path: Path, files: dict[str, str | None], memory: tuple[tuple[int, int], ...]) -> None:
    """MemTotal per node; when any node lacks it, memory is not counted at all (never half a host)."""
    cpu = tmp_path / "sys/devices/system/cpu"
    cpu.mkdir(parents=True)
    (cpu / "online").write_text(f"0-{len(files) - 1}\n")
    for i, (name, text) in enumerate(files.items()):
        node = tmp_path / "sys/devices/system/node" / name
        node.mkdir(parents=True)
        (node / "cpulist").write_text(f"{i}\n")
        if text is not None:
            (node / "meminfo").write_text(text)
    assert read_inventory(tmp_path / "sys", tmp_path / "proc").memory == memory
