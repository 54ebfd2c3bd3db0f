"""QEMU's memory beyond guest RAM from its smaps_rollup: the fields read, and what is ignored."""

from __future__ import annotations

import pytest

from vmsandbox.qemu_memory import SMAPS_ROLLUP_MAX, beyond_guest_ram_kib, parse_smaps_rollup

ROLLUP = b"""55d0c0000000-7ffd5b3f2000 ---p 00000000 00:00 0                          [rollup]
Rss:              155732 kB
Pss:              149786 kB
Private_Clean:     88092 kB
Private_Dirty:     59668 kB
Anonymous:         59668 kB
Private_Hugetlb:  196608 kB
"""


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (
            ROLLUP,
            {
                "Rss": 155732,
                "Pss": 149786,
                "Private_Clean": 88092,
                "Private_Dirty": 59668,
                "Anonymous": 59668,
                "Private_Hugetlb": 196608,
            },
        ),
        (b"", {}),
        (b"Anonymous: 12 MB\n", {}),  # another unit: not ours to convert
        (b"Anonymous: -1 kB\n", {}),
        (b"Anonymous: 12 kB extra\n", {}),
        (b"Ano nymous: 12 kB\n", {}),
        (b"\xff\xfe: 1 kB\nAnonymous: 7 kB\n", {"Anonymous": 7}),
        (b"Anonymous: 7 kB", {"Anonymous": 7}),  # no final newline
    ],
)
def test_parse_smaps_rollup(data: bytes, expected: dict[str, int]) -> None:
    assert parse_smaps_rollup(data) == expected


def test_only_the_first_bytes_are_read() -> None:
    padded = b"x" * SMAPS_ROLLUP_MAX + b"\nAnonymous: 7 kB\n"
    assert parse_smaps_rollup(padded) == {}


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        # hugetlb and file pages left out
        ({"Anonymous": 59668, "Private_Hugetlb": 196608, "Private_Clean": 88092}, 59668),
        ({"Rss": 1}, None),
    ],
)
def test_beyond_guest_ram(fields: dict[str, int], expected: int | None) -> None:
    assert beyond_guest_ram_kib(fields) == expected


@pytest.mark.parametrize(
    ("guest_ram", "expected"),
    [
        (None, 140_000),  # hugepage-backed: guest RAM was never anonymous
        ({"Rss": 104_000, "Anonymous": 104_000}, 36_000),  # ordinary pages: the guest's touched RAM out
        ({"Rss": 0}, 140_000),
        ({"Anonymous": 150_000}, 0),  # never below zero, whatever the two reads saw
    ],
)
def test_guest_ram_on_ordinary_pages_is_not_counted_as_the_vmms(
    guest_ram: dict[str, int] | None, expected: int
) -> None:
    assert beyond_guest_ram_kib({"Anonymous": 140_000}, guest_ram) == expected
