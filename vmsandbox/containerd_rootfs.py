"""The root file system containerd hands a task (``CreateTaskRequest.rootfs``), read as the
image's layer directories.

containerd's CRI plugin makes a container's rootfs as a writable snapshot of its image (the
snapshotter's mounts). With the ``overlayfs`` snapshotter that is one ``overlay`` mount whose
``lowerdir`` lists the image's committed layers, top first, and whose ``upperdir``/``workdir``
are the container's own; an image of one layer may come as a ``bind`` of that layer's directory.
A VM pod never mounts them on the host for the container: its guest writes in an overlay of its
own over the image's read-only disk, so only the layers are read here, to make that disk once per
image (``shim.containerd.rootfs``). Other snapshotters' mounts (the EROFS snapshotter's layer
blobs and ``format/`` templates, devmapper's block devices) are refused precisely.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vmsandbox.errors import InvalidArgument, Unsupported

MAX_LAYERS = 500  # containerd's overlayfs snapshotter refuses more; so does the kernel's mount data page


@dataclass(frozen=True)
class RootfsMount:
    """One mount of ``CreateTaskRequest.rootfs`` (containerd.types.Mount)."""

    type: str
    source: str
    options: tuple[str, ...]


@dataclass(frozen=True)
class ImageLayers:
    """The image's layer directories on the host, top first, as overlayfs' ``lowerdir`` lists them."""

    dirs: tuple[str, ...]


def _absolute(path: str, where: str) -> str:
    if not path.startswith("/") or "\x00" in path or any(p in ("..", ".") for p in path.split("/")):
        raise InvalidArgument(f"{where}: {path[:256]!r} is not an absolute, normalised path")
    return path


def image_layers(mounts: Sequence[RootfsMount]) -> ImageLayers:
    """The layers of the image a task's rootfs mounts are a snapshot of."""
    if len(mounts) != 1:
        kinds = ", ".join(m.type for m in mounts[:4]) or "none"
        raise Unsupported(
            f"the task's rootfs is {len(mounts)} mounts ({kinds}): VM pods take containerd's overlayfs "
            'snapshotter\'s one overlay mount (set snapshotter = "overlayfs" for the runtime handler)'
        )
    m = mounts[0]
    if m.type == "bind":
        return ImageLayers((_absolute(m.source, "rootfs bind source"),))
    if m.type != "overlay":
        raise Unsupported(
            f"the task's rootfs is a {m.type[:64]!r} mount: VM pods take containerd's overlayfs snapshotter's "
            'overlay mount (set snapshotter = "overlayfs" for the runtime handler)'
        )
    lower = [o.removeprefix("lowerdir=") for o in m.options if o.startswith("lowerdir=")]
    if len(lower) != 1 or not lower[0]:
        raise InvalidArgument("the task's rootfs overlay mount has no single lowerdir option")
    dirs = tuple(_absolute(d, "rootfs lowerdir") for d in lower[0].split(":"))
    if len(dirs) > MAX_LAYERS:
        raise InvalidArgument(f"the task's rootfs has {len(dirs)} layers, more than {MAX_LAYERS}")
    return ImageLayers(dirs)
