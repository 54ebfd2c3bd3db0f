"""Host-side file operations inside a tree a guest can write (a sandbox's 9p share).

The guest can replace anything below the share's root at any moment: with a symlink to a host
path, a FIFO (an open of it blocks), a device-like node, a sparse file, a directory nested past
``PATH_MAX``. So every path here is given as a trusted root (a directory only the host made and
the guest cannot replace, e.g. the export's root itself) and a relative path below it, and is
resolved by the kernel with ``openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV)``
from a descriptor of that root: no symlink is followed, nothing leaves the tree or crosses into a
mount below it. Only directories are ever opened (``O_DIRECTORY | O_NONBLOCK``, which fails on
anything else without blocking); files are created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and
never opened for reading; deletion is ``unlinkat``/``rmdir`` relative to a directory descriptor.
A tree that does not look as expected is an InfrastructureError naming the path: the guest
changed it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from vmsandbox.errors import InfrastructureError

_SYS_OPENAT2 = 437  # x86_64 and aarch64 share this number
_RESOLVE_NO_XDEV = 0x01
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
_RESOLVE = _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS | _RESOLVE_NO_XDEV
_O_PATH = getattr(os, "O_PATH", 0o10000000)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_MAX_DEPTH = 32
"""Directories deeper than this are moved up to the top of the tree being removed (so neither
descriptors nor path lengths grow with a guest's nesting; the walk keeps its own stack, so
nothing recurses either)."""


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def open_beneath(dir_fd: int, rel: str, flags: int = _DIR_FLAGS, *, cross_mounts: bool = False) -> int:
    """``rel`` below ``dir_fd``, resolved without symlinks, ``..`` above it or (unless
    ``cross_mounts``) mount crossings."""
    how = _OpenHow(flags | os.O_CLOEXEC, 0, _RESOLVE & ~_RESOLVE_NO_XDEV if cross_mounts else _RESOLVE)
    fd = _libc.syscall(_SYS_OPENAT2, dir_fd, (rel or ".").encode(), ctypes.byref(how), ctypes.sizeof(how))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), rel)
    return int(fd)


def _parts(rel: str | os.PathLike[str]) -> list[str]:
    parts = [p for p in Path(rel).parts if p not in ("", ".")]
    if Path(rel).is_absolute() or ".." in parts:
        raise ValueError(f"not a relative path inside the tree: {os.fspath(rel)!r}")
    return parts


def _refused(root: Path, rel: str | os.PathLike[str], exc: OSError) -> InfrastructureError:
    shown = root / rel
    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EXDEV, errno.EEXIST):
        return InfrastructureError(f"{shown} is not the directory the host made (the guest changed it): {exc.strerror}")
    return InfrastructureError(f"{shown}: {exc.strerror}")


@contextlib.contextmanager
def directory(root: str | os.PathLike[str], rel: str | os.PathLike[str], create: bool = False) -> Iterator[int]:
    """A descriptor of directory ``root/rel`` (made, with its parents, when ``create``)."""
    root = Path(root)
    try:
        fd = os.open(root, _DIR_FLAGS)
    except OSError as exc:
        raise InfrastructureError(f"{root}: {exc.strerror}") from None
    try:
        for part in _parts(rel):
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
            try:
                child = open_beneath(fd, part)
            except OSError as exc:
                raise _refused(root, rel, exc) from None
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def make_dirs(root: str | os.PathLike[str], rel: str | os.PathLike[str]) -> None:
    """Directory ``root/rel`` and its parents exist (as directories, not symlinks)."""
    with directory(root, rel, create=True):
        pass


def make_empty(root: str | os.PathLike[str], rel: str | os.PathLike[str], is_dir: bool) -> None:
    """A new empty directory or regular file ``root/rel`` (a mount target); its parent exists."""
    *parent, name = _parts(rel)
    with directory(root, os.path.join(*parent) if parent else ".") as fd:
        try:
            if is_dir:
                os.mkdir(name, 0o755, dir_fd=fd)
            else:
                os.close(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=fd))
        except OSError as exc:
            raise _refused(Path(root), rel, exc) from None


def write_once(root: str | os.PathLike[str], rel: str | os.PathLike[str], data: bytes, mode: int = 0o644) -> bool:
    """Writes regular file ``root/rel`` (its parent exists) unless that name exists already;
    True if written. The file is made beside it and renamed into place, neither step following
    a symlink (a rename replaces a symlink, never what it points at)."""
    *parent, name = _parts(rel)
    with directory(root, os.path.join(*parent) if parent else ".") as fd:
        try:
            os.stat(name, dir_fd=fd, follow_symlinks=False)
            return False
        except FileNotFoundError:
            pass
        tmp = f".{name}.tmp"
        with contextlib.suppress(FileNotFoundError, IsADirectoryError):
            os.unlink(tmp, dir_fd=fd)
        try:
            out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=fd)
        except OSError as exc:
            raise _refused(Path(root), rel, exc) from None
        try:
            os.fchmod(out, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(out, view) :]
        finally:
            os.close(out)
        os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
        return True


_moved = itertools.count()
_MAX_ENTRIES = 1_000_000
"""Entries one removal lists at most (so at most that many names are held at once); what is left
stays for the next removal. A sandbox's share is a file system of its own (``share_image``), which
bounds how many entries a guest can make and goes whole with its image when the sandbox goes."""


def _listing(fd: int, budget: list[int]) -> list[tuple[str, bool]]:
    """The entries of directory ``fd`` as (name, is a directory), each taking one of ``budget[0]``."""
    out = []
    with os.scandir(fd) as entries:
        for e in entries:
            if budget[0] <= 0:
                break
            budget[0] -= 1
            out.append((e.name, e.is_dir(follow_symlinks=False)))
    return out


def _empty(top: int, start: int, spill: list[str], budget: list[int]) -> None:
    """Deletes everything in directory ``start``, iteratively: at most ``_MAX_DEPTH`` descriptors
    are open at once, and directories found that deep are renamed into ``top`` (names added to
    ``spill``) to be emptied from there. Each entry listed takes one from ``budget``; once it is
    spent, what was not listed stays."""
    # each level: its descriptor, the entries still to delete, its name in the level above
    stack: list[tuple[int, list[tuple[str, bool]], str]] = [(start, _listing(start, budget), "")]
    try:
        while stack:
            fd, names, own = stack[-1]
            if not names:
                stack.pop()
                if stack:  # a subdirectory is empty now (unless the budget ran out): close, remove it
                    os.close(fd)
                    with contextlib.suppress(OSError):
                        os.rmdir(own, dir_fd=stack[-1][0])
                continue
            name, is_dir = names.pop()
            if not is_dir:
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=fd)
                continue
            if len(stack) > _MAX_DEPTH:
                moved = f".vmsandbox-deep-{os.getpid()}-{next(_moved)}"
                with contextlib.suppress(OSError):
                    os.rename(name, moved, src_dir_fd=fd, dst_dir_fd=top)
                    spill.append(moved)
                continue
            try:
                child = open_beneath(fd, name)
            except OSError as exc:
                if exc.errno in (errno.ENOTDIR, errno.ELOOP):  # replaced by a file or a symlink meanwhile
                    with contextlib.suppress(OSError):
                        os.unlink(name, dir_fd=fd)
                continue  # gone, or a mount point (EXDEV): left alone
            try:
                listed = _listing(child, budget)
            except BaseException:
                os.close(child)
                raise
            stack.append((child, listed, name))
    finally:
        for fd, _, _ in stack[1:]:
            os.close(fd)


def remove_tree(root: str | os.PathLike[str], rel: str | os.PathLike[str]) -> None:
    """Deletes ``root/rel`` and everything below it, whatever it is (a symlink or a file is
    unlinked, never followed or opened). Mount points below it are not entered (they stay).
    Iterative and bounded: at most ``_MAX_DEPTH`` descriptors open and ``_MAX_ENTRIES`` entries
    listed, however deep or wide the guest made the tree (the rest stays for the next removal)."""
    *parent, name = _parts(rel)
    try:
        with directory(root, os.path.join(*parent) if parent else ".") as pfd:
            _remove_entry(pfd, name)
    except InfrastructureError:
        return  # no such parent directory (or the guest replaced it): nothing of ours is below


def _remove_entry(pfd: int, name: str) -> None:
    try:
        st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
    except FileNotFoundError:
        return
    try:
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", name)
        top = open_beneath(pfd, name)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=pfd)
        return
    try:
        spill: list[str] = []
        budget = [_MAX_ENTRIES]
        _empty(top, top, spill, budget)
        while spill and budget[0] > 0:
            deep = spill.pop()
            try:
                fd = open_beneath(top, deep)
            except OSError:
                continue
            try:
                _empty(top, fd, spill, budget)
            finally:
                os.close(fd)
            with contextlib.suppress(OSError):
                os.rmdir(deep, dir_fd=top)
    finally:
        os.close(top)
    with contextlib.suppress(OSError):
        os.rmdir(name, dir_fd=pfd)
