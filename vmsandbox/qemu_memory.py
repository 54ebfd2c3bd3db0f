"""QEMU's own memory beyond guest RAM, read from its ``/proc/<pid>/smaps_rollup`` (pure parsing).

The per-pod figure is ``Anonymous``: the pages no file backs (TCG translation cache, device state,
heap, thread stacks, copied-on-write data). Hugepage-backed guest RAM is never in it (hugetlb pages
are counted apart, ``Private_Hugetlb``/``Shared_Hugetlb``); file pages (QEMU's binary and
libraries, the guest kernel it read) are page cache every pod of the host shares. Guest RAM on
ordinary pages is anonymous memory too: its mapping is found in the full ``/proc/<pid>/smaps``
(``guest_ram_mapping_kib``) and taken out.
"""

from __future__ import annotations

SMAPS_ROLLUP_MAX = 8192
"""The most of a smaps_rollup file read (it is a few hundred bytes: a header and ~25 fields)."""
SMAPS_MAX = 4 << 20
"""The most of a smaps file read (QEMU's: a few hundred mappings of ~25 lines, 100-300 KiB)."""


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


def beyond_guest_ram_kib(fields: dict[str, int], guest_ram: dict[str, int] | None = None) -> int | None:
    """QEMU's private memory beyond guest RAM: its anonymous KiB less the anonymous KiB of the
    mapping backing guest RAM on ordinary pages (``guest_ram``, from ``guest_ram_mapping_kib``;
    None: hugepage-backed or not found); None when the rollup had no ``Anonymous``."""
    anonymous = fields.get("Anonymous")
    if anonymous is None:
        return None
    return max(anonymous - (guest_ram or {}).get("Anonymous", 0), 0)


def guest_ram_mapping_kib(smaps: str, ram_kib: int) -> dict[str, int] | None:
    """``Rss`` and ``Anonymous`` (KiB) of the mapping that backs guest RAM in a QEMU's
    ``/proc/<pid>/smaps``: of the writable mappings no file backs that are at least ``ram_kib``
    large, the smallest (QEMU's ``memory-backend-ram``); None when there is none."""
    best: tuple[int, dict[str, int]] | None = None
    size, candidate = 0, False
    fields: dict[str, int] = {}

    def close() -> None:
        nonlocal best
        if candidate and size >= ram_kib and (best is None or size < best[0]):
            best = (size, {"Rss": fields.get("Rss", 0), "Anonymous": fields.get("Anonymous", 0)})

    for line in smaps.splitlines():
        head = line.split(maxsplit=5)
        if len(head) >= 5 and "-" in head[0] and len(head[1]) == 4:
            close()
            start, _, end = head[0].partition("-")
            size, fields = (int(end, 16) - int(start, 16)) // 1024, {}
            path = head[5] if len(head) == 6 else ""
            candidate = head[1].startswith("rw") and (path == "" or path.startswith("[anon"))
        elif candidate:
            name, _, rest = line.partition(":")
            value = rest.split()
            if len(value) == 2 and value[1] == "kB" and value[0].isdigit():
                fields[name] = int(value[0])
    close()
    return best[1] if best is not None else None
