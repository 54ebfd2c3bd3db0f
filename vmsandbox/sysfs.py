"""Read the host inventory from sysfs and procfs (the IO edge; roots are injectable for tests)."""

from __future__ import annotations

import re
from pathlib import Path

from vmsandbox.host import HostCpu, HostInventory, HugepagePool, parse_cpulist

_PAGES_DIR = re.compile(r"^hugepages-(\d+)kB$")


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
        m = _PAGES_DIR.match(entry.name)
        if not m:
            continue
        total = int(_read(entry / "nr_hugepages", "0") or 0)
        free = int(_read(entry / "free_hugepages", "0") or 0)
        pools.append(HugepagePool(node=node, page_size=int(m.group(1)) * 1024, total=total, free=free))
    return pools


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
    for node in nodes:
        pools.extend(_pools(node_dir / f"node{node}" / "hugepages", node))
    if not nodes:
        pools.extend(_pools(sys_path / "kernel/mm/hugepages", 0))
    flags = ""
    for line in _read(Path(proc_root) / "cpuinfo").splitlines():
        if line.startswith("flags"):
            flags = line
            break
    hw_virt = bool(re.search(r"\b(vmx|svm)\b", flags))
    return HostInventory(cpus=tuple(cpus), hugepages=tuple(pools), hw_virt=hw_virt)


def hugepages_free(sys_root: str | Path = "/sys") -> dict[tuple[int, int], int]:
    """Free pages right now per (node, page size in bytes)."""
    return {(p.node, p.page_size): p.free for p in read_inventory(sys_root).hugepages}
