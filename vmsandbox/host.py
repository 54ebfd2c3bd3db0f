"""The host as the placer sees it: CPUs, their cores and NUMA nodes, hugepage pools (pure values).

Read from sysfs by ``sysfs.read_inventory``; built by hand in tests.
"""

from __future__ import annotations

from dataclasses import dataclass


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


@dataclass(frozen=True)
class HostInventory:
    cpus: tuple[HostCpu, ...]
    hugepages: tuple[HugepagePool, ...] = ()
    hw_virt: bool = False  # the CPU advertises vmx or svm

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
