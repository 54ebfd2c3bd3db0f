"""``ImageStore``: the one owner of images — pull, look up, list, remove, hold for containers, account.

A pull resolves the reference against the registries configuration (mirrors first), reads the
manifest (choosing linux/amd64 from an index), and — unless the image is stored already — has
skopeo bring its blobs, as the registry served them, into the content-addressed store, unpacks the
layers into a fresh tree under the store's work directory while checking each against its digest
and the config's ``rootfs.diff_ids``, makes the tree's read-only EROFS disk, checks every file of
it, moves it into place under the ChainID of those layers (with what the host reads of the tree:
its size, ``/etc/passwd`` and ``/etc/group``), deletes the tree, and only then writes the
catalogue: a pull that dies or is refused half-way leaves nothing visible, and its leftovers are
deleted (now, or at the next start). Concurrent pulls of one reference share one download (single
flight); pulls of one image by different names share one unpack; images with the same layers share
one disk; different images pull in parallel. The unpacking and checking of the layers into the
disk is ``shim.image_unpack``'s.

Nothing on the host needs the tree once the disk is made: guests get the disk, CreateContainer
reads the image's user names from the facts kept with it, and the hostile-image checks run while
the layers are unpacked. An earlier version unpacked trees into the store and shared them over 9p;
at start its images get their disks made from those trees, and each tree is deleted once no
container holds its image (a sandbox of that version may still read it).

A store written before trees were verified (catalogue version 1: trees named by image id) is
verified at start: each image is unpacked again from its stored blobs with every check, under its
ChainID; an image that cannot be verified is dropped (logged), never served. The old tree is kept
only while containers started from it before the upgrade hold the image (``collect`` and
``release`` delete it), since their guests read it by its old name; no new container gets it.

Containers hold the images they run from with ``acquire``/``release``: RemoveImage of a held image
hides it at once and frees its disk and blobs when the last holder releases it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from shim import faults, metrics
from shim.image_unpack import layers_disk, verify_unverified
from vmsandbox.adapters.image_disk import ImageDisk
from vmsandbox.adapters.layers import Limits
from vmsandbox.adapters.skopeo import Skopeo
from vmsandbox.errors import CannotFit, InfrastructureError, InvalidArgument, NotFound, VmSandboxError
from vmsandbox.image_catalogue import (
    ImageRecord,
    Usage,
    lookup,
    matches_filter,
    record_doc,
    record_from_doc,
    referenced_blobs,
    referenced_trees,
    visible,
    with_pulled,
    without,
)
from vmsandbox.image_catalogue import usage as catalogue_usage
from vmsandbox.image_ref import ImageReference, bounded, parse_reference
from vmsandbox.oci import (
    MAX_DOCUMENT,
    NODE_PLATFORM,
    ImageConfig,
    Index,
    Manifest,
    chain_id,
    check_media_types,
    image_user,
    parse_config,
    parse_document,
    select_platform,
    sha256_digest,
)
from vmsandbox.registries import Credentials, Endpoint, Registries, endpoints

log = logging.getLogger(__name__)

_Held = tuple[set[str], str]  # a pull's blobs and tree key, in flight until the catalogue names them


def disk_serial(tree_key: str) -> str:
    """The virtio-blk serial of an image's disk (at most 20 characters): the first 80 bits of its
    tree's ChainID, so one pod's disks never share a serial."""
    return tree_key.removeprefix("sha256:")[:20]


@dataclass(frozen=True)
class HeldImage:
    """An image held for a container: its read-only disk (the guest's lower layer), with the serial
    the guest finds it by, and the lines of its ``/etc/passwd`` and ``/etc/group`` (user names)."""

    disk: Path
    serial: str
    passwd: tuple[str, ...]
    group: tuple[str, ...]


@dataclass(frozen=True)
class Resolved:
    """What the registry said ``ref`` is: where it answered, the pulled digest, the platform manifest."""

    endpoint: Endpoint
    top_digest: str  # what repo digests name: the index's digest for a multi-arch image
    manifest_digest: str
    manifest: Manifest


class ImageStore:
    def __init__(
        self,
        root: Path,
        *,
        registries: Registries | None = None,
        auth_file: str = "",
        limits: Limits | None = None,
        skopeo: str = "skopeo",
    ) -> None:
        self.disk = ImageDisk(root)
        self.registries = registries or Registries()
        self.limits = limits or Limits()
        self._lock = threading.Lock()
        self._images: dict[str, ImageRecord] = {}
        version, docs = self.disk.load_catalogue()
        changed = False
        for doc in docs:
            r = record_from_doc(doc)
            if not r.tree:  # written before trees were verified: verify it now, or drop it
                verified = verify_unverified(self.disk, self.limits, r)
                changed = True
                if verified is None:
                    continue
                r = verified
            self._images[r.id] = r
        for key in sorted({r.tree for r in self._images.values()}):
            if not self.disk.has_disk(key) and self.disk.has_tree(key):  # unpacked by an earlier version
                try:
                    self.disk.make_disk(self.disk.tree_path(key), key)
                except (VmSandboxError, OSError) as exc:
                    log.warning("image layers %s: no disk could be made of the tree: %s", key, exc)
        gone = [i for i, r in self._images.items() if not self.disk.has_disk(r.tree)]
        for i in gone:
            log.warning("image %s has no disk in the store: forgotten", i)
            del self._images[i]
        swept = self.disk.sweep(set(referenced_trees(self._images)), set(referenced_blobs(self._images)))
        if gone or changed or version != 2:
            self._save()
        if any(swept.values()):
            log.info("image store %s: deleted leftovers of unfinished pulls and removals: %s", root, swept)
        self.skopeo = Skopeo(self.disk.work / "skopeo", binary=skopeo, auth_file=auth_file)
        self._flights: dict[str, Future[str]] = {}
        self._image_locks: dict[str, threading.Lock] = {}
        self._inflight_blobs: Counter[str] = Counter()
        self._inflight_trees: Counter[str] = Counter()
        self._holders: Counter[str] = Counter()

    # -- queries ------------------------------------------------------------------------------------
    def get(self, query: str) -> ImageRecord | None:
        with self._lock:
            return lookup(visible(self._images), query)

    def list(self, query: str = "") -> list[ImageRecord]:
        with self._lock:
            images = list(visible(self._images).values())
        return sorted((r for r in images if not query or matches_filter(r, query)), key=lambda r: r.id)

    def usage(self) -> Usage:
        """What the images take on disk: blobs, disks and the trees an earlier version left (the
        kubelet's image GC reads it through ImageFsInfo)."""
        sizes, disks = self.disk.blob_sizes(), self.disk.disk_sizes()
        with self._lock:
            trees = {k for k in referenced_trees(self._images) if self.disk.has_tree(k)}
            return catalogue_usage(self._images, sizes, disks, trees)

    @property
    def root(self) -> Path:
        return self.disk.root

    # -- holders ------------------------------------------------------------------------------------
    def acquire(self, image_id: str) -> HeldImage:
        """Hold ``image_id`` for a container; returns its read-only disk and user names. NOT_FOUND
        if not stored.

        An image removed while held can still be acquired by id until ``collect()``: containers
        that ran from it re-acquire it when the shim restarts. New containers find images by name
        (``get``), which never returns a removed one."""
        with self._lock:
            record = self._images.get(image_id)
            if record is None:
                raise NotFound(f"image {bounded(image_id)} is not stored (pull it first)")
            self._holders[image_id] += 1
            key = record.tree
        try:
            facts = self.disk.facts(key)
        except BaseException:
            self.release(image_id)
            raise
        return HeldImage(self.disk.disk_path(key), disk_serial(key), facts.passwd, facts.group)

    def release(self, image_id: str) -> None:
        with self._lock:
            if self._holders[image_id] <= 0:
                return
            self._holders[image_id] -= 1
            if self._holders[image_id] == 0:
                del self._holders[image_id]
                record = self._images.get(image_id)
                if record is not None and record.removed:
                    self._images = without(self._images, image_id)
                    self._save()
                    self._free(record)
                elif record is not None and record.legacy_tree:
                    self._drop_legacy_trees([record])
                if record is not None:
                    self._drop_unheld_trees()

    def holders(self, image_id: str) -> int:
        with self._lock:
            return self._holders[image_id]

    def collect(self) -> None:
        """Free images removed while held whose holders did not come back (call after containers re-acquire)."""
        with self._lock:
            doomed = [r for r in self._images.values() if r.removed and self._holders[r.id] == 0]
            for r in doomed:
                self._images = without(self._images, r.id)
            if doomed:
                self._save()
            for r in doomed:
                self._free(r)
            self._drop_legacy_trees([r for r in self._images.values() if r.legacy_tree and self._holders[r.id] == 0])
            self._drop_unheld_trees()

    def _drop_unheld_trees(self) -> None:
        """Delete the trees an earlier version unpacked (and shared over 9p) of images no container
        holds: their disks serve every container from now on. Under the lock."""
        held = {r.tree for r in self._images.values() if self._holders[r.id] > 0}
        for key in {r.tree for r in self._images.values()} - held:
            if self.disk.has_disk(key) and self.disk.drop_tree(key):
                log.info("image layers %s: the tree of an earlier version is deleted (its disk stays)", key)

    def _drop_legacy_trees(self, records: Sequence[ImageRecord]) -> None:
        """Delete the earlier version's trees of ``records``, which no container holds. Under the lock."""
        if not records:
            return
        updated = {**self._images, **{r.id: replace(r, legacy_tree="") for r in records}}
        try:
            self._save(updated)
        except CannotFit as exc:  # housekeeping: tried again at the next release or start
            log.warning("earlier version's trees kept for now: %s", exc)
            return
        self._images = updated
        for r in records:
            self.disk.remove_tree(r.legacy_tree)
            log.info("image %s: the unverified tree of an earlier version is deleted", r.id)

    # -- remove -------------------------------------------------------------------------------------
    def remove(self, query: str) -> str | None:
        """RemoveImage: the whole image ``query`` names (every tag), as containerd does; absent is fine."""
        with self._lock:
            record = lookup(visible(self._images), query)
            if record is None:
                return None
            in_use = self._holders[record.id] > 0
            self._images = without(self._images, record.id, in_use=in_use)
            self._save()
            if in_use:
                log.info(
                    "image %s removed while %d container(s) hold it: freed on release",
                    record.id,
                    self._holders[record.id],
                )
            else:
                self._free(record)
            return record.id

    def _free(self, record: ImageRecord) -> None:
        """Delete ``record``'s disk (and tree, if an earlier version left one) and the blobs no other
        image (or pull in flight) uses. Under the lock."""
        if record.tree not in referenced_trees(self._images) and record.tree not in self._inflight_trees:
            self.disk.remove_tree(record.tree)
        if record.legacy_tree:
            self.disk.remove_tree(record.legacy_tree)
        keep = referenced_blobs(self._images) | set(self._inflight_blobs)
        self.disk.remove_blobs(b for b in record.blobs if b not in keep)

    def _save(self, images: dict[str, ImageRecord] | None = None) -> None:
        """Persist ``images`` (default: the current ones); a full disk is RESOURCE_EXHAUSTED."""
        docs = [record_doc(r) for r in sorted((images or self._images).values(), key=lambda r: r.id)]
        try:
            self.disk.save_catalogue(docs)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise CannotFit(f"no space left on the image store ({self.disk.root}) for its catalogue") from None
            raise

    # -- pull ---------------------------------------------------------------------------------------
    def pull(self, text: str, creds: Credentials | None = None) -> str:
        """Pull ``text`` and return the image id; concurrent pulls of one reference share the work."""
        ref = parse_reference(text)
        # one flight per reference and credentials: a pull never rides on someone else's login
        key = f"{ref}\0{_fingerprint(creds)}"
        with self._lock:
            flight = self._flights.get(key)
            leader = flight is None
            if flight is None:
                flight = self._flights[key] = Future()
        if not leader:
            metrics.image_pull_shared()
            return flight.result()
        started = time.monotonic()
        try:
            image_id, fetched = self._pull(ref, creds)
        except BaseException as exc:
            flight.set_exception(exc)
            metrics.image_pull("error", 0, time.monotonic() - started)
            raise
        finally:
            with self._lock:
                del self._flights[key]
        flight.set_result(image_id)
        metrics.image_pull("ok", fetched, time.monotonic() - started)
        return image_id

    @contextmanager
    def _image_lock(self, image_id: str) -> Iterator[None]:
        with self._lock:
            lock = self._image_locks.setdefault(image_id, threading.Lock())
        with lock:
            yield

    def _pull(self, ref: ImageReference, creds: Credentials | None) -> tuple[str, int]:
        resolved = self._resolve(ref, creds)
        image_id = resolved.manifest.config.digest
        with self._image_lock(image_id):
            with self._lock:
                stored = self._images.get(image_id)
            fetched = 0
            held: _Held | None = None
            # a stored image's disk was verified against its config (its id), whatever manifest names it now
            if stored is None or not self.disk.has_disk(stored.tree):
                stored, fetched, held = self._fetch(ref, resolved, creds)
            with self._lock:
                if held is not None:  # given up in the same critical section as the catalogue is written
                    self._unhold(held)
                updated = with_pulled(self._images, stored, ref, ref.with_digest(resolved.top_digest))
                try:
                    self._save(updated)
                except BaseException:
                    if fetched or image_id not in self._images:
                        self._free(stored)  # nothing names it: give the space back
                    raise
                self._images = updated
        log.info("pulled %s: image %s (%d bytes fetched)", ref, image_id, fetched)
        return image_id, fetched

    def _resolve(self, ref: ImageReference, creds: Credentials | None) -> Resolved:
        what = f"pulling {ref}"
        places = endpoints(ref, self.registries)
        raw = b""
        endpoint = places[-1]
        for i, endpoint in enumerate(places):
            try:
                raw = self.skopeo.fetch_manifest(endpoint, ref.fetch_by, _creds_for(ref, endpoint, creds), what)
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
            raw = self.skopeo.fetch_manifest(endpoint, entry.digest, _creds_for(ref, endpoint, creds), what)
            if sha256_digest(raw) != entry.digest:
                raise InvalidArgument(f"{what}: the {NODE_PLATFORM} manifest does not match its digest {entry.digest}")
            doc = parse_document(raw, what, entry.media_type)
            if not isinstance(doc, Manifest):
                raise InvalidArgument(f"{what}: the {NODE_PLATFORM} entry of the index is not an image manifest")
            check_media_types(doc, what)
            return Resolved(endpoint, top, entry.digest, doc)
        check_media_types(doc, what)
        return Resolved(endpoint, top, top, doc)

    def _unhold(self, held: _Held) -> None:
        """The blobs and tree of a pull are no longer in flight. Under the lock."""
        blobs, tree_key = held
        self._inflight_blobs.subtract(blobs)
        self._inflight_blobs += Counter()  # drop zero counts
        if tree_key:
            self._inflight_trees[tree_key] -= 1
            self._inflight_trees += Counter()

    def _fetch(
        self, ref: ImageReference, resolved: Resolved, creds: Credentials | None
    ) -> tuple[ImageRecord, int, _Held]:
        """Download, verify and unpack; on any failure delete what this pull brought and no one else uses.

        On success the blobs and the tree stay held as in flight (no removal frees them) until the
        caller gives them up with ``_unhold`` while it writes the catalogue."""
        what = f"pulling {ref}"
        manifest = resolved.manifest
        image_id = manifest.config.digest
        blobs = {resolved.manifest_digest, image_id, *(d.digest for d in manifest.layers)}
        with self._lock:
            missing = sum(d.size for d in (manifest.config, *manifest.layers) if not self.disk.has_blob(d.digest))
            self._inflight_blobs.update(blobs)
        work = self.disk.new_work_dir("pull")
        ok = False
        tree_key = ""
        try:
            t0 = time.monotonic()
            self._download(ref, resolved, creds, work, what)
            faults.checkpoint("pull:after-blobs")
            log.info(
                "%s: %d blobs in place (%d bytes fetched) in %.3f s", what, len(blobs), missing, time.monotonic() - t0
            )
            self.disk.read_blob(resolved.manifest_digest, MAX_DOCUMENT, what)  # the served bytes, checked
            config = parse_config(self.disk.read_blob(image_id, MAX_DOCUMENT, what), what)
            if (config.os, config.architecture) != (NODE_PLATFORM.os, NODE_PLATFORM.architecture):
                raise NotFound(f"{what}: the image is {config.os}/{config.architecture}, not {NODE_PLATFORM}")
            key = chain_id(config.diff_ids)
            with self._lock:
                self._inflight_trees[key] += 1
                tree_key = key  # held from here on: released by _unhold
            used, inodes = layers_disk(self.disk, self.limits, work, manifest, config, tree_key, what)
            faults.checkpoint("pull:after-tree")
            record = _record(image_id, resolved.manifest_digest, manifest, config, tree_key, used, inodes)
            ok = True
            return record, missing, (blobs, tree_key)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise CannotFit(f"{what}: no space left on the image store ({self.disk.root})") from None
            raise
        finally:
            self.disk.discard(work)
            if not ok:
                with self._lock:
                    self._unhold((blobs, tree_key))
                    if (
                        tree_key
                        and tree_key not in referenced_trees(self._images)
                        and tree_key not in self._inflight_trees
                    ):
                        self.disk.remove_tree(tree_key)
                    keep = referenced_blobs(self._images) | set(self._inflight_blobs)
                    self.disk.remove_blobs(b for b in blobs if b not in keep)

    def _download(
        self, ref: ImageReference, resolved: Resolved, creds: Credentials | None, work: Path, what: str
    ) -> None:
        """Bring the manifest, config and layers into the blob directory, as the registry served them."""
        endpoint, digest = resolved.endpoint, resolved.manifest_digest
        layout = work / "layout"
        self.skopeo.copy(endpoint, digest, _creds_for(ref, endpoint, creds), layout, self.disk.blob_dir, what)
        stored = _layout_manifest(layout, what)
        if stored != digest:
            raise InfrastructureError(f"{what}: skopeo stored manifest {stored}, the registry served {digest}")
        absent = [d for d in resolved.manifest.layers if not self.disk.has_blob(d.digest)]
        if absent:  # non-distributable layers naming URLs: the OCI layout holds them by reference only
            log.info("%s: %d non-distributable layer(s) fetched apart", what, len(absent))
            directory = work / "dir"
            self.skopeo.copy_dir(endpoint, digest, _creds_for(ref, endpoint, creds), directory, what)
            for d in absent:
                try:
                    self.disk.adopt_blob(directory / d.digest.removeprefix("sha256:"), d.digest)
                except FileNotFoundError:
                    raise InfrastructureError(f"{what}: layer {d.digest} did not arrive") from None


def _record(
    image_id: str,
    manifest_digest: str,
    manifest: Manifest,
    config: ImageConfig,
    tree_key: str,
    used: int,
    inodes: int,
) -> ImageRecord:
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


def _fingerprint(creds: Credentials | None) -> str:
    if creds is None:
        return ""
    return hashlib.sha256(json.dumps(creds.auth_entry(), sort_keys=True).encode()).hexdigest()


def _creds_for(ref: ImageReference, endpoint: Endpoint, creds: Credentials | None) -> Credentials | None:
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
