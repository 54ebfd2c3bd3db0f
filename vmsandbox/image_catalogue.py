"""The catalogue of stored images: records, name lookup, tag moves, removal, and space accounting. Pure.

An image is known by its id (``sha256:`` of its config, as containerd reports it), its repo tags
(``docker.io/library/busybox:latest``) and repo digests (``name@sha256:<manifest or index
digest>``). Its unpacked tree is named by what it contains (the ChainID of its verified layers),
so images with the same layers share one tree. A tag names one image at a time: pulling it again
onto another image moves it. The functions here take and return immutable mappings id ->
``ImageRecord``; the image store applies them under its lock and persists the result.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from typing import Any

from vmsandbox.errors import InvalidArgument
from vmsandbox.image_ref import ImageReference, parse_image_id, parse_reference

_HEX_PREFIX = re.compile(r"(?:sha256:)?([a-f0-9]{6,63})")


@dataclass(frozen=True)
class ImageRecord:
    id: str  # sha256:<hex of the config blob>
    repo_tags: tuple[str, ...]
    repo_digests: tuple[str, ...]
    manifest: str  # digest of the manifest blob held for it ("": containerd pulled it, see ``blobs``)
    config: str  # == id
    layers: tuple[str, ...]  # layer blob digests, bottom first
    size: int  # bytes of the config and the compressed layers (what a registry transfers)
    user: str = ""
    unpacked_bytes: int = 0
    unpacked_inodes: int = 0
    pulled_ns: int = 0
    spec: Mapping[str, Any] = field(default_factory=dict)  # env, entrypoint, cmd, working_dir, labels, ...
    removed: bool = False  # RemoveImage'd while containers still hold it: invisible, kept until released
    tree: str = ""  # ChainID of the verified layers: the tree's key ("" in a record not verified yet)
    # the unverified tree of an earlier version (named by the image id), kept only for containers
    # started from it before the upgrade; never given to a new one; "" once they are gone
    legacy_tree: str = ""

    @property
    def blobs(self) -> tuple[str, ...]:
        """The blobs the store holds for it: none for an image containerd pulled (``manifest`` "":
        only its disk is the store's, made from containerd's layers)."""
        if not self.manifest:
            return ()
        return (self.manifest, self.config, *self.layers)


Catalogue = Mapping[str, ImageRecord]


def _repo_name(name_ref: str) -> str:
    """``docker.io/library/busybox:1`` or ``…@sha256:…`` -> ``docker.io/library/busybox``."""
    at = name_ref.find("@")
    if at >= 0:
        return name_ref[:at]
    colon = name_ref.rfind(":")
    return name_ref[:colon] if colon > name_ref.rfind("/") else name_ref


def visible(images: Catalogue) -> dict[str, ImageRecord]:
    """The images the CRI sees: all but those removed while still in use."""
    return {i: r for i, r in images.items() if not r.removed}


def lookup(images: Catalogue, query: str) -> ImageRecord | None:
    """The image ``query`` names: an id, a reference (tag or digest), or a unique id prefix.

    Malformed text is not an error here (it names nothing); an ambiguous prefix names nothing."""
    if not query:
        return None
    image_id = parse_image_id(query)
    if image_id is not None:
        return images.get(image_id)
    try:
        ref = parse_reference(query)
    except InvalidArgument:
        ref = None
    if ref is not None:
        found = _by_reference(images, ref)
        if found is not None:
            return found
    m = _HEX_PREFIX.fullmatch(query)
    if m:
        hits = [r for i, r in images.items() if i[len("sha256:") :].startswith(m.group(1))]
        if len(hits) == 1:
            return hits[0]
    return None


def _by_reference(images: Catalogue, ref: ImageReference) -> ImageRecord | None:
    if ref.digest:
        repo_digest = ref.with_digest(ref.digest)
        for r in images.values():
            if repo_digest in r.repo_digests:
                return r
        return None
    for r in images.values():
        if ref.tagged in r.repo_tags:
            return r
    return None


def _add(items: Iterable[str], new: str) -> tuple[str, ...]:
    out = [i for i in items if i != new]
    out.append(new)
    return tuple(sorted(out))


def with_pulled(
    images: Catalogue, record: ImageRecord, ref: ImageReference, repo_digest: str
) -> dict[str, ImageRecord]:
    """``images`` after ``record`` was pulled as ``ref``: it gains the tag (taken from any other image
    holding it) and ``repo_digest``; a record already stored keeps its unpacked accounting."""
    out = dict(images)
    tag = ref.tagged if not ref.digest else ""
    if tag:
        for i, r in images.items():
            if i != record.id and tag in r.repo_tags:
                out[i] = replace(r, repo_tags=tuple(t for t in r.repo_tags if t != tag))
    base = out.get(record.id, record)
    if base.removed:  # pulled again while a container kept it: a fresh image as far as names go
        base = replace(base, repo_tags=(), repo_digests=(), removed=False)
    tags = _add(base.repo_tags, tag) if tag else base.repo_tags
    out[record.id] = replace(base, repo_tags=tags, repo_digests=_add(base.repo_digests, repo_digest))
    return out


def with_adopted(
    images: Catalogue, record: ImageRecord, tags: Sequence[str], digests: Sequence[str]
) -> dict[str, ImageRecord]:
    """``images`` after ``record``, an image containerd pulled, was adopted with containerd's
    names: its tags (taken from any other image holding them) and repo digests."""
    out = dict(images)
    for i, r in images.items():
        if i != record.id and set(r.repo_tags) & set(tags):
            out[i] = replace(r, repo_tags=tuple(t for t in r.repo_tags if t not in tags))
    base = out.get(record.id, record)
    for tag in tags:
        base = replace(base, repo_tags=_add(base.repo_tags, tag))
    for digest in digests:
        base = replace(base, repo_digests=_add(base.repo_digests, digest))
    out[record.id] = base
    return out


def without(images: Catalogue, image_id: str, *, in_use: bool = False) -> dict[str, ImageRecord]:
    """``images`` after RemoveImage of ``image_id``: gone, or (``in_use``) hidden until released."""
    if in_use:
        return {i: (replace(r, removed=True) if i == image_id else r) for i, r in images.items()}
    return {i: r for i, r in images.items() if i != image_id}


def matches_filter(record: ImageRecord, query: str) -> bool:
    """ListImages' filter: an id, a reference (tag or digest) or an id prefix naming this image."""
    return lookup({record.id: record}, query) is not None


def referenced_blobs(images: Catalogue) -> frozenset[str]:
    return frozenset(b for r in images.values() for b in r.blobs)


def referenced_trees(images: Catalogue) -> frozenset[str]:
    """The keys of the trees the images use (earlier versions' trees kept for old containers too)."""
    return frozenset(t for r in images.values() for t in (r.tree, r.legacy_tree) if t)


def repo_names(record: ImageRecord) -> frozenset[str]:
    return frozenset(_repo_name(n) for n in (*record.repo_tags, *record.repo_digests))


@dataclass(frozen=True)
class Usage:
    bytes: int
    inodes: int


def usage(
    images: Catalogue,
    blob_sizes: Mapping[str, int],
    disk_sizes: Mapping[str, int] | None = None,
    trees_on_disk: AbstractSet[str] | None = None,
) -> Usage:
    """Bytes and inodes the images take: each blob they reference once (shared layers are stored
    once), plus each layers' disk once (its two files: the disk and its facts), plus each unpacked
    tree still on disk once (images with the same layers share one). ``blob_sizes`` maps digest ->
    size of the blobs on disk, ``disk_sizes`` tree key -> size of its disk's files on disk,
    ``trees_on_disk`` the tree keys whose trees are there (None: every one)."""
    blobs = referenced_blobs(images) & blob_sizes.keys()
    trees = {r.tree or r.id: r for r in images.values()}
    disks = trees.keys() & (disk_sizes or {}).keys()
    unpacked = [r for k, r in trees.items() if trees_on_disk is None or k in trees_on_disk]
    return Usage(
        bytes=sum(blob_sizes[b] for b in blobs)
        + sum(r.unpacked_bytes for r in unpacked)
        + sum((disk_sizes or {})[k] for k in disks),
        inodes=len(blobs) + sum(r.unpacked_inodes for r in unpacked) + 2 * len(disks),
    )


def record_doc(r: ImageRecord) -> dict[str, Any]:
    return {
        "id": r.id,
        "repo_tags": list(r.repo_tags),
        "repo_digests": list(r.repo_digests),
        "manifest": r.manifest,
        "config": r.config,
        "layers": list(r.layers),
        "size": r.size,
        "user": r.user,
        "unpacked_bytes": r.unpacked_bytes,
        "unpacked_inodes": r.unpacked_inodes,
        "pulled_ns": r.pulled_ns,
        "spec": dict(r.spec),
        "removed": r.removed,
        "tree": r.tree,
        "legacy_tree": r.legacy_tree,
    }


def record_from_doc(doc: Mapping[str, Any]) -> ImageRecord:
    return ImageRecord(
        id=str(doc["id"]),
        repo_tags=tuple(doc.get("repo_tags", ())),
        repo_digests=tuple(doc.get("repo_digests", ())),
        manifest=str(doc["manifest"]),
        config=str(doc["config"]),
        layers=tuple(doc.get("layers", ())),
        size=int(doc.get("size", 0)),
        user=str(doc.get("user", "")),
        unpacked_bytes=int(doc.get("unpacked_bytes", 0)),
        unpacked_inodes=int(doc.get("unpacked_inodes", 0)),
        pulled_ns=int(doc.get("pulled_ns", 0)),
        spec=dict(doc.get("spec", {})),
        removed=bool(doc.get("removed", False)),
        tree=str(doc.get("tree", "")),
        legacy_tree=str(doc.get("legacy_tree", "")),
    )
