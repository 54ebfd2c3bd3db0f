"""The snapshot store: the only module that knows where snapshots live and how they are laid out.

Under ``<state_dir>/snapshots`` (0711: passable, so that the unprivileged QEMU of a snapshot
being made reaches its shared directories; nothing below it can be listed or read by others):

- ``<key>/image.save``: libvirt's save image of a guest with no pod identity (root's, 0600: libvirt
  writes and reads it as root and hands QEMU the open file), and ``<key>/inputs.json``: the
  ``SnapshotInputs`` it was made from (the key is their hash, so a directory whose inputs do not
  hash to its name is refused) and what its guest's agent said of itself before it was saved (its
  instance id and protocol: every clone restores with them, until ``personalize``); ``<key>`` is 0700;
- ``<key>/share/<n>``: the empty directories the snapshot guest's 9p devices pointed at (root's
  again once the snapshot is stored);
- ``making/<key>``: a snapshot being made (renamed into place when complete); passable, its
  ``share/<n>`` the making QEMU's uid's own (0700);
- ``restore/<sandbox id>.save``: the copy of an image a restore is reading, its header rewritten
  for the pod's domain (``vmsandbox.snapshot_rules.retarget``); removed when the restore returns, and
  swept at start-up (a shim killed during a restore);
- ``restore/spare-<key>-<stamp>.save``: a copy of the image made ahead, off any pod's critical path
  (``refill_spare``), that the next restore takes by renaming it and rewriting its header in place
  instead of copying the whole image; ``<stamp>`` names the image it was copied from (inode, mtime,
  size), so a spare of an image since replaced is never used. Written under a ``.partial`` name
  and renamed when complete; at most one per snapshot; swept at start-up like the copies.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from vmsandbox import validation
from vmsandbox.errors import InfrastructureError
from vmsandbox.snapshot_rules import SnapshotInputs, parse_save_header, retarget, snapshot_key

log = logging.getLogger(__name__)
_HEAD_READ = 2 << 20  # the header and its padded XML area fit in this


@dataclass(frozen=True)
class SavedAgent:
    """What the snapshot guest's agent reported before it was saved: every clone restores with this
    instance id (``personalize`` must change it) and speaks this protocol."""

    instance: str
    protocol: int


@dataclass(frozen=True)
class StoredSnapshot:
    key: str
    inputs: SnapshotInputs
    size_bytes: int
    created_ns: int
    make_ms: int
    agent: SavedAgent


class SnapshotStore:
    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.root = Path(state_dir) / "snapshots"

    def _ensure(self) -> None:
        for d, mode in ((self.root, 0o711), (self.root / "making", 0o711), (self.root / "restore", 0o700)):
            d.mkdir(mode=mode, parents=True, exist_ok=True)
            os.chmod(d, mode)  # a store of an earlier version has them 0700

    def _dir(self, key: str) -> Path:
        if not validation.is_full_id(key):
            raise InfrastructureError(f"not a snapshot key: {key[:80]!r}")
        return self.root / key

    # -- reading --------------------------------------------------------------------------------
    def get(self, key: str) -> StoredSnapshot | None:
        """The snapshot stored under ``key``, None when there is none or it is incomplete."""
        d = self._dir(key)
        try:
            doc = json.loads((d / "inputs.json").read_text())
            inputs = SnapshotInputs.from_doc(doc["inputs"])
            size = (d / "image.save").stat().st_size
            agent = SavedAgent(str(doc["agent"]["instance"]), int(doc["agent"]["protocol"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if snapshot_key(inputs) != key:
            log.warning("snapshot %s: its inputs hash to another key; ignored", key[:12])
            return None
        made = (int(doc.get("created_ns", 0)), int(doc.get("make_ms", 0)))
        return StoredSnapshot(key, inputs, size, *made, agent=agent)

    def all(self) -> list[StoredSnapshot]:
        out = []
        with contextlib.suppress(OSError):
            for d in sorted(self.root.iterdir()):
                if validation.is_full_id(d.name):
                    found = self.get(d.name)
                    if found is not None:
                        out.append(found)
        return out

    # -- making ---------------------------------------------------------------------------------
    def making_dir(self, key: str) -> Path:
        """A fresh directory to make the snapshot ``key`` in (passable, for its QEMU's shares)."""
        self._ensure()
        d = self.root / "making" / self._dir(key).name
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(mode=0o711)
        os.chmod(d, 0o711)  # whatever the umask
        return d

    def share_dirs(self, making: Path, count: int, qemu_uid: int) -> tuple[str, ...]:
        """The snapshot guest's ``count`` shared directories, empty, owned by the uid (and gid)
        its QEMU runs as, 0700: no other user opens them. Their real paths: QEMU resolves them
        as its uid, which may not pass through a link's directory (e.g. to the state directory)."""
        share = Path(os.path.realpath(making)) / "share"
        share.mkdir(mode=0o711, exist_ok=True)
        os.chmod(share, 0o711)
        out = []
        for i in range(count):
            s = share / str(i)
            s.mkdir(mode=0o700, exist_ok=True)
            os.chown(s, qemu_uid, qemu_uid)
            os.chmod(s, 0o700)
            out.append(str(s))
        return tuple(out)

    @staticmethod
    def image_path(making: Path) -> str:
        return str(making / "image.save")

    def commit(self, key: str, inputs: SnapshotInputs, making: Path, make_ms: int, agent: SavedAgent) -> StoredSnapshot:
        """Move a finished snapshot into place (after checking its image's header)."""
        if snapshot_key(inputs) != key:
            raise InfrastructureError("snapshot inputs do not match its key")
        with open(making / "image.save", "rb") as f:
            parse_save_header(f.read(_HEAD_READ))
        doc = {
            "inputs": inputs.to_doc(),
            "created_ns": time.time_ns(),
            "make_ms": make_ms,
            "agent": {"instance": agent.instance, "protocol": agent.protocol},
        }
        (making / "inputs.json").write_text(json.dumps(doc, indent=1, sort_keys=True))
        # the uid that made it goes back to the range (a pod's QEMU may get it next): nothing kept is its
        with contextlib.suppress(FileNotFoundError):
            for s in (making / "share").iterdir():
                os.lchown(s, 0, 0)
        os.chmod(making, 0o700)
        target = self._dir(key)
        self._remove_spares(key)
        shutil.rmtree(target, ignore_errors=True)
        os.rename(making, target)
        found = self.get(key)
        if found is None:
            raise InfrastructureError(f"snapshot {key[:12]} vanished after it was stored")
        return found

    def abandon(self, key: str) -> None:
        shutil.rmtree(self.root / "making" / self._dir(key).name, ignore_errors=True)

    def share_dirs_of(self, key: str, count: int) -> tuple[str, ...]:
        """The 9p directories of a stored snapshot's guest (they stay, empty, with its image)."""
        return tuple(str(self._dir(key) / "share" / str(i)) for i in range(count))

    def remove(self, key: str) -> bool:
        d = self._dir(key)
        self._remove_spares(key)
        if not d.exists():
            return False
        shutil.rmtree(d)
        return True

    # -- restoring ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def staged(self, key: str, sandbox_id: str, name: str, uuid: str) -> Iterator[str]:
        """A copy of snapshot ``key``'s image that restores as domain ``name``/``uuid``, for as long
        as the ``with`` block runs. InfrastructureError when the image is missing, truncated or its
        header is corrupt."""
        if not validation.is_full_id(sandbox_id):
            raise InfrastructureError(f"not a sandbox id: {sandbox_id[:80]!r}")
        self._ensure()
        src = self._dir(key) / "image.save"
        dst = self.root / "restore" / f"{sandbox_id}.save"
        try:
            with open(src, "rb") as f:
                header = parse_save_header(f.read(_HEAD_READ))
                st = os.fstat(f.fileno())
                size = st.st_size
                if size <= header.stream_offset:
                    raise InfrastructureError("libvirt save image holds no guest state (truncated)")
                head = retarget(header, name, uuid)
                if self._take_spare(key, st, dst):  # a copy of this very image: its header only
                    fd = os.open(dst, os.O_WRONLY | os.O_NOFOLLOW)
                    try:
                        if os.fstat(fd).st_size != size or os.pwrite(fd, head, 0) != len(head):
                            raise InfrastructureError("a spare copy of the snapshot image is not whole")
                    finally:
                        os.close(fd)
                else:
                    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
                    try:
                        os.write(fd, head)
                        _copy_range(f.fileno(), fd, header.stream_offset, size - header.stream_offset)
                    finally:
                        os.close(fd)
        except OSError as exc:
            dst.unlink(missing_ok=True)
            raise InfrastructureError(f"snapshot {key[:12]}: cannot read its image: {exc}") from exc
        except BaseException:
            dst.unlink(missing_ok=True)
            raise
        try:
            yield str(dst)
        finally:
            dst.unlink(missing_ok=True)

    # -- spare copies ---------------------------------------------------------------------------
    def _spare(self, key: str, st: os.stat_result) -> Path:
        return self.root / "restore" / f"spare-{self._dir(key).name}-{st.st_ino}-{st.st_mtime_ns}-{st.st_size}.save"

    def _take_spare(self, key: str, st: os.stat_result, dst: Path) -> bool:
        """Rename the spare copy of the image ``st`` describes to ``dst``; False when there is none
        (or another restore took it first)."""
        try:
            os.rename(self._spare(key, st), dst)
            return True
        except FileNotFoundError:
            return False

    def _remove_spares(self, key: str) -> None:
        with contextlib.suppress(OSError):
            for f in (self.root / "restore").glob(f"spare-{self._dir(key).name}-*"):
                f.unlink(missing_ok=True)

    def refill_spare(self, key: str) -> bool:
        """Copy snapshot ``key``'s image ahead for the next restore, unless a spare of it is there
        already (spares of an earlier image of the key are removed); True when one was made. Called
        off any pod's path: a copy takes tens of milliseconds and the image's size on disk."""
        self._ensure()
        src = self._dir(key) / "image.save"
        with _spare_lock:
            if key in _refilling:
                return False
            _refilling.add(key)
        partial = self.root / "restore" / f"spare-{key}.partial-{os.getpid()}-{threading.get_ident()}"
        try:
            with open(src, "rb") as f:
                st = os.fstat(f.fileno())
                spare = self._spare(key, st)
                if spare.exists():
                    return False
                self._remove_spares(key)
                fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                try:
                    _copy_range(f.fileno(), fd, 0, st.st_size)
                finally:
                    os.close(fd)
            os.rename(partial, spare)
            return True
        except FileNotFoundError:
            return False  # the snapshot was removed meanwhile
        finally:
            partial.unlink(missing_ok=True)
            with _spare_lock:
                _refilling.discard(key)

    def sweep(self, keep: set[str]) -> list[str]:
        """Remove restore copies of sandboxes not in ``keep``, spare copies (whole or partial) and
        half-made snapshots (a shim that died during a restore or a make); the paths removed."""
        removed = []
        with contextlib.suppress(OSError):
            for f in (self.root / "restore").iterdir():
                if f.name.removesuffix(".save") not in keep:
                    f.unlink(missing_ok=True)
                    removed.append(str(f))
        with contextlib.suppress(OSError):
            for d in (self.root / "making").iterdir():
                shutil.rmtree(d, ignore_errors=True)
                removed.append(str(d))
        return removed


_spare_lock = threading.Lock()
_refilling: set[str] = set()  # keys whose spare is being copied (guarded by _spare_lock)


def _copy_range(src: int, dst: int, offset: int, length: int) -> None:
    """Copy ``length`` bytes at ``offset`` of ``src`` to the same offset of ``dst`` (in the kernel)."""
    while length > 0:
        n = os.copy_file_range(src, dst, length, offset, offset)
        if n <= 0:
            raise InfrastructureError("snapshot image shrank while it was copied")
        offset, length = offset + n, length - n
