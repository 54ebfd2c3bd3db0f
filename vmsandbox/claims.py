"""What a sandbox holds on the host, as typed values (pure).

A ``Claim`` is exclusive CPUs and PCI functions (each held by one sandbox at most), hugepages
counted per (NUMA node, page size) and ordinary guest memory counted in bytes per node. Which page
of a pool backs a guest is the kernel's business, so pages are amounts, not page numbers.
``vmsandbox.placement`` produces claims, ``vmsandbox.adapters.ledger`` stores them and
``shim.host_resources`` (the ResourceManager) is the one component that hands them out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


def _summed(parts: Iterable[tuple[tuple[int, ...], int]]) -> dict[tuple[int, ...], int]:
    out: dict[tuple[int, ...], int] = {}
    for where, amount in parts:
        out[where] = out.get(where, 0) + amount
    return out


@dataclass(frozen=True)
class Claim:
    cpus: tuple[int, ...] = ()  # exclusive CPUs, sorted
    pci: tuple[str, ...] = ()  # PCI function addresses (whole IOMMU groups), sorted
    pages: tuple[tuple[int, int, int], ...] = ()  # (node, page size in bytes, pages), sorted, counts > 0
    memory: tuple[tuple[int, int], ...] = ()  # (node, bytes) of ordinary guest memory, sorted, > 0

    @staticmethod
    def of(
        cpus: Iterable[int] = (),
        pci: Iterable[str] = (),
        pages: Iterable[tuple[int, int, int]] = (),
        memory: Iterable[tuple[int, int]] = (),
    ) -> Claim:
        """A claim in its one spelling: CPUs and PCI functions sorted, amounts summed per place and sorted
        (zero amounts dropped), so equal holdings compare equal."""
        page_sum = _summed(((n, s), c) for n, s, c in pages)
        mem_sum = _summed(((n,), b) for n, b in memory)
        return Claim(
            cpus=tuple(sorted(cpus)),
            pci=tuple(sorted(pci)),
            pages=tuple((n, s, c) for (n, s), c in sorted(page_sum.items()) if c),
            memory=tuple((n, b) for (n,), b in sorted(mem_sum.items()) if b),
        )

    def __add__(self, other: Claim) -> Claim:
        return Claim.of(
            (*self.cpus, *other.cpus),
            (*self.pci, *other.pci),
            (*self.pages, *other.pages),
            (*self.memory, *other.memory),
        )

    @property
    def empty(self) -> bool:
        return not (self.cpus or self.pci or self.pages or self.memory)

    @property
    def page_count(self) -> int:
        return sum(c for _, _, c in self.pages)

    def pages_of(self, node: int, size: int) -> int:
        return sum(c for n, s, c in self.pages if n == node and s == size)

    def describe(self) -> str:
        parts = []
        if self.cpus:
            parts.append(f"{len(self.cpus)} CPU{'s' if len(self.cpus) != 1 else ''}")
        if self.pages:
            parts.append(f"{self.page_count} hugepages")
        if self.memory:
            parts.append(f"{sum(b for _, b in self.memory) >> 20} MiB of memory")
        if self.pci:
            parts.append(f"{len(self.pci)} PCI function{'s' if len(self.pci) != 1 else ''}")
        return ", ".join(parts) or "nothing"


NOTHING = Claim()
