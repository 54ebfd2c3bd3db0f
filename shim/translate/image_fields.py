"""ImageService both ways: an image's reference and pull credentials in, images and file system usage out.

PullImage and RemoveImage become one value each (``shim.model``: ``PullImage``, ``RemoveImage``),
checked here and nowhere else: an image named, a reference that parses, credentials the store can
pass on.
"""

from __future__ import annotations

import json

from gen.cri.runtime.v1 import api_pb2 as pb
from shim.model import PullImage, RemoveImage
from vmsandbox.errors import InvalidArgument
from vmsandbox.image_catalogue import ImageRecord
from vmsandbox.image_ref import parse_reference
from vmsandbox.oci import image_user
from vmsandbox.registries import Credentials


def image_text(spec: pb.ImageSpec, where: str) -> str:
    """The reference or id an ImageSpec carries; empty is INVALID_ARGUMENT."""
    if not spec.image:
        raise InvalidArgument(f"{where}: image is empty")
    return spec.image


def credentials(auth: pb.AuthConfig) -> Credentials | None:
    """A PullImage's AuthConfig, for that pull only; None when it carries no secret."""
    if auth.registry_token:
        raise InvalidArgument(
            "AuthConfig.registry_token is not supported (skopeo takes bearer tokens only on its command line, "
            "where other users could read them): send username/password, auth or identity_token"
        )
    creds = Credentials(
        username=auth.username, password=auth.password, auth=auth.auth, identity_token=auth.identity_token
    )
    return creds if creds.auth_entry() else None


def pull_image(request: pb.PullImageRequest) -> PullImage:
    ref = parse_reference(image_text(request.image, "PullImageRequest.image"))
    return PullImage(ref, credentials(request.auth) if request.HasField("auth") else None)


def remove_image(request: pb.RemoveImageRequest) -> RemoveImage:
    return RemoveImage(image_text(request.image, "RemoveImageRequest.image"))


def image(r: ImageRecord) -> pb.Image:
    uid, username = image_user(r.user)
    out = pb.Image(
        id=r.id,
        repo_tags=list(r.repo_tags),
        repo_digests=list(r.repo_digests),
        size=r.size,
        username=username,
        spec=pb.ImageSpec(image=r.id),
        pinned=False,
    )
    if uid is not None:
        out.uid.CopyFrom(pb.Int64Value(value=uid))
    return out


def image_info(r: ImageRecord) -> dict[str, str]:
    """ImageStatus' verbose ``info``: one JSON document under "info", as containerd does."""
    doc = {
        "id": r.id,
        "manifest": r.manifest,
        "layers": list(r.layers),
        "size": r.size,
        "unpacked_bytes": r.unpacked_bytes,
        "unpacked_inodes": r.unpacked_inodes,
        "pulled_ns": r.pulled_ns,
        "user": r.user,
        "imageSpec": dict(r.spec),
    }
    return {"info": json.dumps(doc, sort_keys=True)}


def filesystem_usage(mountpoint: str, used: int, inodes: int, timestamp_ns: int) -> pb.FilesystemUsage:
    return pb.FilesystemUsage(
        timestamp=timestamp_ns,
        fs_id=pb.FilesystemIdentifier(mountpoint=mountpoint),
        used_bytes=pb.UInt64Value(value=used),
        inodes_used=pb.UInt64Value(value=inodes),
    )
