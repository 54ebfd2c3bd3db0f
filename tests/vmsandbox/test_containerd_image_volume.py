"""Recognising containerd's image-volume mounts in a container's spec, and reading their layers
from the mount table."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vmsandbox.containerd_image_volume import ImageVolumeAt, image_volume_at, mounted_layers
from vmsandbox.containerd_rootfs import MAX_LAYERS, ImageLayers
from vmsandbox.errors import InvalidArgument, Unsupported

SID = "a" * 64
HEX = "b" * 64
ROOT = f"/run/containerd/io.containerd.grpc.v1.cri/image-volumes/{SID}/{HEX}"


@pytest.mark.parametrize(
    ("source", "sandbox", "want"),
    [
        (ROOT, SID, ImageVolumeAt(ROOT, HEX, "")),
        (ROOT + "/bin", SID, ImageVolumeAt(ROOT, HEX, "bin")),
        (ROOT + "/usr//share/", SID, ImageVolumeAt(ROOT, HEX, "usr/share")),
        (ROOT + "/../etc", SID, None),  # no climbing out
        (ROOT, "c" * 64, None),  # another sandbox's
        (ROOT, "", None),
        (f"/var/lib/kubelet/pods/x/volumes/{HEX}", SID, None),
        (f"/run/image-volumes/{SID}/notahexdigest", SID, None),
        (f"image-volumes/{SID}/{HEX}", SID, None),  # not absolute
        (f"/image-volumes/{SID}/{HEX}", SID, None),  # no state directory above it
    ],
)
def test_image_volume_sources(source: str, sandbox: str, want: ImageVolumeAt | None) -> None:
    assert image_volume_at(source, sandbox) == want


def line(mount_point: str, fstype: str, options: str, mount_id: int = 100) -> str:
    return f"{mount_id} 25 0:{mount_id} / {mount_point} rw,relatime shared:1 - {fstype} {fstype} {options}"


@pytest.mark.parametrize(
    ("mountinfo", "want"),
    [
        (line(ROOT, "overlay", "rw,lowerdir=/l/2/fs:/l/1/fs,upperdir=/u,workdir=/w"), ("/l/2/fs", "/l/1/fs")),
        # the kernel's mount API, one lowerdir+= per layer
        (line(ROOT, "overlay", "ro,lowerdir+=/l/2/fs,lowerdir+=/l/1/fs,upperdir=/u"), ("/l/2/fs", "/l/1/fs")),
        # escaped colon and comma in a layer's path
        (line(ROOT, "overlay", "rw,lowerdir=/l/a\\:b:/l/c\\,d,upperdir=/u"), ("/l/a:b", "/l/c,d")),
        # mounted twice: the last one counts
        (line(ROOT, "tmpfs", "rw") + "\n" + line(ROOT, "overlay", "rw,lowerdir=/l/9", 101), ("/l/9",)),
        (line(ROOT, "tmpfs", "rw"), None),
        (line("/elsewhere", "overlay", "rw,lowerdir=/l/1"), None),
        ("", None),
        ("garbage without a separator", None),
    ],
)
def test_layers_from_the_mount_table(mountinfo: str, want: tuple[str, ...] | None) -> None:
    got = mounted_layers(mountinfo, ROOT)
    assert got == (ImageLayers(want) if want is not None else None)


def test_a_mount_point_with_a_space_is_matched_unescaped() -> None:
    spaced = "/run/x y/image-volumes"
    assert mounted_layers(line(spaced.replace(" ", "\\040"), "overlay", "lowerdir=/l"), spaced) == ImageLayers(("/l",))


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ("rw,upperdir=/u", Unsupported),  # no lower directories
        ("rw,lowerdir=relative/l:/l/1", Unsupported),  # containerd's short relative form: not readable here
        ("rw,lowerdir=/l/../etc", Unsupported),
        ("rw,lowerdir=" + ":".join(f"/l/{i}" for i in range(MAX_LAYERS + 1)), InvalidArgument),
    ],
)
def test_layers_the_host_cannot_take_are_refused(options: str, error: type[Exception]) -> None:
    with pytest.raises(error):
        mounted_layers(line(ROOT, "overlay", options), ROOT)


@given(st.text(max_size=400))
def test_any_mount_table_is_read_or_refused(text: str) -> None:
    try:
        got = mounted_layers(text, ROOT)
    except (Unsupported, InvalidArgument):
        return
    assert got is None or all(d.startswith("/") for d in got.dirs)


@given(st.text(max_size=300), st.sampled_from([SID, ""]))
def test_any_source_is_recognised_or_not(source: str, sandbox: str) -> None:
    at = image_volume_at(source, sandbox)
    if at is not None:
        assert source.startswith(at.root) and ".." not in at.sub_path.split("/")
