"""Reading /proc/<pid>/mountinfo (pure): the mount points a namespace has, as plain paths, and
a mount's own options.

Each line's fifth field is a mount point, with space, tab, newline and backslash written as octal
escapes (proc(5)); the sixth is the mount's options (``ro``, ``nosuid``, ...); after the `` - ``
separator come the file system type, the source and the super block's options.
"""

from __future__ import annotations

from collections.abc import Mapping


def unescape(field: str) -> str:
    """A mountinfo path field as the path it names."""
    for code, ch in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, ch)
    return field


def points_under(mountinfo: str, root: str) -> list[str]:
    """Mount points at or below ``root`` (an absolute path, symlinks resolved) in ``mountinfo``,
    deepest first."""
    found = []
    for line in mountinfo.splitlines():
        fields = line.split(" ")
        if len(fields) < 5:
            continue
        point = unescape(fields[4])
        if point == root or point.startswith(root.rstrip("/") + "/"):
            found.append(point)
    return sorted(found, key=lambda p: (p.count("/"), p), reverse=True)


def mounts_below(mountinfo: str, root: str) -> dict[int, str]:
    """The mounts at or below ``root`` in ``mountinfo``: mount id (the first field) -> mount point,
    in the file's order (the order they were attached in). A mount made again at the same point
    has a new id."""
    found = {}
    prefix = root.rstrip("/") + "/"
    for line in mountinfo.splitlines():
        fields = line.split(" ")
        if len(fields) < 5 or not fields[0].isdigit():
            continue
        point = unescape(fields[4])
        if point == root or point.startswith(prefix):
            found[int(fields[0])] = point
    return found


def mount_changes(
    known: Mapping[int, str], now: Mapping[int, str]
) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(mounts in ``now`` not in ``known``, shallowest first, else in ``now``'s order; mounts of
    ``known`` gone from ``now``, deepest first, else last first): the order to make them again
    and to undo them in. A mount moved elsewhere (same id, another point) is both."""
    added = sorted(((i, p) for i, p in now.items() if known.get(i) != p), key=lambda m: m[1].count("/"))
    gone = sorted(((i, p) for i, p in known.items() if now.get(i) != p), key=lambda m: m[1].count("/"))
    return added, gone[::-1]


def options_at(mountinfo: str, point: str) -> frozenset[str] | None:
    """The per-mount options of the topmost mount at ``point`` in ``mountinfo`` (the last one
    attached there); None when nothing is mounted there."""
    found = None
    for line in mountinfo.splitlines():
        fields = line.split(" ")
        if len(fields) >= 6 and unescape(fields[4]) == point:
            found = frozenset(fields[5].split(","))
    return found


def filesystem_at(mountinfo: str, point: str) -> tuple[str, str] | None:
    """(file system type, super block options) of the topmost mount at ``point`` in ``mountinfo``
    (the last one attached there); None when nothing is mounted there."""
    found = None
    for line in mountinfo.splitlines():
        pre, sep, post = line.partition(" - ")
        fields = pre.split(" ")
        if sep and len(fields) >= 5 and unescape(fields[4]) == point:
            tail = post.split(" ")
            found = (tail[0], tail[2] if len(tail) > 2 else "")
    return found
