"""The DRA driver's record files on the host: one JSON document per file in a directory of the
driver's own (0700), written atomically (temporary file, fsync, rename, fsync of the directory),
read bounded and never through a symlink. The claims store (``shim.dra.store``) and the ordinary
pods' links (``shim.dra.runc_nics``) keep their records so."""

from __future__ import annotations

import os
from pathlib import Path

MAX_RECORD_BYTES = 256 << 10


def read_bounded(path: Path) -> bytes:
    """The file's bytes; a symlink is refused (ELOOP), a file over the bound is a ValueError."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        data = os.read(fd, MAX_RECORD_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_RECORD_BYTES:
        raise ValueError(f"larger than {MAX_RECORD_BYTES} bytes")
    return data


def write_atomically(directory: Path, name: str, data: bytes) -> None:
    """``directory/name`` holds ``data`` whole or keeps what it held: a crash leaves at most a
    temporary ``.name.tmp`` beside it, which the next write replaces."""
    final, tmp = directory / name, directory / f".{Path(name).stem}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)
    fsync_dir(directory)


def fsync_dir(path: Path) -> None:
    """A rename or unlink in ``path`` survives a power cut."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
