"""An image's layers made into its verified read-only disk (for ``shim.image_store``).

Each layer is unpacked from its stored blob into a fresh tree while it is checked against its
digest and the config's ``rootfs.diff_ids`` (``vmsandbox.adapters.layers``), the disk is made of
the tree and checked (``vmsandbox.adapters.image_disk``) and the tree deleted; a disk of the same
layers stored already is used as it is, once this pull's blobs are checked. Images stored by an
earlier version, never checked, are verified the same way from their stored blobs. A pulled
image's catalogue record is made here too (``image_record``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

from vmsandbox.adapters.image_disk import ImageDisk
from vmsandbox.adapters.layers import Limits, Tree
from vmsandbox.errors import InvalidArgument, VmSandboxError
from vmsandbox.image_catalogue import ImageRecord
from vmsandbox.oci import (
    MAX_DOCUMENT,
    Descriptor,
    ImageConfig,
    Manifest,
    chain_id,
    check_layers,
    image_user,
    layer_compression,
    parse_config,
    parse_document,
)

log = logging.getLogger(__name__)


def layers_disk(
    disk: ImageDisk, limits: Limits, work: Path, manifest: Manifest, config: ImageConfig, key: str, what: str
) -> tuple[int, int]:
    """Make sure the disk ``key`` of this image's layers is in place; (bytes, inodes) of its tree.

    The layers are unpacked (into work/) and verified, the disk made of them and checked, and
    the tree deleted, unless a verified disk of the same layers is stored already; then only
    this pull's blobs are checked against their digests."""
    pairs = check_layers(manifest, config, what)
    if disk.has_disk(key):
        for layer, _ in pairs:
            disk.verify_blob(layer.digest, what)
        facts = disk.facts(key)
        return facts.unpacked_bytes, facts.unpacked_inodes
    tree_dir = work / "tree"
    tree_dir.mkdir(mode=0o755)
    _unpack(disk, limits, tree_dir, pairs, what)
    facts = disk.make_disk(tree_dir, key)
    disk.discard(tree_dir)  # the disk holds it now
    return facts.unpacked_bytes, facts.unpacked_inodes


def _unpack(
    disk: ImageDisk, limits: Limits, tree_dir: Path, layers: tuple[tuple[Descriptor, str], ...], what: str
) -> None:
    tree = Tree(str(tree_dir), limits)
    try:
        for n, (layer, diff_id) in enumerate(layers, 1):
            where = f"{what}: layer {n}/{len(layers)} {layer.digest}"
            compression = layer_compression(layer.media_type, where)
            t0 = time.monotonic()
            stats = tree.apply(
                str(disk.blob_path(layer.digest)), compression, where, digest=layer.digest, diff_id=diff_id
            )
            seconds = time.monotonic() - t0
            log.info(
                "%s: unpacked and verified %d bytes (%d compressed, %d entries, %d whiteouts, "
                "%d device nodes skipped) in %.3f s",
                where,
                stats.bytes,
                layer.size,
                stats.entries,
                stats.whiteouts,
                stats.devices_skipped,
                seconds,
                extra={
                    "fields": {
                        "event": "layer_unpacked",
                        "layer": layer.digest,
                        "compressed_bytes": layer.size,
                        "bytes": stats.bytes,
                        "entries": stats.entries,
                        "seconds": round(seconds, 4),
                    }
                },
            )
    finally:
        tree.close()


def verify_unverified(disk: ImageDisk, limits: Limits, record: ImageRecord) -> ImageRecord | None:
    """A record of an earlier version (its tree named by image id, never checked): unpack it again
    from its stored blobs with every check, under its ChainID; None (logged) when that fails."""
    what = f"verifying stored image {record.id}"
    t0 = time.monotonic()
    work = disk.new_work_dir("verify")
    try:
        doc = parse_document(disk.read_blob(record.manifest, MAX_DOCUMENT, what), what)
        if not isinstance(doc, Manifest) or doc.config.digest != record.id:
            raise InvalidArgument(f"{what}: its stored manifest {record.manifest} is not the image's")
        config = parse_config(disk.read_blob(record.id, MAX_DOCUMENT, what), what)
        key = chain_id(config.diff_ids)
        used, inodes = layers_disk(disk, limits, work, doc, config, key, what)
    except (VmSandboxError, OSError) as exc:
        log.warning(
            "image %s (%s), stored by an earlier version, could not be verified and is dropped: %s",
            record.id,
            ", ".join(record.repo_tags or record.repo_digests) or "no names",
            exc,
        )
        return None
    finally:
        disk.discard(work)
    log.info("image %s, stored by an earlier version, verified in %.3f s", record.id, time.monotonic() - t0)
    legacy = record.id if disk.has_tree(record.id) else ""  # kept for containers started from it
    return replace(
        record,
        tree=key,
        legacy_tree=legacy,
        layers=tuple(d.digest for d in doc.layers),
        unpacked_bytes=used,
        unpacked_inodes=inodes,
    )


def image_record(
    image_id: str,
    manifest_digest: str,
    manifest: Manifest,
    config: ImageConfig,
    tree_key: str,
    used: int,
    inodes: int,
) -> ImageRecord:
    """The catalogue's record of a pulled image whose disk ``tree_key`` holds ``used`` bytes and
    ``inodes`` inodes unpacked (its names are added as the catalogue names it)."""
    uid, username = image_user(config.user)
    return ImageRecord(
        id=image_id,
        repo_tags=(),
        repo_digests=(),
        manifest=manifest_digest,
        config=image_id,
        layers=tuple(d.digest for d in manifest.layers),
        size=manifest.config.size + sum(d.size for d in manifest.layers),
        user=config.user,
        unpacked_bytes=used,
        unpacked_inodes=inodes,
        pulled_ns=time.time_ns(),
        spec={
            "env": list(config.env),
            "entrypoint": list(config.entrypoint),
            "cmd": list(config.cmd),
            "working_dir": config.working_dir,
            "stop_signal": config.stop_signal,
            "labels": dict(config.labels),
            "created": config.created,
            "uid": uid,
            "username": username,
        },
        tree=tree_key,
    )
