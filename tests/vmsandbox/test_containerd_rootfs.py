"""A task's rootfs mounts read as the image's layers (vmsandbox/containerd_rootfs.py)."""

from __future__ import annotations

import pytest

from vmsandbox.containerd_rootfs import MAX_LAYERS, ImageLayers, RootfsMount, image_layers
from vmsandbox.errors import InvalidArgument, Unsupported

SNAP = "/var/lib/containerd/io.containerd.snapshotter.v1.overlayfs/snapshots"


@pytest.mark.parametrize(
    ("mounts", "want"),
    [
        (
            [RootfsMount("overlay", "overlay", ("index=off", f"workdir={SNAP}/9/work", f"upperdir={SNAP}/9/fs",
                                                 f"lowerdir={SNAP}/3/fs:{SNAP}/2/fs:{SNAP}/1/fs"))],
            (f"{SNAP}/3/fs", f"{SNAP}/2/fs", f"{SNAP}/1/fs"),
        ),
        ([RootfsMount("bind", f"{SNAP}/1/fs", ("rbind", "ro"))], (f"{SNAP}/1/fs",)),
    ],
)  # fmt: skip
def test_layers_of_overlayfs_snapshots(mounts: list[RootfsMount], want: tuple[str, ...]) -> None:
    assert image_layers(mounts) == ImageLayers(want)


@pytest.mark.parametrize(
    ("mounts", "error", "says"),
    [
        ([], Unsupported, "0 mounts"),
        (
            [RootfsMount("erofs", f"{SNAP}/1/layer.erofs", ("ro", "loop")),
             RootfsMount("format/mkdir/overlay", "overlay", ("lowerdir={{ mount 0 }}",))],
            Unsupported,
            "2 mounts",
        ),
        ([RootfsMount("ext4", "/dev/dm-3", ())], Unsupported, "ext4"),
        ([RootfsMount("overlay", "overlay", ("upperdir=/x",))], InvalidArgument, "lowerdir"),
        ([RootfsMount("overlay", "overlay", ("lowerdir=relative/fs",))], InvalidArgument, "absolute"),
        ([RootfsMount("overlay", "overlay", ("lowerdir=/a/../etc",))], InvalidArgument, "normalised"),
        ([RootfsMount("bind", "fs", ())], InvalidArgument, "absolute"),
        (
            [RootfsMount("overlay", "overlay", ("lowerdir=" + ":".join(["/l"] * (MAX_LAYERS + 1)),))],
            InvalidArgument,
            "layers",
        ),
    ],
)  # fmt: skip
def test_other_rootfs_refused(mounts: list[RootfsMount], error: type[Exception], says: str) -> None:
    with pytest.raises(error, match=says):
        image_layers(mounts)
