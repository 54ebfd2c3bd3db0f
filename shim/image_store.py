"""``ImageStore``: the one owner of images — their blobs, disks and catalogue, who holds them, what they take.

A pull (``shim.rpc.pull_image`` orders its steps) resolves the reference against the registries
configuration (mirrors first) and reads the manifest (choosing linux/amd64 from an index); unless
the image is stored already, skopeo brings its blobs, as the registry served them, into the
content-addressed store (``download``), the layers are unpacked into a fresh tree under the
store's work directory while each is checked against its digest and the config's
``rootfs.diff_ids``, the tree's read-only EROFS disk made and every file of it checked, and the
disk moved into place under the ChainID of those layers with what the host reads of the tree (its
size, ``/etc/passwd`` and ``/etc/group``), the tree deleted (``unpack``); only then does the
catalogue name the image (``name``). Until it does, the pull's blobs and disk are held in flight,
so a removal of another image sharing them frees nothing of them, and each step's undo
(``drop_blobs``, ``drop_disk``, ``unname``) deletes what the pull brought and no one else uses: a
pull that fails or is refused half-way leaves nothing visible, and leftovers of one that died are
deleted at the next start. Concurrent pulls of one reference share one download (single flight,
``single_flight``); pulls of one image by different names share one unpack (``image_lock``);
images with the same layers share one disk; different images pull in parallel. The unpacking and
checking of the layers into the disk is ``shim.image_unpack``'s.

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

Containers hold the images they run from, each hold named by its container (``acquire``/``release``,
so a second release by the same container changes nothing). A removal (``shim.rpc.remove_image``)
hides the image at once (``hide``); a held one is freed when the last holder releases it, one no
container holds has its disk and blobs deleted (``free``) and then leaves the catalogue
(``forget``). A removal that stopped half-way is found again by the next one (``find_for_removal``)
and finished, or at the next start (``collect``).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from shim import metrics
from shim.image_fetch import Resolved, fetch_blobs, resolve
from shim.image_unpack import image_record, layers_disk, verify_unverified
from vmsandbox.adapters.image_disk import ImageDisk
from vmsandbox.adapters.layers import Limits
from vmsandbox.adapters.skopeo import Skopeo
from vmsandbox.errors import CannotFit, InvalidArgument, NotFound, VmSandboxError
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
    with_adopted,
    with_pulled,
    without,
)
from vmsandbox.image_catalogue import usage as catalogue_usage
from vmsandbox.image_ref import ImageReference, bounded
from vmsandbox.oci import MAX_DOCUMENT, NODE_PLATFORM, Descriptor, Manifest, chain_id, parse_config
from vmsandbox.registries import Credentials, Registries

log = logging.getLogger(__name__)


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


@dataclass
class Pulling:
    """A pull's blobs (``download``) and disk (``unpack``), held in flight (no removal frees them)
    until the catalogue names them (``name``) or the pull is undone (``drop_blobs``, ``drop_disk``)."""

    what: str
    resolved: Resolved
    blobs: frozenset[str]
    fetched: int  # bytes the registry sent
    tree_key: str = ""  # the ChainID of its layers, once ``unpack`` holds it
    blobs_held: bool = True
    tree_held: bool = False


@dataclass(frozen=True)
class Named:
    """What ``name`` changed in the catalogue: each record as it was before (None: there was none)
    and as written, for ``unname``."""

    before: dict[str, ImageRecord | None] = field(default_factory=dict)
    after: dict[str, ImageRecord] = field(default_factory=dict)


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
        self._holders: dict[str, set[str]] = {}  # image id -> the containers holding it

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
    def acquire(self, image_id: str, holder: str) -> HeldImage:
        """Hold ``image_id`` for container ``holder``; returns its read-only disk and user names.
        NOT_FOUND if not stored.

        An image removed while held can still be acquired by id until ``collect()``: containers
        that ran from it re-acquire it when the shim restarts. New containers find images by name
        (``get``), which never returns a removed one."""
        with self._lock:
            record = self._images.get(image_id)
            if record is None:
                raise NotFound(f"image {bounded(image_id)} is not stored (pull it first)")
            self._holders.setdefault(image_id, set()).add(holder)
            key = record.tree
        try:
            facts = self.disk.facts(key)
        except BaseException:
            self.release(image_id, holder)
            raise
        return HeldImage(self.disk.disk_path(key), disk_serial(key), facts.passwd, facts.group)

    def release(self, image_id: str, holder: str) -> None:
        """Container ``holder`` no longer holds ``image_id`` (it never did, or let go already: nothing
        changes); an image removed while held is freed with its last holder."""
        with self._lock:
            holders = self._holders.get(image_id, set())
            if holder not in holders:
                return
            holders.discard(holder)
            if holders:
                return
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
            return len(self._holders.get(image_id, ()))

    def _held(self, image_id: str) -> bool:
        """Under the lock."""
        return bool(self._holders.get(image_id))

    def collect(self) -> None:
        """Free images removed while held whose holders did not come back (call after containers
        re-acquire), and finish removals that stopped half-way."""
        with self._lock:
            doomed = [r for r in self._images.values() if r.removed and not self._held(r.id)]
            for r in doomed:
                self._images = without(self._images, r.id)
            if doomed:
                self._save()
            for r in doomed:
                self._free(r)
            self._drop_legacy_trees([r for r in self._images.values() if r.legacy_tree and not self._held(r.id)])
            self._drop_unheld_trees()

    def _drop_unheld_trees(self) -> None:
        """Delete the trees an earlier version unpacked (and shared over 9p) of images no container
        holds: their disks serve every container from now on. Under the lock."""
        held = {r.tree for r in self._images.values() if self._held(r.id)}
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

    # -- removal (RemoveImage: shim.rpc.remove_image) -------------------------------------------------
    def find_for_removal(self, query: str) -> ImageRecord | None:
        """The image a RemoveImage of ``query`` removes: the visible one it names, else one hidden by
        a removal that stopped half-way (no container holds it); None: nothing to remove."""
        with self._lock:
            found = lookup(visible(self._images), query)
            if found is None:
                unfinished = {i: r for i, r in self._images.items() if r.removed and not self._held(i)}
                found = lookup(unfinished, query)
            return found

    def hide(self, image_id: str) -> bool:
        """The image is removed as far as names go (written to the catalogue: lookups, lists and
        pulls no longer see it); returns whether containers hold it, which frees it when the last
        of them releases it."""
        with self._lock:
            record = self._images.get(image_id)
            if record is None:
                return False
            if not record.removed:
                updated = without(self._images, image_id, in_use=True)
                self._save(updated)
                self._images = updated
            held = self._held(image_id)
            if held:
                n = len(self._holders[image_id])
                log.info("image %s removed while %d container(s) hold it: freed on release", image_id, n)
            return held

    def free(self, image_id: str) -> None:
        """Delete the disk and blobs of a hidden image no container holds (those another image, or a
        pull in flight, uses stay)."""
        with self._lock:
            record = self._images.get(image_id)
            if record is not None and record.removed and not self._held(image_id):
                self._free(record)

    def forget(self, image_id: str) -> None:
        """A hidden image no container holds leaves the catalogue."""
        with self._lock:
            record = self._images.get(image_id)
            if record is not None and record.removed and not self._held(image_id):
                updated = without(self._images, image_id)
                self._save(updated)
                self._images = updated

    def _free(self, record: ImageRecord) -> None:
        """Delete ``record``'s disk (and tree, if an earlier version left one) and the blobs no other
        image (or pull in flight) uses. Under the lock."""
        others = {i: r for i, r in self._images.items() if i != record.id}
        if record.tree not in referenced_trees(others) and record.tree not in self._inflight_trees:
            self.disk.remove_tree(record.tree)
        if record.legacy_tree:
            self.disk.remove_tree(record.legacy_tree)
        keep = referenced_blobs(others) | set(self._inflight_blobs)
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

    # -- pull (PullImage: shim.rpc.pull_image) ---------------------------------------------------------
    def single_flight(self, ref: ImageReference, creds: Credentials | None, pull: Callable[[], tuple[str, int]]) -> str:
        """The image id ``pull`` (image id, bytes fetched) gives; concurrent pulls of one reference
        with the same credentials wait for the first one's and share its answer, or its error."""
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
            image_id, fetched = pull()
        except BaseException as exc:
            flight.set_exception(exc)
            metrics.image_pull("error", 0, time.monotonic() - started)
            raise
        finally:
            with self._lock:
                del self._flights[key]
        flight.set_result(image_id)
        metrics.image_pull("ok", fetched, time.monotonic() - started)
        log.info("pulled %s: image %s (%d bytes fetched)", ref, image_id, fetched)
        return image_id

    @contextmanager
    def image_lock(self, image_id: str) -> Iterator[None]:
        """One pull of ``image_id`` at a time (pulls by different names share one unpack)."""
        with self._lock:
            lock = self._image_locks.setdefault(image_id, threading.Lock())
        with lock:
            yield

    @contextmanager
    def work_dir(self) -> Iterator[Path]:
        """A pull's own directory under the store's work directory, deleted when it is done."""
        work = self.disk.new_work_dir("pull")
        try:
            yield work
        finally:
            self.disk.discard(work)

    def stored(self, image_id: str) -> ImageRecord | None:
        """The image, when it is stored with its disk: its disk was verified against its config (its
        id), whatever manifest names it now, so a pull of it fetches nothing."""
        with self._lock:
            record = self._images.get(image_id)
        return record if record is not None and self.disk.has_disk(record.tree) else None

    def resolve(self, ref: ImageReference, creds: Credentials | None) -> Resolved:
        """What the registry says ``ref`` is (``shim.image_fetch``)."""
        return resolve(self.skopeo, self.registries, ref, creds)

    def download(self, ref: ImageReference, resolved: Resolved, creds: Credentials | None, work: Path) -> Pulling:
        """The manifest, config and layers brought into the blob directory, as the registry served
        them, and held in flight; on failure nothing this pull brought is left."""
        what = f"pulling {ref}"
        manifest = resolved.manifest
        blobs = frozenset({resolved.manifest_digest, manifest.config.digest, *(d.digest for d in manifest.layers)})
        with self._lock:
            missing = sum(d.size for d in (manifest.config, *manifest.layers) if not self.disk.has_blob(d.digest))
            self._inflight_blobs.update(blobs)
        pulling = Pulling(what, resolved, blobs, missing)
        t0 = time.monotonic()
        try:
            with self._space(what):
                fetch_blobs(self.skopeo, self.disk, ref, resolved, creds, work, what)
        except BaseException:
            self.drop_blobs(pulling)
            raise
        log.info("%s: %d blobs in place (%d bytes fetched) in %.3f s", what, len(blobs), missing, time.monotonic() - t0)
        return pulling

    def drop_blobs(self, pulling: Pulling) -> None:
        """Undo of ``download``: its blobs are no longer in flight, and those no image uses are deleted."""
        with self._lock:
            self._unhold(pulling, tree=False)
            keep = referenced_blobs(self._images) | set(self._inflight_blobs)
            self.disk.remove_blobs(b for b in pulling.blobs if b not in keep)

    def unpack(self, pulling: Pulling, work: Path) -> ImageRecord:
        """The image's verified disk in place (made from its layers, or the one of the same layers
        stored already), held in flight; the record the catalogue will name. On failure a disk
        this pull made is deleted again."""
        what, resolved = pulling.what, pulling.resolved
        manifest, image_id = resolved.manifest, resolved.manifest.config.digest
        self.disk.read_blob(resolved.manifest_digest, MAX_DOCUMENT, what)  # the served bytes, checked
        config = parse_config(self.disk.read_blob(image_id, MAX_DOCUMENT, what), what)
        if (config.os, config.architecture) != (NODE_PLATFORM.os, NODE_PLATFORM.architecture):
            raise NotFound(f"{what}: the image is {config.os}/{config.architecture}, not {NODE_PLATFORM}")
        key = chain_id(config.diff_ids)
        with self._lock:
            self._inflight_trees[key] += 1
            pulling.tree_key, pulling.tree_held = key, True
        try:
            with self._space(what):
                used, inodes = layers_disk(self.disk, self.limits, work, manifest, config, key, what)
        except BaseException:
            self.drop_disk(pulling)
            raise
        return image_record(image_id, resolved.manifest_digest, manifest, config, key, used, inodes)

    def adopt(
        self,
        image_id: str,
        config_doc: bytes,
        names: tuple[Sequence[str], Sequence[str]],
        make_tree: Callable[[], AbstractContextManager[Path]],
    ) -> ImageRecord:
        """An image containerd pulled (shim mode): its config ``config_doc`` (whose digest is
        ``image_id``) and its layers, which ``make_tree`` shows merged, read-only. Its disk is made
        once, under the ChainID of its layers as a pull's is (a disk of the same layers, from a
        pull or an earlier adoption, serves as it is); the catalogue names it by ``names``
        (containerd's repo tags and repo digests). The store keeps no blobs of it. A config that
        is not the image's is refused, and layers beyond ``image_max_bytes`` or
        ``image_max_entries`` are, as a pull's are (RESOURCE_EXHAUSTED), before a disk is written."""
        what = f"image {bounded(image_id)} from containerd"
        if "sha256:" + hashlib.sha256(config_doc).hexdigest() != image_id:
            raise InvalidArgument(f"{what}: its config's digest is not its id")
        config = parse_config(config_doc, what)
        key = chain_id(config.diff_ids)
        with self.image_lock(image_id):
            stored = self.stored(image_id)
            if stored is not None:
                return stored
            with self._lock:
                self._inflight_trees[key] += 1
            try:
                if not self.disk.has_disk(key):
                    with self._space(what), make_tree() as tree:
                        self.disk.make_disk(tree, key, limits=self.limits)
                facts = self.disk.facts(key)
                record = replace(
                    image_record(image_id, "", Manifest("", Descriptor("", image_id, 0), ()), config, key,
                                 facts.unpacked_bytes, facts.unpacked_inodes),
                    size=facts.unpacked_bytes,
                )  # fmt: skip
                with self._lock:
                    updated = with_adopted(self._images, record, *names)
                    self._save(updated)
                    self._images = updated
            finally:
                with self._lock:
                    self._inflight_trees[key] -= 1
                    self._inflight_trees += Counter()
                    if key not in referenced_trees(self._images) and key not in self._inflight_trees:
                        self.disk.remove_tree(key)
        log.info("%s: disk of layers %s in place, named %s", what, key, ", ".join(names[0]) or "by digest")
        return updated[image_id]

    def drop_disk(self, pulling: Pulling) -> None:
        """Undo of ``unpack``: its disk is no longer in flight, and deleted unless an image uses it."""
        key = pulling.tree_key
        if not key:
            return
        with self._lock:
            self._unhold(pulling, blobs=False)
            if key not in referenced_trees(self._images) and key not in self._inflight_trees:
                self.disk.remove_tree(key)

    def name(self, record: ImageRecord, ref: ImageReference, top_digest: str, pulling: Pulling | None) -> Named:
        """The catalogue names ``record`` as ``ref`` (its tag taken from any other image) and by its
        repo digest; the pull's blobs and disk, named now, are no longer in flight (given up in
        the same critical section as the catalogue is written)."""
        with self._lock:
            before = self._images
            updated = with_pulled(before, record, ref, ref.with_digest(top_digest))
            self._save(updated)
            self._images = updated
            if pulling is not None:
                self._unhold(pulling)
        changed = {i: r for i, r in updated.items() if before.get(i) is not r}
        return Named({i: before.get(i) for i in changed}, changed)

    def unname(self, named: Named) -> None:
        """Undo of ``name``: each record it wrote is as it was before (one changed since stays)."""
        with self._lock:
            restored = dict(self._images)
            for i, written in named.after.items():
                if restored.get(i) is not written:
                    continue
                old = named.before.get(i)
                if old is None:
                    del restored[i]
                else:
                    restored[i] = old
            self._save(restored)
            self._images = restored

    def _unhold(self, pulling: Pulling, *, blobs: bool = True, tree: bool = True) -> None:
        """The pull's blobs and disk are no longer in flight (each at most once). Under the lock."""
        if blobs and pulling.blobs_held:
            self._inflight_blobs.subtract(pulling.blobs)
            self._inflight_blobs += Counter()  # drop zero counts
            pulling.blobs_held = False
        if tree and pulling.tree_held:
            self._inflight_trees[pulling.tree_key] -= 1
            self._inflight_trees += Counter()
            pulling.tree_held = False

    @contextmanager
    def _space(self, what: str) -> Iterator[None]:
        """A full store is RESOURCE_EXHAUSTED."""
        try:
            yield
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise CannotFit(f"{what}: no space left on the image store ({self.disk.root})") from None
            raise


def _fingerprint(creds: Credentials | None) -> str:
    if creds is None:
        return ""
    return hashlib.sha256(json.dumps(creds.auth_entry(), sort_keys=True).encode()).hexdigest()
