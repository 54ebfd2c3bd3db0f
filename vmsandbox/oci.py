"""OCI (and Docker schema 2) image documents: index, manifest, config; platform choice. Pure.

``parse_document`` reads the bytes a registry served for a reference and returns an ``Index``
(multi-platform: OCI image index or Docker manifest list) or a ``Manifest``; ``select_platform``
picks the entry for the node (linux/amd64 here) as containerd's default platform matcher does
(os and architecture must match; a variant only narrows when the entry has one).
``parse_config`` keeps what the CRI reports (user, size inputs) and what a container needs
later (env, entrypoint, cmd, working dir), and the layers' ``rootfs.diff_ids``; ``check_layers``
pairs each manifest layer with its diff id and ``chain_id`` names the tree those layers make
(the OCI image spec's ChainID). ``image_user`` splits ``User`` into uid or username.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vmsandbox.errors import InvalidArgument, NotFound

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
DOCKER_SCHEMA1 = (
    "application/vnd.docker.distribution.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v1+prettyjws",
)

LAYER_TAR = "tar"
LAYER_GZIP = "gzip"
LAYER_ZSTD = "zstd"
_LAYER_TYPES = {
    "application/vnd.oci.image.layer.v1.tar": LAYER_TAR,
    "application/vnd.oci.image.layer.v1.tar+gzip": LAYER_GZIP,
    "application/vnd.oci.image.layer.v1.tar+zstd": LAYER_ZSTD,
    # non-distributable (foreign) layers are pulled and unpacked like the others (see docs/images.md)
    "application/vnd.oci.image.layer.nondistributable.v1.tar": LAYER_TAR,
    "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip": LAYER_GZIP,
    "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd": LAYER_ZSTD,
    "application/vnd.docker.image.rootfs.diff.tar": LAYER_TAR,
    "application/vnd.docker.image.rootfs.diff.tar.gzip": LAYER_GZIP,
    "application/vnd.docker.image.rootfs.foreign.diff.tar": LAYER_TAR,
    "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip": LAYER_GZIP,
}  # no Docker zstd type: Docker's schema 2 defines none and skopeo 1.9 refuses containerd's

_DIGEST = re.compile(r"sha256:[a-f0-9]{64}")
MAX_DOCUMENT = 4 << 20  # the distribution spec lets registries refuse manifests over 4 MiB; so do we


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Platform:
    os: str
    architecture: str
    variant: str = ""

    def __str__(self) -> str:
        return f"{self.os}/{self.architecture}" + (f"/{self.variant}" if self.variant else "")


NODE_PLATFORM = Platform("linux", "amd64")


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size: int
    platform: Platform | None = None


@dataclass(frozen=True)
class Index:
    media_type: str
    manifests: tuple[Descriptor, ...]


@dataclass(frozen=True)
class Manifest:
    media_type: str
    config: Descriptor
    layers: tuple[Descriptor, ...]


@dataclass(frozen=True)
class ImageConfig:
    os: str
    architecture: str
    user: str = ""
    env: tuple[str, ...] = ()
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    working_dir: str = ""
    stop_signal: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    diff_ids: tuple[str, ...] = ()
    created: str = ""


def _bad(where: str, what: str) -> InvalidArgument:
    return InvalidArgument(f"{where}: {what}")


def _descriptor(doc: Any, where: str) -> Descriptor:
    if not isinstance(doc, dict):
        raise _bad(where, "descriptor is not an object")
    digest, size, media_type = doc.get("digest"), doc.get("size"), doc.get("mediaType", "")
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise _bad(where, f"descriptor digest {str(digest)[:80]!r} is not a sha256 digest")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise _bad(where, f"descriptor {digest} has no valid size")
    if not isinstance(media_type, str):
        raise _bad(where, f"descriptor {digest} has a non-string mediaType")
    platform = None
    p = doc.get("platform")
    if isinstance(p, dict):
        platform = Platform(str(p.get("os", "")), str(p.get("architecture", "")), str(p.get("variant", "") or ""))
    return Descriptor(media_type=media_type, digest=digest, size=size, platform=platform)


def _load(data: bytes, where: str) -> dict[str, Any]:
    if len(data) > MAX_DOCUMENT:
        raise _bad(where, f"document of {len(data)} bytes is larger than {MAX_DOCUMENT}")
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _bad(where, f"not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise _bad(where, "not a JSON object")
    return doc


def parse_document(data: bytes, where: str, media_type: str = "") -> Index | Manifest:
    """An image index / manifest list, or an image manifest (``media_type`` from the registry, if any)."""
    doc = _load(data, where)
    kind = doc.get("mediaType") or media_type
    if kind in DOCKER_SCHEMA1 or doc.get("schemaVersion") == 1:
        raise _bad(where, "Docker schema 1 manifests are not supported (push the image again with a current client)")
    if kind in (OCI_INDEX, DOCKER_LIST) or (not kind and "manifests" in doc):
        entries = doc.get("manifests")
        if not isinstance(entries, list):
            raise _bad(where, "index has no manifests list")
        return Index(
            media_type=kind or OCI_INDEX,
            manifests=tuple(_descriptor(d, f"{where}: manifests[{i}]") for i, d in enumerate(entries)),
        )
    if kind in (OCI_MANIFEST, DOCKER_MANIFEST) or (not kind and "config" in doc):
        layers = doc.get("layers")
        if not isinstance(layers, list):
            raise _bad(where, "manifest has no layers list")
        return Manifest(
            media_type=kind or OCI_MANIFEST,
            config=_descriptor(doc.get("config"), f"{where}: config"),
            layers=tuple(_descriptor(d, f"{where}: layers[{i}]") for i, d in enumerate(layers)),
        )
    raise _bad(where, f"unsupported manifest media type {str(kind)[:100]!r}")


def select_platform(index: Index, where: str, want: Platform = NODE_PLATFORM) -> Descriptor:
    """The manifest of ``index`` for ``want``; an exact variant match wins over an entry without one."""
    candidates = [
        d
        for d in index.manifests
        if d.platform is not None
        and d.platform.os == want.os
        and d.platform.architecture == want.architecture
        and d.media_type in (OCI_MANIFEST, DOCKER_MANIFEST, "")
    ]
    if want.variant:
        exact = [d for d in candidates if d.platform is not None and d.platform.variant == want.variant]
        candidates = exact or [d for d in candidates if d.platform is not None and not d.platform.variant]
    if not candidates:
        has = sorted({str(d.platform) for d in index.manifests if d.platform is not None})
        raise NotFound(f"{where}: no {want} image in the index (it has: {', '.join(has) or 'no platforms'})")
    return candidates[0]


def layer_compression(media_type: str, where: str) -> str:
    """``tar``, ``gzip`` or ``zstd`` for a layer media type; anything else is refused."""
    kind = _LAYER_TYPES.get(media_type)
    if kind is None:
        raise _bad(where, f"unsupported layer media type {media_type[:100]!r}")
    return kind


def _strings(value: Any, where: str, key: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _bad(where, f"config.{key} must be a list of strings")
    return tuple(value)


def parse_config(data: bytes, where: str) -> ImageConfig:
    doc = _load(data, where)
    cfg = doc.get("config") or {}
    if not isinstance(cfg, dict):
        raise _bad(where, "config is not an object")
    rootfs = doc.get("rootfs") or {}
    if not isinstance(rootfs, dict):
        raise _bad(where, "rootfs is not an object")
    diff_ids = _strings(rootfs.get("diff_ids"), where, "rootfs.diff_ids")
    for i, d in enumerate(diff_ids):
        if not _DIGEST.fullmatch(d):
            raise _bad(where, f"rootfs.diff_ids[{i}] {d[:80]!r} is not a sha256 digest")
    labels = cfg.get("Labels") or {}
    if not isinstance(labels, dict):
        raise _bad(where, "config.Labels must be an object")
    user = cfg.get("User") or ""
    if not isinstance(user, str):
        raise _bad(where, "config.User must be a string")
    return ImageConfig(
        os=str(doc.get("os", "")),
        architecture=str(doc.get("architecture", "")),
        user=user,
        env=_strings(cfg.get("Env"), where, "Env"),
        entrypoint=_strings(cfg.get("Entrypoint"), where, "Entrypoint"),
        cmd=_strings(cfg.get("Cmd"), where, "Cmd"),
        working_dir=str(cfg.get("WorkingDir") or ""),
        stop_signal=str(cfg.get("StopSignal") or ""),
        labels={str(k): str(v) for k, v in labels.items()},
        diff_ids=diff_ids,
        created=str(doc.get("created") or ""),
    )


def check_media_types(manifest: Manifest, where: str) -> None:
    """Refuse a manifest with a layer this runtime cannot unpack, before anything is downloaded."""
    for n, layer in enumerate(manifest.layers, 1):
        layer_compression(layer.media_type, f"{where}: layer {n}/{len(manifest.layers)} {layer.digest}")


def check_layers(manifest: Manifest, config: ImageConfig, where: str) -> tuple[tuple[Descriptor, str], ...]:
    """Each layer of ``manifest`` with the diff id (digest of its uncompressed tar) the config gives
    it, bottom first; a manifest whose layer count is not the config's diff id count is refused."""
    if len(manifest.layers) != len(config.diff_ids):
        raise _bad(
            where,
            f"the manifest has {len(manifest.layers)} layers but the config's rootfs.diff_ids has "
            f"{len(config.diff_ids)} entries",
        )
    return tuple(zip(manifest.layers, config.diff_ids, strict=True))


def chain_id(diff_ids: tuple[str, ...]) -> str:
    """The OCI ChainID of layers with ``diff_ids`` (bottom first): what the unpacked tree contains.

    ChainID(L0) = DiffID(L0); ChainID(L0..Ln) = sha256(ChainID(L0..Ln-1) + " " + DiffID(Ln)).
    An image without layers (an empty tree) gets the digest of the empty string."""
    if not diff_ids:
        return sha256_digest(b"")
    chain = diff_ids[0]
    for d in diff_ids[1:]:
        chain = sha256_digest(f"{chain} {d}".encode())
    return chain


def image_user(user: str) -> tuple[int | None, str]:
    """``User`` -> (uid, "") when its user part is numeric, else (None, username), as the CRI wants.

    ``"1000"``, ``"1000:1000"`` -> (1000, ""); ``"nobody"``, ``"www-data:www-data"`` -> (None, name);
    ``""`` -> (None, "") (the runtime's default, root)."""
    name = user.split(":", 1)[0]
    if name.isdigit() and name.isascii():
        return int(name), ""
    return None, name
