"""The kubelet's atomic-writer volumes (ConfigMap, Secret, projected, downward API) as a guest gets
them: copies, not shares.

The kubelet writes such a volume as ``<vol>/..<timestamp>/`` holding the files, ``<vol>/..data``
a symlink to that directory, and each user-visible name a symlink ``<name> -> ..data/<name>``;
an update writes a new timestamped directory and renames a new ``..data`` over the old one. A
guest cannot read those host symlinks through a 9p share in the ``mapped`` security model (they
read as ELOOP), and through a share it would see the files' owners as QEMU's uid. So the shim
reads one version of the volume on the host (``vmsandbox.adapters.volume_reader``) and the guest
agent writes it into a tmpfs of its own with the same layout, owners and modes, swapping
``..data`` as the kubelet does, whenever the host's ``..data`` changes (``shim.pod_volumes``).

This module is the pure part: which host paths are such volumes, one version of a volume
(``VolumeTree``), and the agent requests that put it into the guest.
"""

from __future__ import annotations

import base64
import hashlib
import posixpath
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Literal

from vmsandbox.userns import UserNamespace

PLUGINS = (
    "kubernetes.io~configmap",
    "kubernetes.io~secret",
    "kubernetes.io~projected",
    "kubernetes.io~downward-api",
)
"""The kubelet's volume plugins that write their volumes with its atomic writer."""

DATA_LINK = "..data"
VERSION_PATTERN = re.compile(r"\.\.[0-9A-Za-z_.-]{1,128}")
"""A version directory's name: the kubelet makes ``..2006_01_02_15_04_05.<random digits>``."""
_NAME_PATTERN = re.compile(r"[^/\x00]{1,255}")

MAX_ENTRIES = 4096
"""Files and directories one volume may hold (the kubelet's own objects are at most 1 MiB each)."""
MAX_BYTES = 64 << 20
"""Bytes of file content one volume may hold."""
MAX_DEPTH = 32
"""Directory levels below a version directory."""
CHUNK_BYTES = 384 << 10
"""File bytes per agent request: 512 KiB once base64-encoded, within the agent's 1 MiB line."""

GUEST_VOLUMES_DIR = "/run/vmsandbox/volumes"
"""Where the guest agent keeps the copies (a tmpfs in the guest: images/agent/volumes.go)."""


@dataclass(frozen=True)
class Meta:
    """Permission bits (with setuid, setgid and sticky), owner and group of a file or directory."""

    mode: int
    uid: int
    gid: int


@dataclass(frozen=True)
class Entry:
    """A directory or regular file of a version, by its path below the version directory."""

    path: str
    kind: Literal["dir", "file"]
    meta: Meta
    data: bytes = b""


@dataclass(frozen=True)
class VolumeTree:
    """One version of an atomic-writer volume: the version directory's name, the volume
    directory's own owner and mode, the version directory's, and its entries, each directory
    before what it holds."""

    version: str
    root: Meta
    top: Meta
    entries: tuple[Entry, ...]

    @property
    def names(self) -> tuple[str, ...]:
        """The user-visible names: the first path component of every entry (the kubelet links
        each as ``<name> -> ..data/<name>``)."""
        return tuple(sorted({e.path.split("/", 1)[0] for e in self.entries}))

    @property
    def size(self) -> int:
        return sum(len(e.data) for e in self.entries)


def is_atomic_volume(real_path: str, pods_dir: str) -> bool:
    """Whether ``real_path`` (symlinks resolved) is a volume directory the kubelet's atomic writer
    keeps: ``<pods_dir>/<pod uid>/volumes/<plugin>/<name>`` for a plugin of ``PLUGINS``."""
    rel = posixpath.relpath(real_path, pods_dir)
    parts = rel.split("/")
    return (
        len(parts) == 4
        and not rel.startswith("..")
        and parts[1] == "volumes"
        and parts[2] in PLUGINS
        and all(parts[i] not in ("", ".", "..") for i in (0, 3))
    )


def is_version(name: str) -> bool:
    return VERSION_PATTERN.fullmatch(name) is not None and name != DATA_LINK and name not in ("..", "...")


def valid_name(name: str) -> bool:
    """A file or directory name the guest may be given (not ``.``, ``..``, no slash, no NUL)."""
    return _NAME_PATTERN.fullmatch(name) is not None and name not in (".", "..")


def volume_id(real_path: str) -> str:
    """The guest directory's name for the volume at host path ``real_path`` (a digest: the host's
    paths are not the guest's business)."""
    return hashlib.sha256(real_path.encode()).hexdigest()[:32]


def guest_path(vid: str) -> str:
    return f"{GUEST_VOLUMES_DIR}/{vid}"


def _meta(m: Meta) -> dict[str, int]:
    return {"mode": m.mode & 0o7777, "uid": m.uid, "gid": m.gid}


def write_batches(vid: str, tree: VolumeTree, chunk: int = CHUNK_BYTES) -> Iterator[dict[str, object]]:
    """The ``volume_write`` requests that put ``tree``'s entries into the guest's staging
    directory of its version, in order: each holds entries whose file data add up to at most
    ``chunk`` bytes; a larger file is split, its later parts carrying their ``offset``."""
    batch: list[dict[str, object]] = []
    room = chunk

    def flush() -> dict[str, object]:
        nonlocal batch, room
        out: dict[str, object] = {"volume": vid, "version": tree.version, "entries": batch}
        batch, room = [], chunk
        return out

    for e in tree.entries:
        head: dict[str, object] = {"path": e.path, "type": e.kind, **_meta(e.meta)}
        if e.kind == "dir":
            batch.append(head)
            continue
        offset = 0
        while True:
            if room == 0:
                yield flush()
            part = e.data[offset : offset + room]
            batch.append({**head, "offset": offset, "data": base64.b64encode(part).decode()})
            room -= len(part)
            offset += len(part)
            if offset >= len(e.data):
                break
    if batch:
        yield flush()


def commit_args(vid: str, tree: VolumeTree) -> dict[str, object]:
    """The ``volume_commit`` request: the staged version becomes ``..data``, the user-visible
    names are linked to it (and names of the old version no longer in it unlinked), and the volume
    and version directories take the host's owners and modes."""
    return {
        "volume": vid,
        "version": tree.version,
        "root": _meta(tree.root),
        "top": _meta(tree.top),
        "names": list(tree.names),
    }


def shifted(tree: VolumeTree, ns: UserNamespace | None) -> VolumeTree:
    """``tree`` with every owner and group as the guest must store them for a container in the
    pod's user namespace to see the kubelet's: each id taken through the namespace's mappings, as
    an idmapped bind of the kubelet's directory shows it (an id it does not map shows as
    ``userns.OVERFLOW_ID``). Unchanged for a pod in the node's user namespace."""
    if ns is None:
        return tree

    def meta(m: Meta) -> Meta:
        return Meta(m.mode, ns.host_uid(m.uid), ns.host_gid(m.gid))

    return replace(
        tree,
        root=meta(tree.root),
        top=meta(tree.top),
        entries=tuple(replace(e, meta=meta(e.meta)) for e in tree.entries),
    )
