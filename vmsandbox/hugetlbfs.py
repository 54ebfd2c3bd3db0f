"""Hugepage file systems for containers (pure): which host mounts are hugetlbfs, and the
``pagesize=`` spelling a guest's hugetlbfs mount takes.

A kubelet hands a container its ``medium: HugePages`` emptyDir as a host path on a hugetlbfs
mount; in a VM that host mount means nothing, so the container gets a hugetlbfs mount of the same
page size from its guest's own pool (reserved at boot for the sizes the pod declared).
"""

from __future__ import annotations

from vmsandbox.mountinfo import unescape


def mount_pagesize(mountinfo: str, path: str) -> str | None:
    """The ``pagesize=`` value of the hugetlbfs mount holding ``path`` (an absolute, resolved path),
    or None when the mount holding it is not hugetlbfs. ``mountinfo``: /proc/self/mountinfo."""
    best: tuple[int, str | None] = (-1, None)
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5:
            continue
        point = unescape(fields[4])
        if not (path == point or path.startswith(point.rstrip("/") + "/")):
            continue
        if len(point) < best[0]:
            continue
        tail = right.split()
        pagesize = None
        if tail and tail[0] == "hugetlbfs":
            options = tail[2].split(",") if len(tail) > 2 else []
            text = next((o.split("=", 1)[1] for o in options if o.startswith("pagesize=")), "2M")
            pagesize = _normal(text)
        best = (len(point), pagesize)
    return best[1]


def _normal(text: str) -> str:
    """The kernel's ``pagesize=`` spelling ("2M", "1024M") in ours ("2M", "1G")."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text[-1:].upper() in units and text[:-1].isdigit():
        return pagesize_option(int(text[:-1]) * units[text[-1].upper()])
    return text


def pagesize_option(size_bytes: int) -> str:
    """2 MiB -> "2M", 1 GiB -> "1G" (hugetlbfs's ``pagesize=``)."""
    if size_bytes % (1 << 30) == 0:
        return f"{size_bytes >> 30}G"
    return f"{size_bytes >> 20}M"


def default_mountpoint(sizes: list[int]) -> dict[int, str]:
    """Where a container that declared hugepages of ``sizes`` gets them when its own mounts do not
    place them: /dev/hugepages for one size, /dev/hugepages-<size> each for several."""
    if len(sizes) == 1:
        return {sizes[0]: "/dev/hugepages"}
    return {s: f"/dev/hugepages-{pagesize_option(s)}" for s in sorted(sizes)}
