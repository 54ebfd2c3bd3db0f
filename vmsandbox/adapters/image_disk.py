"""The image store on disk: content-addressed blobs, image disks, the catalogue file, work space.

Layout under the store root (0700), known to this module and its owner ``shim.image_store`` only::

    blobs/sha256/<hex>   blobs by digest, as the registry served them (skopeo's shared blob
                         directory; renamed in after the digest check, so a name is never a
                         half-written blob)
    disks/<hex>.erofs    the root file system of the layers whose ChainID is sha256:<hex>, as a
                         read-only EROFS image (``mkfs.erofs``, checked whole by ``fsck.erofs``),
                         which pods' guests get as a virtio-blk disk (images with the same layers
                         share it)
    disks/<hex>.json     what the host reads of that file system: its unpacked size and inodes, and
                         its ``/etc/passwd`` and ``/etc/group`` (user names of CreateContainer);
                         in place before the disk, so a disk in place always has it
    trees/<hex>/         an unpacked tree, kept only from an earlier version (which shared trees
                         over 9p) until no container holds its image; a pull unpacks into work/ and
                         deletes the tree once its disk is made and checked
    catalogue.json       the image records; replaced by rename, so it is always a whole document
    work/                pulls in progress (OCI layouts, trees being unpacked, auth files);
                         whatever is here at start belonged to a pull that died, and is deleted

An image exists once ``catalogue.json`` names it; its disk and blobs are in place before that.
Catalogue version 2 records the tree of each image; version 1 (trees named by image id, their
layers never checked against the config's diff ids) is read so that its owner can verify it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vmsandbox.adapters.layers import Limits, tree_usage
from vmsandbox.errors import CannotFit, InfrastructureError, InternalError, InvalidArgument

CATALOGUE_VERSION = 2
_DIGEST = re.compile(r"sha256:([a-f0-9]{64})")
MAX_ETC_FILE_BYTES = 1 << 20
"""How much of an image's ``/etc/passwd`` or ``/etc/group`` the host keeps (and reads)."""


@dataclass(frozen=True)
class DiskFacts:
    """What the host knows of a disk's file system without reading the disk: the unpacked tree's
    bytes on disk and inodes, and the lines of its ``/etc/passwd`` and ``/etc/group``."""

    unpacked_bytes: int
    unpacked_inodes: int
    passwd: tuple[str, ...]
    group: tuple[str, ...]


def etc_lines(tree: Path, name: str) -> tuple[str, ...]:
    """Lines of ``etc/<name>`` in an image tree (at most MAX_ETC_FILE_BYTES); a symlink leading out
    of the tree, or anything but a regular file, reads as empty."""
    path = tree / "etc" / name
    try:
        real = path.resolve(strict=True)
    except OSError:
        return ()
    if not real.is_relative_to(tree.resolve()) or not real.is_file():
        return ()
    with real.open("rb") as f:
        return tuple(f.read(MAX_ETC_FILE_BYTES).decode(errors="replace").splitlines())


def _hex(digest: str) -> str:
    m = _DIGEST.fullmatch(digest)
    if not m:
        raise InternalError(f"not a sha256 digest: {digest[:100]!r}")
    return m.group(1)


class ImageDisk:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.blob_dir = root / "blobs"
        self._sha = self.blob_dir / "sha256"
        self._trees = root / "trees"
        self._disks = root / "disks"
        self.work = root / "work"
        self._catalogue = root / "catalogue.json"
        for d in (root, self.blob_dir, self._sha, self._trees, self._disks, self.work):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(root, 0o700)

    # -- blobs ------------------------------------------------------------------------------------
    def blob_path(self, digest: str) -> Path:
        return self._sha / _hex(digest)

    def has_blob(self, digest: str) -> bool:
        return self.blob_path(digest).is_file()

    def read_blob(self, digest: str, limit: int, what: str) -> bytes:
        """A small blob (manifest, config), checked against its digest."""
        path = self.blob_path(digest)
        try:
            with path.open("rb") as f:
                data = f.read(limit + 1)
        except FileNotFoundError:
            raise InfrastructureError(f"{what}: blob {digest} did not arrive in the store") from None
        if len(data) > limit:
            raise InvalidArgument(f"{what}: blob {digest} is larger than {limit} bytes")
        if "sha256:" + hashlib.sha256(data).hexdigest() != digest:
            path.unlink(missing_ok=True)
            raise InvalidArgument(f"{what}: blob {digest} does not match its digest (deleted)")
        return data

    def verify_blob(self, digest: str, what: str) -> None:
        """Hash a stored blob of any size; one that does not match its digest is deleted and refused."""
        h = hashlib.sha256()
        path = self.blob_path(digest)
        try:
            with path.open("rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
        except FileNotFoundError:
            raise InfrastructureError(f"{what}: blob {digest} did not arrive in the store") from None
        if "sha256:" + h.hexdigest() != digest:
            path.unlink(missing_ok=True)
            raise InvalidArgument(f"{what}: blob {digest} does not match its digest (deleted)")

    def adopt_blob(self, path: Path, digest: str) -> None:
        """Move a downloaded file into the blob directory under ``digest`` (rename; checked by the caller
        before anything reads it as that blob)."""
        os.rename(path, self.blob_path(digest))

    def blob_sizes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        with os.scandir(self._sha) as it:
            for e in it:
                if len(e.name) == 64:
                    try:
                        out[f"sha256:{e.name}"] = e.stat(follow_symlinks=False).st_blocks * 512
                    except FileNotFoundError:
                        continue
        return out

    def remove_blobs(self, digests: Iterable[str]) -> None:
        for d in digests:
            self.blob_path(d).unlink(missing_ok=True)

    # -- trees ------------------------------------------------------------------------------------
    def tree_path(self, key: str) -> Path:
        """The tree of layers with ChainID ``key`` an earlier version unpacked."""
        return self._trees / _hex(key)

    def has_tree(self, key: str) -> bool:
        return self.tree_path(key).is_dir()

    def new_work_dir(self, label: str) -> Path:
        return Path(tempfile.mkdtemp(prefix=f"{label}-", dir=self.work))

    # -- disks ------------------------------------------------------------------------------------
    def disk_path(self, key: str) -> Path:
        """The read-only EROFS image of the layers with ChainID ``key``."""
        return self._disks / f"{_hex(key)}.erofs"

    def _facts_path(self, key: str) -> Path:
        return self._disks / f"{_hex(key)}.json"

    def has_disk(self, key: str) -> bool:
        return self.disk_path(key).is_file() and self._facts_path(key).is_file()

    def facts(self, key: str) -> DiskFacts:
        """What was read of the disk's tree when the disk was made."""
        try:
            doc = json.loads(self._facts_path(key).read_text())
            return DiskFacts(
                unpacked_bytes=int(doc["unpacked_bytes"]),
                unpacked_inodes=int(doc["unpacked_inodes"]),
                passwd=tuple(str(line) for line in doc["passwd"]),
                group=tuple(str(line) for line in doc["group"]),
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise InfrastructureError(f"image disk {_hex(key)[:12]}: its facts cannot be read ({exc})") from None

    def disk_sizes(self) -> dict[str, int]:
        """Bytes on disk of each disk (with its facts file), by its layers' ChainID."""
        out: dict[str, int] = {}
        with os.scandir(self._disks) as it:
            for e in it:
                name, _, suffix = e.name.partition(".")
                if len(name) == 64 and suffix in ("erofs", "json"):
                    try:
                        size = e.stat(follow_symlinks=False).st_blocks * 512
                    except FileNotFoundError:
                        continue
                    out[f"sha256:{name}"] = out.get(f"sha256:{name}", 0) + size
        return out

    def make_disk(
        self,
        tree: Path,
        key: str,
        *,
        limits: Limits | None = None,
        mkfs: str = "mkfs.erofs",
        fsck: str = "fsck.erofs",
    ) -> DiskFacts:
        """Make the disk of ``tree`` (uncompressed EROFS: owners, modes, times, xattrs and file types
        as in the tree) in work/, check every file of it with ``fsck.erofs``, and move its facts,
        then it, into place: a disk in place is whole and checked, and has its facts. With
        ``limits`` (a tree the store did not unpack, hence did not bound) a tree beyond them is
        refused before anything is written."""
        used, inodes = tree_usage(str(tree), limits.max_entries if limits else None)
        if limits is not None and (inodes > limits.max_entries or used > limits.max_bytes):
            raise CannotFit(
                f"image layers {_hex(key)[:12]}: more than image_max_entries ({limits.max_entries}) entries"
                if inodes > limits.max_entries
                else f"image layers {_hex(key)[:12]}: {used} bytes, more than image_max_bytes ({limits.max_bytes})"
            )
        facts = DiskFacts(used, inodes, etc_lines(tree, "passwd"), etc_lines(tree, "group"))
        fd, tmp = tempfile.mkstemp(prefix="disk-", suffix=".erofs", dir=self.work)
        os.close(fd)
        facts_tmp = Path(tmp).with_suffix(".json")
        try:
            for argv, what in (([mkfs, "--quiet", tmp, str(tree)], "making"), ([fsck, "--extract", tmp], "checking")):
                done = subprocess.run(
                    argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False
                )
                if done.returncode != 0:
                    out = done.stdout.decode(errors="replace").strip()[-1000:]
                    raise InfrastructureError(
                        f"{what} the disk of image layers {_hex(key)[:12]} failed ({argv[0]}: {done.returncode}): {out}"
                    )
            os.chmod(tmp, 0o400)
            doc = {"unpacked_bytes": used, "unpacked_inodes": inodes, "passwd": facts.passwd, "group": facts.group}
            facts_tmp.write_text(json.dumps(doc))
            os.rename(facts_tmp, self._facts_path(key))
            os.rename(tmp, self.disk_path(key))
        except FileNotFoundError as exc:
            raise InfrastructureError(f"cannot make image disks: {exc.filename} is missing (erofs-utils)") from None
        finally:
            Path(tmp).unlink(missing_ok=True)
            facts_tmp.unlink(missing_ok=True)
        return facts

    def remove_tree(self, key: str) -> None:
        """Remove the disk of ``key`` and, left by an earlier version, its tree (renamed into work/
        first, so a crash half-way through the delete leaves only work/ garbage)."""
        self.disk_path(key).unlink(missing_ok=True)
        self._facts_path(key).unlink(missing_ok=True)
        self.drop_tree(key)

    def drop_tree(self, key: str) -> bool:
        """Delete the unpacked tree of ``key`` (an earlier version's), keeping its disk; whether
        there was one."""
        path = self.tree_path(key)
        if not path.exists():
            return False
        doomed = Path(tempfile.mkdtemp(prefix="removed-", dir=self.work))
        os.rename(path, doomed / "tree")
        self.discard(doomed)
        return True

    def discard(self, path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)

    # -- catalogue --------------------------------------------------------------------------------
    def load_catalogue(self) -> tuple[int, list[dict[str, Any]]]:
        """(version, image records) of the catalogue on disk; an absent one is empty and current."""
        try:
            doc = json.loads(self._catalogue.read_text())
        except FileNotFoundError:
            return CATALOGUE_VERSION, []
        except ValueError as exc:
            raise InternalError(f"{self._catalogue}: not valid JSON ({exc})") from None
        images = doc.get("images", []) if isinstance(doc, dict) else None
        if not isinstance(images, list):
            raise InternalError(f"{self._catalogue}: no images list")
        version = doc.get("version", 1)
        if version not in (1, CATALOGUE_VERSION):
            raise InternalError(f"{self._catalogue}: version {str(version)[:20]} is newer than this shim knows")
        return int(version), images

    def save_catalogue(self, images: list[dict[str, Any]]) -> None:
        fd, tmp = tempfile.mkstemp(prefix="catalogue-", dir=self.work)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"version": CATALOGUE_VERSION, "images": images}, f, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.rename(tmp, self._catalogue)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        dfd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    # -- start-up -----------------------------------------------------------------------------------
    def sweep(self, keep_trees: set[str], keep_blobs: set[str]) -> dict[str, int]:
        """Delete what no catalogued image owns: work/ leftovers, stray trees (``keep_trees``: ChainIDs)
        and blobs."""
        removed = {"work": 0, "trees": 0, "blobs": 0}
        for entry in list(self.work.iterdir()):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed["work"] += 1
        keep_tree_hex = {_hex(i) for i in keep_trees}
        for entry in list(self._trees.iterdir()):
            if entry.name not in keep_tree_hex:
                shutil.rmtree(entry, ignore_errors=True)
                removed["trees"] += 1
        for entry in list(self._disks.iterdir()):
            if entry.name.partition(".")[0] not in keep_tree_hex:
                entry.unlink(missing_ok=True)
                removed["disks"] = removed.get("disks", 0) + 1
        for entry in list(self.blob_dir.iterdir()):  # skopeo's temporary files of a copy that died
            if entry.name != "sha256" and not entry.is_dir():
                entry.unlink(missing_ok=True)
                removed["blobs"] += 1
        keep_blob_hex = {_hex(b) for b in keep_blobs}
        for entry in list(self._sha.iterdir()):
            if entry.name not in keep_blob_hex:
                entry.unlink(missing_ok=True)
                removed["blobs"] += 1
        return removed

    def usage_of_work(self) -> int:
        return sum(1 for _ in self.work.iterdir())
