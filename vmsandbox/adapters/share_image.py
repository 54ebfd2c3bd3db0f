"""A file system of its own for each sandbox's directory: a sparse ext4 image, loop-mounted.

Everything a guest can write on the host (its 9p share) is below its sandbox's directory, so that
directory is made a mount of an ext4 image of a fixed size (``vmsandbox.shared_storage`` sizes it):
a guest that writes past it gets ``ENOSPC`` and the host's disk and other pods are untouched; what
it holds is read in O(1) with ``statvfs`` instead of walking a tree the guest shapes (which a guest
can nest past any recursion limit).

The image is a sparse file (root's, 0600) made with ``mkfs.ext4`` (4 KiB blocks, no journal, no
blocks reserved for root, no room kept for growing it; its root directory owned as asked). It is
attached to a free loop device with ``LOOP_CONFIGURE`` and ``LO_FLAGS_AUTOCLEAR`` (the device lets
go of the file by itself once the file system on it is unmounted everywhere, and at once if the
mount fails or this process dies first) and mounted ``nosuid,nodev,noexec,noatime`` with
``discard``: what the guest deletes is punched out of the image, so the host gets its space back.
Unmounting is lazy (``MNT_DETACH``): a QEMU that still holds the file system keeps it until it
exits, then the loop device and the (deleted) image go.

Never mount an image twice: two loop devices over one ext4 would corrupt it. ``mount`` is only
called on an image ``make`` has just made.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
import subprocess
import time
from dataclasses import dataclass

from vmsandbox.adapters import binds
from vmsandbox.errors import InfrastructureError

LOOP_CTL_GET_FREE = 0x4C82
LOOP_CONFIGURE = 0x4C0A
LO_FLAGS_AUTOCLEAR = 4
LOOP_MAJOR = 7
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_NOATIME = 0x2, 0x4, 0x8, 0x400
MNT_DETACH = 0x2
UMOUNT_NOFOLLOW = 0x8
MOUNT_FLAGS = MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOATIME
MOUNT_DATA = b"discard,noinit_itable"
"""``discard``: a deleted file's blocks are punched out of the image; ``noinit_itable``: the
inode tables of the fresh sparse image read as zeros already, so the kernel does not write them."""
MKFS_TIMEOUT_S = 60
_ATTEMPTS = 16
"""Tries at a free loop device (another process may take the one the kernel offered first)."""

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]


class _LoopInfo64(ctypes.Structure):
    _fields_ = [
        ("lo_device", ctypes.c_uint64),
        ("lo_inode", ctypes.c_uint64),
        ("lo_rdevice", ctypes.c_uint64),
        ("lo_offset", ctypes.c_uint64),
        ("lo_sizelimit", ctypes.c_uint64),
        ("lo_number", ctypes.c_uint32),
        ("lo_encrypt_type", ctypes.c_uint32),
        ("lo_encrypt_key_size", ctypes.c_uint32),
        ("lo_flags", ctypes.c_uint32),
        ("lo_file_name", ctypes.c_uint8 * 64),
        ("lo_crypt_name", ctypes.c_uint8 * 64),
        ("lo_encrypt_key", ctypes.c_uint8 * 32),
        ("lo_init", ctypes.c_uint64 * 2),
    ]


class _LoopConfig(ctypes.Structure):
    _fields_ = [
        ("fd", ctypes.c_uint32),
        ("block_size", ctypes.c_uint32),
        ("info", _LoopInfo64),
        ("reserved", ctypes.c_uint64 * 8),
    ]


@dataclass(frozen=True)
class Usage:
    """What the guest's files take in a sandbox's file system (its own metadata left out)."""

    used_bytes: int
    used_inodes: int
    capacity_bytes: int


def make(image: str | os.PathLike[str], size_bytes: int, owner: int, *, mkfs: str = "mkfs.ext4") -> None:
    """A new sparse image ``image`` of ``size_bytes`` holding an empty ext4 whose root directory is
    ``owner``'s (uid and gid), mode 0700; nothing is left behind when it fails."""
    path = os.fspath(image)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise InfrastructureError(f"cannot make the sandbox's file system image {path}: {exc.strerror}") from None
    try:
        try:
            os.ftruncate(fd, size_bytes)
        except OSError as exc:
            raise InfrastructureError(f"cannot size {path} to {size_bytes} bytes: {exc.strerror}") from None
        finally:
            os.close(fd)
        argv = [
            mkfs,
            "-q",
            "-F",
            "-b",
            "4096",
            "-i",
            "16384",
            "-I",
            "256",
            "-m",
            "0",
            "-O",
            "^has_journal,^resize_inode",
            "-E",
            f"root_owner={owner}:{owner}",
            path,
        ]
        try:
            done = subprocess.run(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                timeout=MKFS_TIMEOUT_S,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise InfrastructureError(f"{mkfs} on {path} failed: {exc}") from None
        if done.returncode != 0:
            out = done.stdout.decode(errors="replace").strip()[-500:]
            raise InfrastructureError(f"{mkfs} on {path} failed (exit {done.returncode}): {out}")
    except BaseException:
        _unlink(path)
        raise


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _loop_device(backing: int) -> int:
    """A descriptor of a free loop device now backed by open file ``backing``, autoclearing."""
    try:
        ctl = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise InfrastructureError(f"no loop devices: /dev/loop-control: {exc.strerror}") from None
    try:
        for _ in range(_ATTEMPTS):
            number = _libc.ioctl(ctl, LOOP_CTL_GET_FREE, None)
            if number < 0:
                err = ctypes.get_errno()
                raise InfrastructureError(f"no free loop device: {os.strerror(err)}")
            dev = f"/dev/loop{number}"
            try:
                fd = os.open(dev, os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:  # a /dev without devtmpfs: make the node
                try:
                    os.mknod(dev, stat.S_IFBLK | 0o600, os.makedev(LOOP_MAJOR, number))
                except FileExistsError:
                    pass
                except OSError as exc:
                    raise InfrastructureError(f"cannot make {dev}: {exc.strerror}") from None
                continue
            except OSError as exc:
                raise InfrastructureError(f"cannot open {dev}: {exc.strerror}") from None
            config = _LoopConfig(fd=backing)
            config.info.lo_flags = LO_FLAGS_AUTOCLEAR
            if _libc.ioctl(fd, LOOP_CONFIGURE, ctypes.byref(config)) == 0:
                return fd
            err = ctypes.get_errno()
            os.close(fd)
            if err != errno.EBUSY:  # EBUSY: another process took it first
                raise InfrastructureError(f"cannot attach {dev}: {os.strerror(err)}")
            time.sleep(0.001)
        raise InfrastructureError(f"no free loop device after {_ATTEMPTS} tries")
    finally:
        os.close(ctl)


def _other_namespace(pid: int | None) -> bool:
    """Whether process ``pid`` (None: none) lives in a mount namespace other than this thread's."""
    if pid is None:
        return False
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink("/proc/thread-self/ns/mnt")
    except OSError as exc:
        raise InfrastructureError(f"the hypervisor daemon (pid {pid}) is gone: {exc.strerror}") from None


def mount(image: str | os.PathLike[str], target: str | os.PathLike[str], *, namespace_pid: int | None = None) -> None:
    """Mount the image ``make`` made onto directory ``target`` through a loop device that frees
    itself (see the module docstring); on failure nothing is attached or mounted.

    ``namespace_pid``: the process (the hypervisor's daemon) whose mount namespace QEMU's is copied
    from. When it is not this thread's (a shim in a mount namespace of its own), the file system is
    mounted there, so that a QEMU started afterwards serves it, and a clone of that mount (the same
    file system, not a second mount of the image) is attached at ``target`` here, so that this
    process sees what the guest sees."""
    if not _other_namespace(namespace_pid):
        _mount_here(image, target)
        return
    assert namespace_pid is not None
    where = os.fspath(target)
    clone: list[int] = []

    def there() -> None:
        _mount_here(image, where)
        try:
            clone.append(binds.clone_mount(where))
        except BaseException:
            unmount(where)
            raise

    binds.in_namespace(namespace_pid, f"mount {os.fspath(image)}", there)
    try:
        binds.attach_here(clone[0], where)
    except BaseException:
        unmount(where, namespace_pid=namespace_pid)
        raise
    finally:
        os.close(clone[0])


def adopt(target: str | os.PathLike[str], namespace_pid: int | None) -> bool:
    """A shim that starts in a mount namespace other than the hypervisor daemon's sees the file
    systems of running sandboxes again: one mounted on ``target`` there is cloned here; whether one
    was. Nothing to do when it is visible here already or mounted nowhere."""
    where = os.fspath(target)
    if is_mount(where) or not _other_namespace(namespace_pid):
        return False
    assert namespace_pid is not None
    clone: list[int] = []

    def there() -> None:
        if is_mount(where):
            clone.append(binds.clone_mount(where))

    binds.in_namespace(namespace_pid, f"look at {where}", there)
    if not clone:
        return False
    try:
        binds.attach_here(clone[0], where)
    finally:
        os.close(clone[0])
    return True


def _mount_here(image: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
    path, where = os.fspath(image), os.fspath(target)
    try:
        backing = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise InfrastructureError(f"cannot open {path}: {exc.strerror}") from None
    try:
        loop = _loop_device(backing)
    finally:
        os.close(backing)  # the loop device holds the file
    try:
        dev = os.readlink(f"/proc/self/fd/{loop}").encode()
        if _libc.mount(dev, where.encode(), b"ext4", MOUNT_FLAGS, MOUNT_DATA) != 0:
            err = ctypes.get_errno()
            raise InfrastructureError(f"cannot mount {path} on {where}: {os.strerror(err)}")
    finally:
        os.close(loop)  # the last opener: if nothing mounted it, autoclear detaches it now


def is_mount(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` (taken as written, not followed) is a mount point."""
    p = os.fspath(path)
    try:
        here = os.lstat(p)
        parent = os.lstat(os.path.join(p, ".."))
    except OSError:
        return False
    return stat.S_ISDIR(here.st_mode) and (here.st_dev != parent.st_dev or here.st_ino == parent.st_ino)


def unmount(target: str | os.PathLike[str], *, namespace_pid: int | None = None) -> bool:
    """Lazily detach every mount stacked on ``target``, here and (``namespace_pid``) in the
    hypervisor daemon's mount namespace; whether one was there. InfrastructureError when one stays."""
    found = _unmount_here(target)
    if _other_namespace(namespace_pid):
        assert namespace_pid is not None
        there: list[bool] = []
        binds.in_namespace(namespace_pid, f"unmount {os.fspath(target)}", lambda: there.append(_unmount_here(target)))
        found = found or there[0]
    return found


def _unmount_here(target: str | os.PathLike[str]) -> bool:
    where = os.fspath(target)
    found = False
    for _ in range(_ATTEMPTS):
        if not is_mount(where):
            return found
        found = True
        if _libc.umount2(where.encode(), MNT_DETACH | UMOUNT_NOFOLLOW) != 0:
            err = ctypes.get_errno()
            if err not in (errno.EINVAL, errno.ENOENT):
                raise InfrastructureError(f"cannot unmount {where}: {os.strerror(err)}")
    if is_mount(where):
        raise InfrastructureError(f"{where} stays mounted after {_ATTEMPTS} unmounts")
    return found


def usage(target: str | os.PathLike[str]) -> Usage | None:
    """What is used in the file system mounted on ``target`` (one ``statvfs``); None when nothing
    is mounted there (a sandbox made before its directory had a file system of its own)."""
    if not is_mount(target):
        return None
    try:
        st = os.statvfs(target)
    except OSError:
        return None
    return Usage(
        used_bytes=(st.f_blocks - st.f_bfree) * st.f_frsize,
        used_inodes=st.f_files - st.f_ffree,
        capacity_bytes=st.f_bavail * st.f_frsize + (st.f_blocks - st.f_bfree) * st.f_frsize,
    )
