"""The metrics' gauge of each sandbox's QEMU memory beyond guest RAM, from what the scrape reads."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from shim.metrics import HostCollector


def _collector(read: object) -> HostCollector:
    return HostCollector(None, lambda: None, lambda: 0, read)  # type: ignore[arg-type,return-value]


def _samples(measured: object) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in _collector(measured)._vmm_memory():
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.mark.parametrize(
    ("measured", "expected"),
    [
        ([], {("vmsandbox_vmm_private_memory_total_bytes", ()): 0}),
        (
            [("b", 2048), ("a", 1024)],
            {
                ("vmsandbox_vmm_private_memory_bytes", (("sandbox_id", "a"),)): 1024 * 1024,
                ("vmsandbox_vmm_private_memory_bytes", (("sandbox_id", "b"),)): 2048 * 1024,
                ("vmsandbox_vmm_private_memory_total_bytes", ()): 3072 * 1024,
            },
        ),
    ],
)
def test_gauge_per_sandbox_and_total(measured: Iterable[tuple[str, int]], expected: dict[object, float]) -> None:
    assert _samples(lambda: measured) == expected


def test_a_failing_read_yields_nothing() -> None:
    def broken() -> list[tuple[str, int]]:
        raise OSError("gone")

    assert _samples(broken) == {}
