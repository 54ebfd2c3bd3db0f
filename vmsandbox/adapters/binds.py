"""Bind mounts that share host paths live with a guest: attached inside its QEMU's mount namespace.

libvirt runs each QEMU in a mount namespace of its own. A container's volume is cloned from the
host (``open_tree``: a detached copy of the path and the mounts below it), given its read-only
and propagation attributes and, on every mount of the copy, nosuid and nodev (``mount_setattr``),
and attached below the sandbox's 9p export *in
that namespace* (a short-lived thread that leaves the shim's file-system context, ``setns`` into
QEMU's namespace, ``move_mount``). Linux 5.12 or later.

The guest then sees the host's files themselves, both ways; read-only is enforced by the host
for the guest (recursively when asked). QEMU runs as an unprivileged uid of its own, so a bind can be
*idmapped* (``mount_setattr`` with ``MOUNT_ATTR_IDMAP``, Linux 5.12+, and a file system that allows
it): through it, files the host's root owns are QEMU's, and what QEMU creates is root's on the host
(under 9p's ``mapped`` model always a plain 0600 file or 0700 directory); files of other owners are
reached only through their "other" permission bits. ``bind_below`` copies one later host mount
into such a bind, idmapped alike (``shim/mount_follow.py``: the kernel's propagation would bring
it without the mapping). Nothing is mounted in the host's namespace: the kubelet
can unmount and delete its volume directories while a container still has them (the copy in
QEMU's namespace is detached lazily, as for any container runtime's namespace), deleting a
sandbox's directory can never reach through a bind, and the namespace, with its binds, goes when
QEMU exits.
"""

from __future__ import annotations

import ctypes
import os
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from vmsandbox.adapters import shared_tree
from vmsandbox.errors import InfrastructureError
from vmsandbox.mountinfo import points_under

MS_PRIVATE = 1 << 18
MS_SLAVE = 1 << 19
MS_SHARED = 1 << 20
# CRI mount propagation -> how a bind follows mounts the host makes below its source afterwards
PROPAGATION = {"private": MS_PRIVATE, "host-to-container": MS_SLAVE, "bidirectional": MS_SHARED}
MNT_DETACH = 0x2
UMOUNT_NOFOLLOW = 0x8
CLONE_FS = 0x200
CLONE_NEWNS = 0x20000
# the new mount API (x86-64 system call numbers, linux/mount.h and linux/fcntl.h flags)
SYS_OPEN_TREE, SYS_MOVE_MOUNT, SYS_MOUNT_SETATTR = 428, 429, 442
OPEN_TREE_CLONE = 0x1
O_CLOEXEC = 0o2000000
AT_FDCWD = -100
AT_EMPTY_PATH = 0x1000
AT_RECURSIVE = 0x8000
MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
MOUNT_ATTR_IDMAP = 0x00100000
MOVE_MOUNT_F_EMPTY_PATH = 0x4
MOVE_MOUNT_T_EMPTY_PATH = 0x40
O_PATH = getattr(os, "O_PATH", 0o10000000)

_libc = ctypes.CDLL(None, use_errno=True)
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


def _setattr(tree: int, attr: _MountAttr, recursive: bool, what: str) -> None:
    at = AT_EMPTY_PATH | (AT_RECURSIVE if recursive else 0)
    _check(_libc.syscall(SYS_MOUNT_SETATTR, tree, b"", at, ctypes.byref(attr), ctypes.sizeof(attr)), what)


def mounts_under(path: str | os.PathLike[str], mountinfo: str | None = None) -> list[str]:
    """Mount points at or below ``path`` (taken as written: no symlink in it is resolved, since
    a guest may have made them) in ``mountinfo`` (default: this thread's), deepest first."""
    if mountinfo is None:
        mountinfo = Path("/proc/thread-self/mountinfo").read_text()
    return points_under(mountinfo, os.path.abspath(path))


def in_namespace(pid: int, what: str, work: Callable[[], None]) -> None:
    """Run ``work`` in the mount namespace of process ``pid``, in a thread of its own (a thread
    must leave the process's shared file-system context before it may change namespace, and is
    not used again after)."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            _check(_libc.unshare(CLONE_FS), f"{what}: unshare the file-system context")
            try:
                fd = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:
                raise InfrastructureError(f"{what}: QEMU (pid {pid}) is gone: {exc.strerror}") from None
            try:
                _check(_libc.setns(fd, CLONE_NEWNS), f"{what}: enter QEMU's mount namespace")
            finally:
                os.close(fd)
            work()
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=run, name=f"mountns-{pid}")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]


def _user_namespace(root_as: int) -> int:
    """An fd of a new user namespace in which host root (uid and gid 0) is ``root_as`` and no one
    else is mapped; a process is made for it (``unshare --user``) and killed once it is open."""
    proc = subprocess.Popen(
        ["unshare", "--user", "--", "sleep", "60"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        ours = os.readlink("/proc/self/ns/user")
        deadline = time.monotonic() + 10
        while True:
            try:
                if os.readlink(f"/proc/{proc.pid}/ns/user") != ours:
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise InfrastructureError("cannot make a user namespace for an idmapped bind (unshare --user)")
            time.sleep(0.001)
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{proc.pid}/{name}", "w") as f:
                f.write(f"0 {root_as} 1\n")
        return os.open(f"/proc/{proc.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise InfrastructureError(f"cannot make a user namespace for an idmapped bind: {exc.strerror}") from None
    finally:
        proc.kill()
        proc.wait()


_IDMAPS_KEPT = 64
"""User namespaces kept open for idmapping, at most (the least recently made go first)."""
_idmaps: dict[int, int] = {}
_idmaps_lock = threading.Lock()


def _idmap(root_as: int) -> int:
    """The user namespace of ``root_as`` (``_user_namespace``), made once and kept open (it says
    nothing but "host root is ``root_as``", so it serves every bind for that uid): no process is
    made per bind. Used under ``_idmaps_lock``, so a namespace closed to make room is not in use."""
    fd = _idmaps.get(root_as)
    if fd is None:
        if len(_idmaps) >= _IDMAPS_KEPT:
            os.close(_idmaps.pop(next(iter(_idmaps))))
        fd = _idmaps[root_as] = _user_namespace(root_as)
    return fd


def resolve(path: str) -> int:
    """An ``O_PATH`` descriptor of host path ``path``, which must be absolute and hold no symlink
    (a ``realpath``): resolved with ``RESOLVE_NO_SYMLINKS``, so a component replaced by a symlink
    since the path was checked fails (OSError ``ELOOP``) instead of being followed, and the
    descriptor's own path is checked to still be ``path``. A bind of that descriptor
    (``bind(source=fd)``) then binds exactly what was checked: no second lookup. The caller
    closes it."""
    if not os.path.isabs(path):
        raise OSError(22, "not an absolute path", path)
    root = os.open("/", O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = shared_tree.open_beneath(root, path.lstrip("/") or ".", O_PATH, cross_mounts=True)
    finally:
        os.close(root)
    try:
        if os.readlink(f"/proc/self/fd/{fd}") != path:
            raise OSError(116, "moved while it was being resolved", path)  # ESTALE
    except BaseException:
        os.close(fd)
        raise
    return fd


def _clone(
    src: str | int, what: str, *, subtree: bool, propagation: str, readonly: bool, recursive: bool, root_as: int
) -> int:
    """A detached copy of the mount at ``src`` (a path, or a descriptor from ``resolve``; with
    ``subtree``, and the mounts below it), with its propagation, read-only and idmapping
    attributes set, and nosuid and nodev on every mount of it; the caller closes it."""
    flags = OPEN_TREE_CLONE | O_CLOEXEC | (AT_RECURSIVE if subtree else 0)
    if isinstance(src, int):
        tree = _check(_libc.syscall(SYS_OPEN_TREE, src, b"", flags | AT_EMPTY_PATH), what)
    else:
        tree = _check(_libc.syscall(SYS_OPEN_TREE, AT_FDCWD, src.encode(), flags), what)
    try:
        # nothing QEMU writes or finds through a bind runs setuid or opens a device through it
        _setattr(tree, _MountAttr(attr_set=MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV), True, f"{what}: nosuid, nodev")
        if PROPAGATION[propagation] != MS_SHARED:  # a clone is a peer of a shared source already
            _setattr(tree, _MountAttr(propagation=PROPAGATION[propagation]), True, f"{what}: {propagation}")
        if readonly:
            _setattr(tree, _MountAttr(attr_set=MOUNT_ATTR_RDONLY), recursive, f"{what}: make it read-only")
        if root_as:
            with _idmaps_lock:
                attr = _MountAttr(attr_set=MOUNT_ATTR_IDMAP, userns_fd=_idmap(root_as))
                _setattr(tree, attr, True, f"{what}: map host root to uid {root_as}")
    except BaseException:
        os.close(tree)
        raise
    return tree


def clone_mount(path: str) -> int:
    """A detached copy of the mount at ``path`` alone (its file system, not a new mount of its
    device), as this thread's namespace has it; the caller closes it."""
    return _check(_libc.syscall(SYS_OPEN_TREE, AT_FDCWD, path.encode(), OPEN_TREE_CLONE | O_CLOEXEC), f"clone {path}")


def attach_here(tree: int, path: str) -> None:
    """Attach detached mount ``tree`` onto directory ``path`` in this thread's mount namespace."""
    flags = MOVE_MOUNT_F_EMPTY_PATH
    _check(_libc.syscall(SYS_MOVE_MOUNT, tree, b"", AT_FDCWD, path.encode(), flags), f"attach a mount onto {path}")


def _move_onto(tree: int, fd: int, what: str) -> None:
    """Attach detached mount ``tree`` onto the directory or regular file open as ``fd``."""
    mode = os.fstat(fd).st_mode
    if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
        raise InfrastructureError(f"{what}: the target is neither a directory nor a regular file")
    flags = MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH
    _check(_libc.syscall(SYS_MOVE_MOUNT, tree, b"", fd, b"", flags), what)


def _attach(qemu_pid: int, tree: int, target: Callable[[], int], what: str) -> None:
    """In QEMU's mount namespace, attach detached mount ``tree`` onto what ``target()`` opens there
    (O_PATH); both descriptors are closed whatever happens."""
    try:

        def attach() -> None:
            fd = target()
            try:
                _move_onto(tree, fd, what)
            finally:
                os.close(fd)

        in_namespace(qemu_pid, what, attach)
    finally:
        os.close(tree)


def _relative(target: str, beneath: str, what: str) -> str:
    rel = os.path.relpath(os.path.abspath(target), os.path.abspath(beneath))
    if rel.startswith("..") or os.path.isabs(rel):
        raise InfrastructureError(f"{what}: the target is not below {beneath}")
    return rel


def bind(
    qemu_pid: int,
    source: str | os.PathLike[str] | int,
    target: str | os.PathLike[str],
    readonly: bool,
    recursive: bool = False,
    propagation: str = "private",
    *,
    beneath: str | os.PathLike[str],
    root_as: int = 0,
) -> None:
    """Bind host path ``source`` (or what the descriptor ``source`` from ``resolve`` names; and
    the mounts below it) onto ``target`` in QEMU's mount
    namespace; ``target`` is an existing directory or regular file of the same kind below
    ``beneath`` (the 9p export, which the guest can change: it is resolved from ``beneath``
    without following a symlink, and nothing else is mounted onto). Read-only when asked
    (``recursive``: the mounts below it too). ``propagation`` (a key of PROPAGATION): whether
    mounts the host makes below ``source`` later reach the bind: never (private), or as a slave
    or a peer of the source. ``root_as`` (QEMU's uid): the bind, and every mount below it, is
    idmapped so that files of the host's root are that uid's (see the module docstring)."""
    src = source if isinstance(source, int) else os.fspath(source)
    dst = os.fspath(target)
    what = f"bind {os.readlink(f'/proc/self/fd/{src}') if isinstance(src, int) else src} onto {dst}"
    rel = _relative(dst, os.fspath(beneath), what)
    tree = _clone(
        src, what, subtree=True, propagation=propagation, readonly=readonly, recursive=recursive, root_as=root_as
    )

    def open_target() -> int:
        try:
            root = os.open(beneath, O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                return shared_tree.open_beneath(root, rel, O_PATH | os.O_NOFOLLOW)
            finally:
                os.close(root)
        except OSError as exc:
            raise InfrastructureError(f"{what}: {exc.strerror} (the guest may have changed the target)") from None

    _attach(qemu_pid, tree, open_target, what)


def _open_in_bind(beneath: str, bound: str, rel: str, what: str) -> int:
    """``bound/rel`` (O_PATH) in the current mount namespace, where ``bound`` is the mount point of
    a bind below ``beneath``: ``bound`` is reached from ``beneath`` without a symlink or a mount
    crossing, then ``rel`` inside the bind without a symlink or ``..``, crossing only the mounts
    there (ours: the guest mounts nothing in QEMU's namespace)."""
    bound_rel = _relative(bound, beneath, what)
    try:
        root = os.open(beneath, O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            parent = shared_tree.open_beneath(root, os.path.dirname(bound_rel) or ".", O_PATH | os.O_DIRECTORY)
        finally:
            os.close(root)
        try:  # the last step enters the bind
            top = os.open(os.path.basename(bound_rel), O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
        finally:
            os.close(parent)
        if rel in ("", "."):
            return top
        try:
            return shared_tree.open_beneath(top, rel, O_PATH | os.O_NOFOLLOW, cross_mounts=True)
        finally:
            os.close(top)
    except OSError as exc:
        raise InfrastructureError(f"{what}: {exc.strerror} (the guest may have changed the target)") from None


def bind_below(
    qemu_pid: int,
    point: str | os.PathLike[str],
    bound: str | os.PathLike[str],
    rel: str,
    *,
    beneath: str | os.PathLike[str],
    root_as: int,
    readonly: bool,
) -> None:
    """Copy the host's mount at ``point`` alone (not those below it), private, idmapped as
    ``bind`` does, onto ``rel`` inside the bind whose mount point in QEMU's namespace is
    ``bound`` (below ``beneath``): a mount the host made below a volume's source after it was
    bound reaches the guest as the bind's own files do, read-only when the volume is."""
    src = os.fspath(point)
    what = f"bind {src} onto {os.fspath(bound)}/{rel}"
    tree = _clone(src, what, subtree=False, propagation="private", readonly=readonly, recursive=False, root_as=root_as)
    _attach(qemu_pid, tree, lambda: _open_in_bind(os.fspath(beneath), os.fspath(bound), rel, what), what)


def unbind_below(qemu_pid: int, bound: str | os.PathLike[str], rel: str, *, beneath: str | os.PathLike[str]) -> None:
    """Detach the topmost mount at ``rel`` inside the bind at ``bound`` (``bind_below``'s) in
    QEMU's namespace, with what is below it; nothing to do when QEMU or the place is gone."""
    what = f"unmount {os.fspath(bound)}/{rel}"

    def detach() -> None:
        try:
            fd = _open_in_bind(os.fspath(beneath), os.fspath(bound), rel, what)
        except InfrastructureError:
            return  # the bind or the place in it is gone (the guest renamed it: it goes with the bind)
        try:  # the descriptor's own mount, whatever the path now names
            _libc.umount2(f"/proc/thread-self/fd/{fd}".encode(), MNT_DETACH)
        finally:
            os.close(fd)

    if os.path.exists(f"/proc/{qemu_pid}/ns/mnt"):
        in_namespace(qemu_pid, what, detach)


def unbind_all(qemu_pid: int, path: str | os.PathLike[str], keep: Iterable[str | os.PathLike[str]] = ()) -> None:
    """Detach every mount at or below ``path`` in QEMU's mount namespace, except those at or below
    a path of ``keep``. Raises InfrastructureError if one stays; nothing to do when QEMU is gone
    (its namespace went too)."""
    where = os.fspath(path)
    kept = tuple(os.path.abspath(k) for k in keep)

    def ours(points: list[str]) -> list[str]:
        return [p for p in points if not any(p == k or p.startswith(k + "/") for k in kept)]

    def detach() -> None:
        for point in ours(mounts_under(where)):
            _libc.umount2(point.encode(), MNT_DETACH | UMOUNT_NOFOLLOW)
        left = ours(mounts_under(where))
        if left:
            raise InfrastructureError(f"{len(left)} mounts stay under {where} in QEMU's namespace, e.g. {left[0]}")

    if not os.path.exists(f"/proc/{qemu_pid}/ns/mnt"):
        return
    in_namespace(qemu_pid, f"unmount {where}", detach)


def remove_tree(root: str | os.PathLike[str], rel: str | os.PathLike[str]) -> None:
    """Delete ``root/rel`` and what is below it, where a guest may have put anything below
    ``root`` (``vmsandbox.adapters.shared_tree``: no symlink followed, nothing but directories
    opened); refuses (InfrastructureError, the tree left alone) if anything is mounted in it in
    the shim's namespace, so that no delete reaches through a mount."""
    path = os.path.join(root, rel)
    left = mounts_under(path)
    if left:
        raise InfrastructureError(f"not deleting {path}: {left[0]} is mounted in it")
    shared_tree.remove_tree(root, rel)
