"""A read-only, merged view of an image's layer directories on the host (containerd's overlayfs
snapshots), for as long as the store makes the image's disk of it.

Several layers are mounted as an overlay with only ``lowerdir`` (read-only by construction: no
upper layer), in a private directory of the caller's, and unmounted (lazily, should a reader
linger) when the view ends; one layer is its own directory. Whiteouts and opaque directories are
the kernel's to apply, so the view is exactly the tree containerd's containers see.
"""

from __future__ import annotations

import ctypes
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from vmsandbox.containerd_rootfs import ImageLayers
from vmsandbox.errors import InfrastructureError

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MNT_DETACH = 0x2
MOUNT_DATA_MAX = 4096  # mount(2) copies one page of options


@contextmanager
def merged(layers: ImageLayers, work: Path) -> Iterator[Path]:
    """The layers merged, read-only, under ``work`` (a directory only the caller uses)."""
    for d in layers.dirs:
        if not os.path.isdir(d) or os.path.islink(d):
            raise InfrastructureError(f"image layer {d[:256]} is not a directory (was the image removed?)")
    if len(layers.dirs) == 1:
        yield Path(layers.dirs[0])
        return
    options = ("lowerdir=" + ":".join(layers.dirs)).encode()
    if len(options) >= MOUNT_DATA_MAX:
        raise InfrastructureError(
            f"the image's {len(layers.dirs)} layer paths take {len(options)} bytes, more than one mount's "
            f"{MOUNT_DATA_MAX}: an image of this many layers cannot be read here"
        )
    target = Path(tempfile.mkdtemp(prefix="layers-", dir=work))
    flags = MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC
    if _libc.mount(b"overlay", str(target).encode(), b"overlay", flags, options) != 0:
        err = ctypes.get_errno()
        target.rmdir()
        raise InfrastructureError(f"mounting the image's {len(layers.dirs)} layers failed: {os.strerror(err)}")
    try:
        yield target
    finally:
        _libc.umount2(str(target).encode(), MNT_DETACH)
        target.rmdir()
