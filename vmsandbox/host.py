"""The host as the placer sees it: CPUs, their cores and NUMA nodes, memory and hugepage pools per
node, PCI functions (pure values).

Read from sysfs by ``sysfs.read_inventory``; built by hand in tests.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_PCI_ADDRESS = re.compile(r"(?:([0-9a-f]{4}):)?([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])")


@dataclass(frozen=True, order=True)
class HostCpu:
    id: int
    node: int = 0
    package: int = 0
    core: int = 0


@dataclass(frozen=True, order=True)
class HugepagePool:
    node: int
    page_size: int  # bytes
    total: int
    free: int


@dataclass(frozen=True, order=True)
class PciFunction:
    """One PCI function as sysfs shows it (``/sys/bus/pci/devices/<address>``)."""

    address: str  # domain:bus:slot.function, lower case: 0000:3b:00.0
    vendor: str = ""  # 4 hex digits, no 0x: 10de
    device: str = ""  # 4 hex digits: 2330
    node: int = -1  # NUMA node; -1 when the platform does not say
    iommu_group: int | None = None  # None: no IOMMU group (IOMMU off), cannot be passed through
    driver: str = ""  # bound driver (vfio-pci, nvidia, ...); "" when none
    pci_class: str = ""  # 6 hex digits: 030200

    @property
    def ids(self) -> str:
        return f"{self.vendor}:{self.device}"

    @property
    def is_bridge(self) -> bool:
        return self.pci_class.startswith("0604")

    def describe(self) -> str:
        driver = f", driver {self.driver}" if self.driver else ", no driver"
        return f"{self.address} ({self.ids}{driver})"


@dataclass(frozen=True)
class HostInventory:
    cpus: tuple[HostCpu, ...]
    hugepages: tuple[HugepagePool, ...] = ()
    hw_virt: bool = False  # the CPU advertises vmx or svm
    pci: tuple[PciFunction, ...] = ()  # sorted by address
    memory: tuple[tuple[int, int], ...] = ()  # (node, MemTotal in bytes, hugepage pools included); () unknown

    @property
    def nodes(self) -> tuple[int, ...]:
        return tuple(sorted({c.node for c in self.cpus}))

    def cpu(self, cpu_id: int) -> HostCpu | None:
        for c in self.cpus:
            if c.id == cpu_id:
                return c
        return None

    def pool(self, node: int, page_size: int) -> HugepagePool | None:
        for p in self.hugepages:
            if p.node == node and p.page_size == page_size:
                return p
        return None

    def pci_function(self, address: str) -> PciFunction | None:
        for f in self.pci:
            if f.address == address:
                return f
        return None

    def iommu_groups(self) -> dict[int, tuple[PciFunction, ...]]:
        """IOMMU group number -> its functions, by address."""
        groups: dict[int, list[PciFunction]] = {}
        for f in self.pci:
            if f.iommu_group is not None:
                groups.setdefault(f.iommu_group, []).append(f)
        return {g: tuple(sorted(fs)) for g, fs in sorted(groups.items())}


def parse_pci_address(text: str) -> str:
    """``[domain:]bus:slot.function`` (hex) to the canonical ``0000:3b:00.0``; ValueError on junk."""
    m = _PCI_ADDRESS.fullmatch(text.strip().lower())
    if not m:
        raise ValueError(f"bad PCI address {text!r} (expected [dddd:]bb:ss.f, hexadecimal)")
    domain, bus, slot, function = m.groups()
    if int(slot, 16) > 0x1F:
        raise ValueError(f"bad PCI address {text!r} (slot above 1f)")
    return f"{domain or '0000'}:{bus}:{slot}.{function}"


def parse_cpulist(text: str) -> tuple[int, ...]:
    """Kernel cpulist syntax ('0-3,8,10-11') to a sorted tuple; raises ValueError on junk."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            a, b = int(lo), int(hi)
            if a > b or a < 0:
                raise ValueError(f"bad cpu range {part!r}")
            out.update(range(a, b + 1))
        else:
            v = int(part)
            if v < 0:
                raise ValueError(f"bad cpu {part!r}")
            out.add(v)
    return tuple(sorted(out))


def format_cpulist(cpus: tuple[int, ...] | list[int] | set[int] | frozenset[int]) -> str:
    ordered = sorted(set(cpus))
    out: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(out)


def choose_accel(requested: str, hw_virt: bool, kvm_device: bool) -> str:
    """``auto`` picks KVM only where the CPU has vmx/svm and /dev/kvm exists; else TCG."""
    if requested == "auto":
        return "kvm" if hw_virt and kvm_device else "tcg"
    return requested
