"""Reading /proc/<pid>/mountinfo (pure): the mount points a namespace has, as plain paths.

Each line's fifth field is a mount point, with space, tab, newline and backslash written as octal
escapes (proc(5)).
"""

from __future__ import annotations


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
