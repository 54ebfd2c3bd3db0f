"""Read the host inventory from sysfs and procfs (the IO edge; roots are injectable for tests).

CPUs (online, package, core, NUMA node), memory per node (``MemTotal`` of ``node<N>/meminfo``, or of
``/proc/meminfo`` on a kernel without NUMA), hugepage pools per node and page size, and PCI functions
(vendor/device ids, class, NUMA node, IOMMU group and bound driver, from ``bus/pci/devices``; the
group and the driver are the names of the ``iommu_group`` and ``driver`` symlinks). Reading never
changes anything: no device is ever bound, unbound or detached here.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from vmsandbox.cri_metrics import LinkCounters
from vmsandbox.host import HostCpu, HostInventory, HugepagePool, PciFunction, parse_cpulist, parse_pci_address

_LINK_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,14}")  # a kernel interface name (IFNAMSIZ - 1)
_COUNTER_BYTES = 24  # a u64 in decimal and its newline fit
_PAGES_DIR = re.compile(r"hugepages-(\d+)kB")
_MEM_TOTAL = re.compile(r"^(?:Node \d+ )?MemTotal:\s+(\d+) kB$", re.MULTILINE)


def _read(path: Path, default: str = "") -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return default


def _pools(base: Path, node: int) -> list[HugepagePool]:
    pools: list[HugepagePool] = []
    if not base.is_dir():
        return pools
    for entry in sorted(base.iterdir()):
        m = _PAGES_DIR.fullmatch(entry.name)
        if not m:
            continue
        total = int(_read(entry / "nr_hugepages", "0") or 0)
        free = int(_read(entry / "free_hugepages", "0") or 0)
        pools.append(HugepagePool(node=node, page_size=int(m.group(1)) * 1024, total=total, free=free))
    return pools


def _mem_total(path: Path) -> int | None:
    """MemTotal in bytes from a meminfo file (per node or /proc/meminfo), None when absent."""
    m = _MEM_TOTAL.search(_read(path))
    return int(m.group(1)) * 1024 if m else None


def _link_name(path: Path) -> str:
    """The last component of a symlink's target ('' when it is not a symlink)."""
    try:
        return os.path.basename(os.readlink(path))
    except OSError:
        return ""


def _hex(path: Path) -> str:
    return _read(path).lower().removeprefix("0x")


def read_pci(sys_root: str | Path = "/sys") -> tuple[PciFunction, ...]:
    """Every PCI function under ``bus/pci/devices``, sorted by address."""
    base = Path(sys_root) / "bus/pci/devices"
    if not base.is_dir():
        return ()
    out: list[PciFunction] = []
    for entry in sorted(base.iterdir()):
        try:
            address = parse_pci_address(entry.name)
        except ValueError:
            continue
        group = _link_name(entry / "iommu_group")
        try:
            node = int(_read(entry / "numa_node", "-1") or -1)
        except ValueError:
            node = -1
        out.append(
            PciFunction(
                address=address,
                vendor=_hex(entry / "vendor"),
                device=_hex(entry / "device"),
                node=max(node, -1),
                iommu_group=int(group) if group.isdigit() else None,
                driver=_link_name(entry / "driver"),
                pci_class=_hex(entry / "class"),
            )
        )
    return tuple(sorted(out))


def read_inventory(sys_root: str | Path = "/sys", proc_root: str | Path = "/proc") -> HostInventory:
    sys_path = Path(sys_root)
    cpu_dir = sys_path / "devices/system/cpu"
    online = parse_cpulist(_read(cpu_dir / "online", "0"))
    node_of: dict[int, int] = {}
    node_dir = sys_path / "devices/system/node"
    nodes: list[int] = []
    if node_dir.is_dir():
        for entry in sorted(node_dir.iterdir()):
            if entry.name.startswith("node") and entry.name[4:].isdigit():
                node = int(entry.name[4:])
                nodes.append(node)
                for cpu in parse_cpulist(_read(entry / "cpulist")):
                    node_of[cpu] = node
    cpus = []
    for cpu in online:
        topo = cpu_dir / f"cpu{cpu}" / "topology"
        cpus.append(
            HostCpu(
                id=cpu,
                node=node_of.get(cpu, 0),
                package=int(_read(topo / "physical_package_id", "0") or 0),
                core=int(_read(topo / "core_id", str(cpu)) or cpu),
            )
        )
    pools: list[HugepagePool] = []
    memory: list[tuple[int, int]] = []
    for node in nodes:
        pools.extend(_pools(node_dir / f"node{node}" / "hugepages", node))
        total = _mem_total(node_dir / f"node{node}" / "meminfo")
        if total is not None:
            memory.append((node, total))
    if not nodes:
        pools.extend(_pools(sys_path / "kernel/mm/hugepages", 0))
        total = _mem_total(Path(proc_root) / "meminfo")
        if total is not None:
            memory.append((0, total))
    if len(memory) != max(len(nodes), 1):
        memory = []  # a node without figures: ordinary memory is not counted at all
    flags = ""
    for line in _read(Path(proc_root) / "cpuinfo").splitlines():
        if line.startswith("flags"):
            flags = line
            break
    hw_virt = bool(re.search(r"\b(vmx|svm)\b", flags))
    return HostInventory(
        cpus=tuple(cpus), hugepages=tuple(pools), hw_virt=hw_virt, pci=read_pci(sys_path), memory=tuple(memory)
    )


def hugepages_free(sys_root: str | Path = "/sys") -> dict[tuple[int, int], int]:
    """Free pages right now per (node, page size in bytes)."""
    return {(p.node, p.page_size): p.free for p in read_inventory(sys_root).hugepages}


def link_counters(name: str, sys_root: str | Path = "/sys") -> LinkCounters | None:
    """The counters of network device ``name`` of this network namespace, as its ``statistics/``
    files say (None: no such device, or a file that does not read as a count). The one symlink
    passed is sysfs's own ``class/net/<name>``; each counter is opened without following one and
    read at most ``_COUNTER_BYTES``."""
    if not _LINK_NAME.fullmatch(name):
        return None
    base = Path(sys_root) / "class" / "net" / name / "statistics"
    values: dict[str, int] = {}
    for counter in (
        "rx_bytes",
        "rx_packets",
        "rx_errors",
        "rx_dropped",
        "tx_bytes",
        "tx_packets",
        "tx_errors",
        "tx_dropped",
    ):
        try:
            fd = os.open(base / counter, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            text = os.read(fd, _COUNTER_BYTES).decode("ascii", "replace").strip()
        except OSError:
            return None
        finally:
            os.close(fd)
        if not text.isdigit() or len(text) > 20 or int(text) >= 1 << 64:
            return None
        values[counter] = int(text)
    return LinkCounters(**values)
