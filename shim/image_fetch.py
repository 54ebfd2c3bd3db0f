"""What a pull asks of registries (for ``shim.image_store``): the image a reference names, and its blobs.

``resolve`` reads the manifest from the reference's registry (its mirrors first), choosing the
node's platform from an index, and checks it against a digest the reference pins; ``fetch_blobs``
has skopeo bring the manifest, config and layers into the store's blob directory as the registry
served them (non-distributable layers fetched apart). A pull's own credentials go to the image's
registry only (``creds_for``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from vmsandbox.adapters.image_disk import ImageDisk
from vmsandbox.adapters.skopeo import Skopeo
from vmsandbox.errors import InfrastructureError, InvalidArgument, VmSandboxError
from vmsandbox.image_ref import ImageReference
from vmsandbox.oci import (
    NODE_PLATFORM,
    Index,
    Manifest,
    check_media_types,
    parse_document,
    select_platform,
    sha256_digest,
)
from vmsandbox.registries import Credentials, Endpoint, Registries, endpoints

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resolved:
    """What the registry said ``ref`` is: where it answered, the pulled digest, the platform manifest."""

    endpoint: Endpoint
    top_digest: str  # what repo digests name: the index's digest for a multi-arch image
    manifest_digest: str
    manifest: Manifest


def resolve(skopeo: Skopeo, registries: Registries, ref: ImageReference, creds: Credentials | None) -> Resolved:
    what = f"pulling {ref}"
    places = endpoints(ref, registries)
    raw = b""
    endpoint = places[-1]
    for i, endpoint in enumerate(places):
        try:
            raw = skopeo.fetch_manifest(endpoint, ref.fetch_by, creds_for(ref, endpoint, creds), what)
            break
        except VmSandboxError as exc:
            if i == len(places) - 1:
                raise
            log.info("%s: mirror %s failed (%s); trying the next place", what, endpoint.repository, exc)
    top = sha256_digest(raw)
    if ref.digest and top != ref.digest:
        raise InvalidArgument(f"{what}: the registry served a manifest whose digest is {top}")
    doc = parse_document(raw, what)
    if isinstance(doc, Index):
        entry = select_platform(doc, what, NODE_PLATFORM)
        raw = skopeo.fetch_manifest(endpoint, entry.digest, creds_for(ref, endpoint, creds), what)
        if sha256_digest(raw) != entry.digest:
            raise InvalidArgument(f"{what}: the {NODE_PLATFORM} manifest does not match its digest {entry.digest}")
        doc = parse_document(raw, what, entry.media_type)
        if not isinstance(doc, Manifest):
            raise InvalidArgument(f"{what}: the {NODE_PLATFORM} entry of the index is not an image manifest")
        check_media_types(doc, what)
        return Resolved(endpoint, top, entry.digest, doc)
    check_media_types(doc, what)
    return Resolved(endpoint, top, top, doc)


def fetch_blobs(
    skopeo: Skopeo,
    disk: ImageDisk,
    ref: ImageReference,
    resolved: Resolved,
    creds: Credentials | None,
    work: Path,
    what: str,
) -> None:
    """Bring the manifest, config and layers into the blob directory, as the registry served them."""
    endpoint, digest = resolved.endpoint, resolved.manifest_digest
    layout = work / "layout"
    skopeo.copy(endpoint, digest, creds_for(ref, endpoint, creds), layout, disk.blob_dir, what)
    stored = _layout_manifest(layout, what)
    if stored != digest:
        raise InfrastructureError(f"{what}: skopeo stored manifest {stored}, the registry served {digest}")
    absent = [d for d in resolved.manifest.layers if not disk.has_blob(d.digest)]
    if absent:  # non-distributable layers naming URLs: the OCI layout holds them by reference only
        log.info("%s: %d non-distributable layer(s) fetched apart", what, len(absent))
        directory = work / "dir"
        skopeo.copy_dir(endpoint, digest, creds_for(ref, endpoint, creds), directory, what)
        for d in absent:
            try:
                disk.adopt_blob(directory / d.digest.removeprefix("sha256:"), d.digest)
            except FileNotFoundError:
                raise InfrastructureError(f"{what}: layer {d.digest} did not arrive") from None


def creds_for(ref: ImageReference, endpoint: Endpoint, creds: Credentials | None) -> Credentials | None:
    """A pull's own credentials go to the image's registry only, never to a mirror or another
    location (those use the configured auth file): the kubelet chose them for that registry."""
    return creds if endpoint.host == ref.domain else None


def _layout_manifest(layout: Path, what: str) -> str:
    """The manifest digest skopeo recorded in the OCI layout's index.json."""
    try:
        doc = json.loads((layout / "index.json").read_text())
        digest = doc["manifests"][0]["digest"]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        raise InvalidArgument(f"{what}: skopeo left no readable OCI layout") from None
    if not isinstance(digest, str):
        raise InvalidArgument(f"{what}: skopeo left no readable OCI layout")
    return digest
