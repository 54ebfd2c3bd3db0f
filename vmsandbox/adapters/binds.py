"""Bind mounts that share host paths live into a guest's 9p export, and their safe removal.

A sandbox's shared directory (exported to its guest over virtio-9p) is made a mount point of its
own with shared propagation before QEMU starts. libvirt runs QEMU in a mount namespace whose root
is a slave of the host's, so a host path bind-mounted below that directory later (a container's
volume) appears in QEMU's namespace too, and the guest sees the host's files themselves: writes go
both ways, and unmounting on the host removes it from QEMU's view as well.

A read-only bind is made read-only before it is attached below the shared directory (a detached
clone of the source, ``open_tree`` + ``mount_setattr`` + ``move_mount``, Linux 5.12+): a remount
after attaching would not reach the copy already propagated into QEMU's namespace. Read-only is
then enforced by the host for the guest; recursively (every mount below the source too) when the
container asked for a recursive read-only mount.

Because a bind mount makes host files reachable from inside a directory tree, such a tree must
never be deleted with its mounts still in place: ``remove_tree`` detaches every mount at or below
a path first and refuses to delete anything while one remains.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
from pathlib import Path

from vmsandbox.errors import InfrastructureError

MS_BIND = 0x1000
MS_PRIVATE = 1 << 18
MS_SLAVE = 1 << 19
MS_SHARED = 1 << 20
# CRI mount propagation -> how a bind follows mounts made on the host below its source afterwards
PROPAGATION = {"private": MS_PRIVATE, "host-to-container": MS_SLAVE, "bidirectional": MS_SHARED}
MNT_DETACH = 0x2
# the new mount API (x86-64 system call numbers, linux/mount.h and linux/fcntl.h flags)
SYS_OPEN_TREE, SYS_MOVE_MOUNT, SYS_MOUNT_SETATTR = 428, 429, 442
OPEN_TREE_CLONE = 0x1
O_CLOEXEC = 0o2000000
AT_FDCWD = -100
AT_EMPTY_PATH = 0x1000
AT_RECURSIVE = 0x8000
MOUNT_ATTR_RDONLY = 0x1
MOVE_MOUNT_F_EMPTY_PATH = 0x4

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.syscall.restype = ctypes.c_long


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _check(rc: int, what: str) -> int:
    if rc < 0:
        raise InfrastructureError(f"{what}: {os.strerror(ctypes.get_errno())}")
    return rc


def _mount(source: str | None, target: str, flags: int, what: str) -> None:
    src = source.encode() if source is not None else None
    if _libc.mount(src, target.encode(), None, flags, None) != 0:
        err = ctypes.get_errno()
        raise InfrastructureError(f"{what}: {os.strerror(err)}")


def _unescape(field: str) -> str:
    """A path from /proc/self/mountinfo, where space, tab, newline and backslash are octal escapes."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mounts_under(path: str | os.PathLike[str], mountinfo: str | None = None) -> list[str]:
    """Mount points at or below ``path`` (as this process sees them), deepest first."""
    root = os.path.realpath(path)
    if mountinfo is None:
        mountinfo = Path("/proc/self/mountinfo").read_text()
    found = []
    for line in mountinfo.splitlines():
        fields = line.split(" ")
        if len(fields) < 5:
            continue
        point = _unescape(fields[4])
        if point == root or point.startswith(root.rstrip("/") + "/"):
            found.append(point)
    return sorted(found, key=lambda p: (p.count("/"), p), reverse=True)


def is_mount_point(path: str | os.PathLike[str], mountinfo: str | None = None) -> bool:
    return os.path.realpath(path) in mounts_under(path, mountinfo)


def make_shared(path: str | os.PathLike[str]) -> None:
    """Make directory ``path`` a mount point of its own with shared propagation (idempotent)."""
    target = os.fspath(path)
    if not is_mount_point(target):
        _mount(target, target, MS_BIND, f"bind {target} onto itself")
    _mount(None, target, MS_SHARED, f"make {target} a shared mount")


def _setattr(tree: int, attr: _MountAttr, recursive: bool, what: str) -> None:
    at = AT_EMPTY_PATH | (AT_RECURSIVE if recursive else 0)
    _check(_libc.syscall(SYS_MOUNT_SETATTR, tree, b"", at, ctypes.byref(attr), ctypes.sizeof(attr)), what)


def bind(
    source: str | os.PathLike[str],
    target: str | os.PathLike[str],
    readonly: bool,
    recursive: bool = False,
    propagation: str = "private",
) -> None:
    """Bind host path ``source`` (and the mounts below it) onto ``target``, an existing directory
    or file of the same kind: read-only when asked (``recursive``: the mounts below it too), made
    so before it is attached, so every copy propagation makes is read-only as well.
    ``propagation`` (a key of PROPAGATION) decides whether mounts made later on the host below
    ``source`` reach the bind: never (private), or as a slave or a peer of the source."""
    src, dst = os.fspath(source), os.fspath(target)
    what = f"bind {src} onto {dst}"
    flags = OPEN_TREE_CLONE | O_CLOEXEC | AT_RECURSIVE
    tree = _check(_libc.syscall(SYS_OPEN_TREE, AT_FDCWD, src.encode(), flags), what)
    try:
        if PROPAGATION[propagation] != MS_SHARED:  # a clone is a peer of a shared source already
            _setattr(tree, _MountAttr(propagation=PROPAGATION[propagation]), True, f"{what}: {propagation}")
        if readonly:
            _setattr(tree, _MountAttr(attr_set=MOUNT_ATTR_RDONLY), recursive, f"{what}: make it read-only")
        moved = _libc.syscall(SYS_MOVE_MOUNT, tree, b"", AT_FDCWD, dst.encode(), MOVE_MOUNT_F_EMPTY_PATH)
        _check(moved, what)
    finally:
        os.close(tree)


def unmount_all(path: str | os.PathLike[str]) -> None:
    """Detach every mount at or below ``path``. Raises InfrastructureError if one stays."""
    for point in mounts_under(path):
        if _libc.umount2(point.encode(), MNT_DETACH) != 0:
            err = ctypes.get_errno()
            if err not in (errno.EINVAL, errno.ENOENT):  # not (any more) a mount point
                raise InfrastructureError(f"unmount {point}: {os.strerror(err)}")
    left = mounts_under(path)
    if left:
        raise InfrastructureError(f"{len(left)} mounts stay under {os.fspath(path)}, e.g. {left[0]}")


def remove_tree(path: str | os.PathLike[str]) -> None:
    """Delete directory tree ``path`` after detaching the mounts in it; never deletes through a mount
    (raises InfrastructureError instead, leaving the tree)."""
    if not os.path.lexists(path):
        return
    unmount_all(path)
    shutil.rmtree(path, ignore_errors=True)
