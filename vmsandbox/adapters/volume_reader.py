"""Reads one version of a kubelet atomic-writer volume from the host (``vmsandbox.kubelet_volumes``).

The kubelet's pod directory is trusted, but what is read here is still bounded: at most
``MAX_ENTRIES`` entries, ``MAX_BYTES`` of content and ``MAX_DEPTH`` levels, read iteratively from
directory descriptors with ``O_NOFOLLOW`` (no symlink below the volume is followed; a version
directory holds none). The kubelet may swap ``..data`` while a version is read and then delete
that version: a read that loses a file that way starts again from the new ``..data`` (three
times at most), and a version is returned only if ``..data`` still named it at the end.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat

from vmsandbox.errors import InfrastructureError, InvalidArgument
from vmsandbox.kubelet_volumes import (
    DATA_LINK,
    MAX_BYTES,
    MAX_DEPTH,
    MAX_ENTRIES,
    Entry,
    Meta,
    VolumeTree,
    is_version,
    valid_name,
)

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_TRIES = 3


class _Swapped(Exception):
    """The version being read went away under us (the kubelet wrote a newer one)."""


def _meta(st: os.stat_result) -> Meta:
    return Meta(stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid)


def read_version(volume: str) -> str:
    """The name of the version directory ``<volume>/..data`` points to; InfrastructureError when
    there is none (not yet written, or the volume is gone)."""
    try:
        target = os.readlink(os.path.join(volume, DATA_LINK))
    except OSError as exc:
        raise InfrastructureError(f"volume {volume}: no {DATA_LINK} link: {exc.strerror}") from None
    if not is_version(target):
        raise InfrastructureError(f"volume {volume}: {DATA_LINK} points to {target[:64]!r}, not a version directory")
    return target


def _read_file(dir_fd: int, name: str, size_left: int, where: str) -> tuple[os.stat_result, bytes]:
    fd = os.open(name, _FILE, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidArgument(f"{where}: not a regular file")
        chunks, got = [], 0
        while True:
            b = os.read(fd, min(1 << 20, size_left - got + 1))
            if not b:
                break
            got += len(b)
            if got > size_left:
                raise InvalidArgument(f"{where}: the volume holds more than {MAX_BYTES} bytes, the most a VM pod takes")
            chunks.append(b)
        return st, b"".join(chunks)
    finally:
        os.close(fd)


def _read(volume: str, version: str) -> VolumeTree:
    try:
        vfd = os.open(volume, _DIR)
    except OSError as exc:
        raise InfrastructureError(f"volume {volume}: {exc.strerror}") from None
    try:
        root = _meta(os.fstat(vfd))
        try:
            top_fd = os.open(version, _DIR, dir_fd=vfd)
        except FileNotFoundError:
            raise _Swapped from None
        entries: list[Entry] = []
        size = 0
        stack: list[tuple[int, str, int]] = [(top_fd, "", 0)]
        top = _meta(os.fstat(top_fd))
        try:
            while stack:
                fd, rel, depth = stack.pop()
                try:
                    with os.scandir(fd) as it:
                        names = sorted(e.name for e in it)
                    for name in names:
                        path = f"{rel}{name}"
                        where = f"volume {volume}: {version}/{path}"
                        if not valid_name(name) or (not rel and name.startswith("..")):
                            raise InvalidArgument(f"{where}: a name the guest cannot be given")
                        if len(entries) >= MAX_ENTRIES:
                            raise InvalidArgument(
                                f"volume {volume}: more than {MAX_ENTRIES} files and directories, "
                                "the most a VM pod takes"
                            )
                        try:
                            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                            if stat.S_ISDIR(st.st_mode):
                                if depth + 1 > MAX_DEPTH:
                                    raise InvalidArgument(f"{where}: deeper than {MAX_DEPTH} directories")
                                entries.append(Entry(path, "dir", _meta(st)))
                                stack.append((os.open(name, _DIR, dir_fd=fd), f"{path}/", depth + 1))
                            elif stat.S_ISREG(st.st_mode):
                                st, data = _read_file(fd, name, MAX_BYTES - size, where)
                                size += len(data)
                                entries.append(Entry(path, "file", _meta(st), data))
                            else:
                                raise InvalidArgument(f"{where}: neither a regular file nor a directory")
                        except FileNotFoundError:
                            raise _Swapped from None
                finally:
                    os.close(fd)
        finally:
            for fd, _, _ in stack:
                os.close(fd)
    finally:
        os.close(vfd)
    # parents before children: the stack order is depth-first, each directory listed before its entries
    return VolumeTree(version, root, top, tuple(entries))


def read_tree(volume: str) -> VolumeTree:
    """The version ``<volume>/..data`` names, read whole. InvalidArgument when it passes the
    bounds or holds what a guest cannot be given (a symlink, a device, a FIFO); InfrastructureError
    when it cannot be read or keeps changing."""
    for _ in range(_TRIES):
        version = read_version(volume)
        try:
            tree = _read(volume, version)
        except _Swapped:
            continue
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENOTDIR):
                continue
            raise InfrastructureError(f"volume {volume}: {exc.strerror}") from None
        with contextlib.suppress(InfrastructureError):
            if read_version(volume) != version:
                continue
        return tree
    raise InfrastructureError(f"volume {volume}: changed {_TRIES} times while being read")
