"""Unpack image layers (tar, gzip'd or zstd'd tar) into one tree, so that no entry reaches outside
it, verifying each layer's blob digest and uncompressed digest (diff id) as it is read.

Every path is resolved by the kernel with ``openat2(RESOLVE_IN_ROOT)`` relative to the tree's
root: ``..`` stops at the root and symlinks (absolute or relative) resolve as if the tree were
``/``, so a symlinked directory, a hard link or a whiteout can only ever name something inside.
The last component is then created or removed with ``*at`` calls that never follow it. Entry
names that climb above the root (``../x``) refuse the layer.

What the OCI image spec leaves to the runtime, decided here:
- whiteouts (``.wh.NAME``) remove NAME from lower layers, opaque markers (``.wh..wh..opq``) empty
  the directory of lower layers' entries; neither touches entries of its own layer;
- device nodes (character, block) are **not** created: a container's ``/dev`` is the runtime's
  own tmpfs, so an image's nodes could only matter outside it, where they are a way around the
  container's device cgroup. They are counted and logged. FIFOs are created;
- setuid/setgid/sticky bits, owners and file capabilities (``security.capability``) are kept as the
  image says, as containerd does: images need them (``ping``, ``su``), and the tree lives in a
  0700 directory no unprivileged host user can enter. Other xattrs except ``user.*`` are dropped;
- limits: uncompressed bytes and entries per image (a gzip bomb stops at the byte limit).

Verification is in the same pass as unpacking: the compressed bytes and the decompressed stream
are hashed as the tar reader consumes them, the rest of each (end-of-archive padding) is read to
the end, and a layer whose blob or uncompressed digest differs from what it should be refuses the
layer. The tree is being built in a work directory its owner discards on any error, so what a
lying layer wrote before the check is never used.
"""

from __future__ import annotations

import ctypes
import errno
import gzip
import hashlib
import logging
import os
import shutil
import stat
import tarfile
import zlib
from dataclasses import dataclass
from typing import Protocol

import zstandard

from vmsandbox.errors import CannotFit, InternalError, InvalidArgument

log = logging.getLogger(__name__)

_SYS_OPENAT2 = 437  # x86_64 and aarch64 share this number
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_IN_ROOT = 0x10
_O_PATH = getattr(os, "O_PATH", 0o10000000)
WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
_KEPT_XATTRS = ("security.capability",)
_KEPT_XATTR_PREFIXES = ("user.",)
_CHUNK = 1 << 20
_MAX_CACHED_DIRS = 256  # directory fds kept open between entries of a layer
_MAX_LINKS = 40  # symlinks followed while making one directory, as the kernel's own limit


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def open_in_root(root_fd: int, path: str, flags: int) -> int:
    """``openat2(root_fd, path, flags, RESOLVE_IN_ROOT)``: ``path`` resolved as if ``root_fd`` were ``/``."""
    how = _OpenHow(flags | os.O_CLOEXEC, 0, _RESOLVE_IN_ROOT | _RESOLVE_NO_MAGICLINKS)
    fd = _libc.syscall(_SYS_OPENAT2, root_fd, (path or ".").encode(), ctypes.byref(how), ctypes.sizeof(how))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return int(fd)


@dataclass(frozen=True)
class Limits:
    max_bytes: int = 32 << 30  # uncompressed bytes of all layers of one image
    max_entries: int = 2_000_000  # tar entries of all layers of one image


@dataclass
class LayerStats:
    entries: int = 0
    bytes: int = 0  # uncompressed tar stream bytes
    whiteouts: int = 0
    devices_skipped: int = 0
    other_skipped: int = 0
    digest: str = ""  # sha256 of the blob as read
    diff_id: str = ""  # sha256 of the uncompressed tar stream


class _Readable(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...


class _Hashing:
    """A read-only file object over ``inner`` that hashes (sha256) and counts what it reads and
    refuses to read past ``budget`` bytes."""

    def __init__(self, inner: _Readable, budget: int, where: str) -> None:
        self.inner = inner
        self.budget = budget
        self.read_bytes = 0
        self.where = where
        self._hash = hashlib.sha256()

    def read(self, size: int = -1) -> bytes:
        data = self.inner.read(size if size >= 0 else _CHUNK)
        self.read_bytes += len(data)
        if self.read_bytes > self.budget:
            raise CannotFit(f"{self.where}: the image unpacks to more than the limit of bytes per image")
        self._hash.update(data)
        return data

    def drain(self) -> None:
        """Read (and hash) what is left, up to the budget."""
        while self.read(_CHUNK):
            pass

    @property
    def digest(self) -> str:
        return "sha256:" + self._hash.hexdigest()


def _decompressed(raw: _Hashing, compression: str, where: str) -> _Readable:
    if compression == "gzip":
        return gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[call-overload, no-any-return]
    if compression == "zstd":
        return zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)  # type: ignore[arg-type]
    if compression == "tar":
        return raw
    raise InvalidArgument(f"{where}: {compression[:50]!r} layers are not supported (tar, gzip or zstd)")


def _clamped(parts: tuple[str, ...]) -> tuple[str, ...]:
    """Components with ``.``/``..`` applied as at ``/``: ``..`` at the root stays there."""
    out: list[str] = []
    for comp in parts:
        if comp in ("", "."):
            continue
        if comp == "..":
            if out:
                out.pop()
            continue
        out.append(comp)
    return tuple(out)


def clean_name(name: str, where: str) -> tuple[str, ...]:
    """A tar entry name as path components under the root; ``..`` climbing out refuses the layer."""
    parts: list[str] = []
    for comp in name.split("/"):
        if comp in ("", "."):
            continue
        if comp == "..":
            if not parts:
                raise InvalidArgument(f"{where}: entry {name[:200]!r} climbs out of the image root")
            parts.pop()
            continue
        parts.append(comp)
    return tuple(parts)


class Tree:
    """One image's tree being built from its layers, bottom layer first."""

    def __init__(self, root: str, limits: Limits) -> None:
        self.root = root
        self.limits = limits
        self.root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self.bytes = 0
        self.entries = 0
        self._dirs: dict[tuple[str, ...], int] = {}
        self._stale: list[int] = []
        self._is_root = os.geteuid() == 0

    def close(self) -> None:
        self._forget_dirs()
        self._close_stale()
        os.close(self.root_fd)

    def _forget_dirs(self) -> None:
        """Stop trusting cached directory fds (a removal may have taken what they name); callers may
        still hold one, so they are closed only when the layer ends."""
        self._stale.extend(self._dirs.values())
        self._dirs.clear()

    def _close_stale(self) -> None:
        for fd in self._stale:
            os.close(fd)
        self._stale.clear()

    # -- resolution -----------------------------------------------------------------------------
    def _dir(self, parts: tuple[str, ...], create: bool, depth: int = 0) -> int | None:
        """An O_PATH fd of directory ``parts`` (resolved in root), made when ``create``; None if absent.

        A dangling symlink in the way is followed inside the tree, and its target made, as
        ``mkdir -p`` in a chroot would."""
        if not parts:
            return self.root_fd
        cached = self._dirs.get(parts)
        if cached is not None:
            return cached
        try:
            fd = open_in_root(self.root_fd, "/".join(parts), _O_PATH | os.O_DIRECTORY)
        except FileNotFoundError:
            if not create:
                return None
            if depth > _MAX_LINKS:
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), "/".join(parts)) from None
            parent = self._dir(parts[:-1], create=True, depth=depth + 1)
            assert parent is not None
            try:
                os.mkdir(parts[-1], 0o755, dir_fd=parent)
            except FileExistsError:
                target = os.readlink(parts[-1], dir_fd=parent)  # not a link: the open below says what it is
                here = () if target.startswith("/") else self._inside(parent)
                self._dir(_clamped((*here, *target.split("/"))), create=True, depth=depth + 1)
            fd = open_in_root(self.root_fd, "/".join(parts), _O_PATH | os.O_DIRECTORY)
        if len(self._dirs) > _MAX_CACHED_DIRS:
            self._forget_dirs()
        self._dirs[parts] = fd
        return fd

    def _inside(self, fd: int) -> tuple[str, ...]:
        """Where directory ``fd`` is, as components under the root."""
        rel = os.path.relpath(os.readlink(f"/proc/self/fd/{fd}"), os.readlink(f"/proc/self/fd/{self.root_fd}"))
        return _clamped(tuple(rel.split("/")))

    def _remove(self, parent: int, name: str) -> None:
        """Remove ``name`` in ``parent`` (a whole directory tree included), never following a link."""
        try:
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(name, dir_fd=parent)
            self._forget_dirs()  # cached fds may name what was removed
        else:
            os.unlink(name, dir_fd=parent)

    # -- one layer ------------------------------------------------------------------------------
    def apply(self, path: str, compression: str, where: str, *, digest: str = "", diff_id: str = "") -> LayerStats:
        """Apply the layer blob at ``path``; when given, its ``digest`` (of the blob) and ``diff_id``
        (of the uncompressed tar) are checked in the same pass, and a mismatch refuses the layer."""
        stats = LayerStats()
        created: set[tuple[str, ...]] = set()
        dir_meta: list[tuple[tuple[str, ...], tarfile.TarInfo]] = []
        with open(path, "rb") as f:
            raw = _Hashing(f, 1 << 62, where)
            counted = _Hashing(_decompressed(raw, compression, where), self.limits.max_bytes - self.bytes, where)
            try:
                with tarfile.open(fileobj=counted, mode="r|") as tar:  # type: ignore[call-overload]
                    for member in tar:
                        self._entry(tar, member, where, stats, created, dir_meta)
                counted.drain()  # the end-of-archive padding is part of the diff id
                raw.drain()
            except (tarfile.TarError, EOFError, gzip.BadGzipFile, zlib.error, zstandard.ZstdError) as exc:
                raise InvalidArgument(f"{where}: not a valid layer: {str(exc)[:200]}") from None
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise CannotFit(f"{where}: no space left on the image store while unpacking") from None
                raise InvalidArgument(f"{where}: cannot unpack: {exc.strerror or exc}") from None
            stats.bytes = counted.read_bytes
            stats.digest, stats.diff_id = raw.digest, counted.digest
        if digest and stats.digest != digest:
            raise InvalidArgument(f"{where}: the blob's content has digest {stats.digest}, not {digest}")
        if diff_id and stats.diff_id != diff_id:
            raise InvalidArgument(
                f"{where}: its uncompressed content has digest {stats.diff_id}, "
                f"but the config's rootfs.diff_ids says {diff_id}"
            )
        self.bytes += stats.bytes
        for parts, member in reversed(dir_meta):  # deepest last-seen first; mtimes after the contents
            self._set_dir_meta(parts, member)
        self._forget_dirs()
        self._close_stale()
        return stats

    def _entry(
        self,
        tar: tarfile.TarFile,
        member: tarfile.TarInfo,
        where: str,
        stats: LayerStats,
        created: set[tuple[str, ...]],
        dir_meta: list[tuple[tuple[str, ...], tarfile.TarInfo]],
    ) -> None:
        self._close_stale()  # no fd is held from one entry to the next
        stats.entries += 1
        self.entries += 1
        if self.entries > self.limits.max_entries:
            raise CannotFit(f"{where}: the image has more than {self.limits.max_entries} entries")
        parts = clean_name(member.name, where)
        if not parts:
            return  # the root itself: its metadata stays ours
        parent_parts, base = parts[:-1], parts[-1]
        if base.startswith(WHITEOUT):
            stats.whiteouts += 1
            self._whiteout(parent_parts, base, where, member.name, created)
            return
        if member.ischr() or member.isblk():
            stats.devices_skipped += 1
            return
        if not (member.isreg() or member.isdir() or member.issym() or member.islnk() or member.isfifo()):
            stats.other_skipped += 1
            return
        try:
            parent = self._dir(parent_parts, create=True)
        except OSError as exc:
            raise InvalidArgument(
                f"{where}: entry {member.name[:200]!r}: parent is not a directory ({exc.strerror})"
            ) from None
        assert parent is not None
        created.add(parts)
        if member.isdir():
            try:
                st = os.stat(base, dir_fd=parent, follow_symlinks=False)
                if not stat.S_ISDIR(st.st_mode):
                    self._remove(parent, base)
                    os.mkdir(base, 0o755, dir_fd=parent)
            except FileNotFoundError:
                os.mkdir(base, 0o755, dir_fd=parent)
            dir_meta.append((parts, member))
            return
        if member.islnk():
            target = clean_name(member.linkname, where)
            if target == parts:
                return
            tparent = self._dir(target[:-1], create=False) if target else None
            if tparent is None or not target:
                raise InvalidArgument(f"{where}: hard link {member.name[:200]!r} names a missing target")
            self._remove(parent, base)
            try:
                os.link(target[-1], base, src_dir_fd=tparent, dst_dir_fd=parent, follow_symlinks=False)
            except FileNotFoundError:
                raise InvalidArgument(f"{where}: hard link {member.name[:200]!r} names a missing target") from None
            except PermissionError:
                raise InvalidArgument(f"{where}: hard link {member.name[:200]!r} names a directory") from None
            return
        self._remove(parent, base)
        if member.issym():
            os.symlink(member.linkname, base, dir_fd=parent)
            self._chown(base, parent, member)
            os.utime(base, ns=(int(member.mtime * 10**9),) * 2, dir_fd=parent, follow_symlinks=False)
            return
        if member.isfifo():
            os.mkfifo(base, 0o600, dir_fd=parent)
            fd = os.open(base, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
        else:
            fd = os.open(
                base, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=parent
            )
            src = tar.extractfile(member)
            if src is None:
                os.close(fd)
                raise InternalError(f"{where}: no data for {member.name[:200]!r}")
            with open(fd, "wb", closefd=False) as out:
                shutil.copyfileobj(src, out, _CHUNK)
        try:
            self._meta(fd, member)
        finally:
            os.close(fd)

    def _whiteout(
        self, parent_parts: tuple[str, ...], base: str, where: str, name: str, created: set[tuple[str, ...]]
    ) -> None:
        parent = self._dir(parent_parts, create=False)
        if parent is None:
            return
        if base == OPAQUE:
            listing = open_in_root(self.root_fd, "/".join(parent_parts), os.O_RDONLY | os.O_DIRECTORY)
            try:
                children = os.listdir(listing)
            finally:
                os.close(listing)
            for child in children:
                if (*parent_parts, child) not in created:
                    self._remove(parent, child)
            return
        target = base[len(WHITEOUT) :]
        if target in ("", ".", "..") or "/" in target:
            raise InvalidArgument(f"{where}: whiteout {name[:200]!r} names no entry of its directory")
        if (*parent_parts, target) not in created:
            self._remove(parent, target)

    def _chown(self, name: str, parent: int, member: tarfile.TarInfo) -> None:
        if self._is_root:
            os.chown(name, member.uid, member.gid, dir_fd=parent, follow_symlinks=False)

    def _meta(self, fd: int, member: tarfile.TarInfo) -> None:
        if self._is_root:
            os.fchown(fd, member.uid, member.gid)
        os.fchmod(fd, member.mode & 0o7777)  # after chown, which clears setuid/setgid
        for key, value in member.pax_headers.items():
            if not key.startswith("SCHILY.xattr."):
                continue
            attr = key[len("SCHILY.xattr.") :]
            if attr in _KEPT_XATTRS or attr.startswith(_KEPT_XATTR_PREFIXES):
                try:
                    os.setxattr(fd, attr, value.encode("utf-8", "surrogateescape"))
                except OSError as exc:
                    log.debug("xattr %s not set: %s", attr, exc)
        os.utime(fd, ns=(int(member.mtime * 10**9),) * 2)

    def _set_dir_meta(self, parts: tuple[str, ...], member: tarfile.TarInfo) -> None:
        try:
            fd = open_in_root(self.root_fd, "/".join(parts), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            return  # removed later in the same layer, or replaced by a non-directory
        try:
            self._meta(fd, member)
        finally:
            os.close(fd)


def tree_usage(root: str, max_inodes: int | None = None) -> tuple[int, int]:
    """(bytes on disk, inodes) of a tree an image unpacked (its entries bounded by
    ``image_max_entries``); hard links counted once. With ``max_inodes`` the walk stops as soon as
    it has counted more (a tree the store did not unpack itself, whose size nothing bounded yet).
    Iterative: an image may nest directories past Python's recursion limit (``os.walk`` recurses)."""
    seen: set[int] = set()
    used = inodes = 0
    pending = [root]
    while pending and (max_inodes is None or inodes <= max_inodes):
        try:
            with os.scandir(pending.pop()) as entries:
                for e in entries:
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if e.is_dir(follow_symlinks=False):
                        pending.append(e.path)
                    if st.st_ino in seen:
                        continue
                    seen.add(st.st_ino)
                    used += st.st_blocks * 512
                    inodes += 1
        except OSError:
            continue
    return used, inodes


def unpack(root: str, layers: list[tuple[str, str, str]], limits: Limits) -> list[LayerStats]:
    """Apply ``layers`` (blob path, compression, label for messages) in order into ``root``."""
    tree = Tree(root, limits)
    try:
        return [tree.apply(path, compression, where) for path, compression, where in layers]
    finally:
        tree.close()
