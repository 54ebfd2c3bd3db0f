"""Image volumes (KEP-4639) of a container containerd makes in a VM pod (shim mode), recognised in
its OCI spec.

containerd's CRI plugin mounts an image volume on the host itself: a snapshot of the image,
prepared by its snapshotter and mounted at ``<CRI state>/image-volumes/<sandbox id>/<manifest
digest>``; the container's spec binds that directory, or a sub path of it, read-only. A VM pod
cannot take a host mount into its guest, so the bind is read back as the image volume it was
(``ImageVolumeAt``); the guest gets the image's disk as an image volume created on vmsandbox's
own socket does. What is trusted: the mount table (the snapshot's layer directories, read from
the kernel's ``lowerdir``) and containerd's content store (the manifest, then the config checked
against its digest); a bind whose source merely looks like such a path, without an overlay
mounted there, stays a bind and meets the bind rules.
"""

from __future__ import annotations

from dataclasses import dataclass

from vmsandbox import validation
from vmsandbox.containerd_rootfs import MAX_LAYERS, ImageLayers
from vmsandbox.errors import InvalidArgument, Unsupported
from vmsandbox.mountinfo import filesystem_at

IMAGE_VOLUMES = "image-volumes"
MAX_MOUNTINFO_BYTES = 16 << 20


@dataclass(frozen=True)
class ImageVolumeAt:
    """A bind source that is containerd's mount of an image volume: the mount's directory, the
    manifest digest (hex) it is named by, and the sub path below it the container binds."""

    root: str
    manifest: str
    sub_path: str


def image_volume_at(source: str, sandbox_id: str) -> ImageVolumeAt | None:
    """The image volume whose mount (or a directory below it) ``source`` is, when its path is the
    one containerd gives this sandbox's image volumes; None for any other path."""
    marker = f"/{IMAGE_VOLUMES}/{sandbox_id}/"
    at = source.find(marker)
    if not sandbox_id or at <= 0 or not source.startswith("/"):
        return None
    rest = source[at + len(marker) :].split("/")
    manifest, sub = rest[0], [p for p in rest[1:] if p]
    if not validation.is_full_id(manifest) or any(p in (".", "..") for p in sub):
        return None
    return ImageVolumeAt(source[: at + len(marker)] + manifest, manifest, "/".join(sub))


def _split_options(options: str) -> list[str]:
    """Super options split at commas the kernel did not escape (overlayfs escapes ``,`` in paths
    as ``\\,``)."""
    parts, current, i = [], [], 0
    while i < len(options):
        c = options[i]
        if c == "\\" and i + 1 < len(options) and options[i + 1] in ",:\\":
            current.append(options[i : i + 2])
            i += 2
            continue
        if c == ",":
            parts.append("".join(current))
            current = []
        else:
            current.append(c)
        i += 1
    parts.append("".join(current))
    return parts


def _lower_dirs(value: str) -> list[str]:
    """A ``lowerdir`` value split at its unescaped colons."""
    dirs, current, i = [], [], 0
    while i < len(value):
        c = value[i]
        if c == "\\" and i + 1 < len(value):
            current.append(value[i + 1])
            i += 2
            continue
        if c == ":":
            dirs.append("".join(current))
            current = []
        else:
            current.append(c)
        i += 1
    dirs.append("".join(current))
    return dirs


def mounted_layers(mountinfo: str, mount_point: str) -> ImageLayers | None:
    """The image layers of the overlay mounted last at ``mount_point`` (``/proc/self/mountinfo``'s
    text); None when nothing, or not an overlay, is mounted there. Its layers are its lower
    directories, top first (the upper directory is the snapshot's own, empty: containerd binds it
    read-only)."""
    found = filesystem_at(mountinfo, mount_point)
    if found is None or found[0] != "overlay":
        return None
    lower: list[str] = []
    for option in _split_options(found[1]):
        if option.startswith("lowerdir="):
            lower = _lower_dirs(option.removeprefix("lowerdir="))
        elif option.startswith("lowerdir+="):
            lower.append(_lower_dirs(option.removeprefix("lowerdir+="))[0])
    shown = validation.quote(mount_point[:256])
    if not lower or not all(d.startswith("/") and ".." not in d.split("/") for d in lower):
        raise Unsupported(
            f"the image volume mounted at {shown} names its layers by no absolute paths the host can read"
        )
    if len(lower) > MAX_LAYERS:
        raise InvalidArgument(f"the image volume mounted at {shown} has {len(lower)} layers, more than {MAX_LAYERS}")
    return ImageLayers(tuple(lower))
