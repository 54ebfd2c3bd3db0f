"""QEMU's own memory beyond guest RAM, read from its ``/proc/<pid>/smaps_rollup`` (pure parsing).

The per-pod figure is ``Anonymous``: the pages no file backs (TCG translation cache, device state,
heap, thread stacks, copied-on-write data). Hugepage-backed guest RAM is never in it (hugetlb pages
are counted apart, ``Private_Hugetlb``/``Shared_Hugetlb``); file pages (QEMU's binary and
libraries, the guest kernel it read) are page cache every pod of the host shares.
"""

from __future__ import annotations

SMAPS_ROLLUP_MAX = 8192
"""The most of a smaps_rollup file read (it is a few hundred bytes: a header and ~25 fields)."""


def parse_smaps_rollup(data: bytes) -> dict[str, int]:
    """The ``Name: N kB`` fields of a smaps_rollup, in KiB; lines of any other form, and anything
    past ``SMAPS_ROLLUP_MAX`` bytes, are ignored."""
    out: dict[str, int] = {}
    for line in data[:SMAPS_ROLLUP_MAX].decode("ascii", errors="replace").splitlines():
        name, sep, rest = line.partition(":")
        fields = rest.split()
        if not sep or len(fields) != 2 or fields[1] != "kB" or not fields[0].isdigit() or not name.isidentifier():
            continue
        out[name] = int(fields[0])
    return out


def beyond_guest_ram_kib(fields: dict[str, int]) -> int | None:
    """QEMU's private memory beyond guest RAM: its anonymous KiB; None when the file had none."""
    return fields.get("Anonymous")
