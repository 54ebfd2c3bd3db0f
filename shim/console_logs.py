"""The guests' console logs under the shim's ``console_dir``: one file per sandbox, named by its
id, which libvirt opens for the guest's serial console. The guest writes what is in it, so it is
only ever quoted from its last few KiB, escaped and bounded."""

from __future__ import annotations

import os
from pathlib import Path

from vmsandbox import validation

_CONSOLE_TAIL_BYTES = 16 * 1024
_CONSOLE_LINE_CHARS = 300


def console_path(console_dir: str, sandbox_id: str) -> str | None:
    """The console log of ``sandbox_id`` (None without a ``console_dir`` or for no sandbox id)."""
    if not console_dir or not validation.is_id(sandbox_id):
        return None
    return str(Path(console_dir) / f"{sandbox_id}.log")


def console_tail(console: str | None) -> str:
    """The guest console's last lines for an error message: the guest writes the console, so
    only its last ``_CONSOLE_TAIL_BYTES`` are read and each line is cut short."""
    if not console:
        return ""
    try:
        with open(console, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - _CONSOLE_TAIL_BYTES))
            text = f.read(_CONSOLE_TAIL_BYTES).decode(errors="replace")
    except OSError:
        return ""
    lines = [validation.bound(line, _CONSOLE_LINE_CHARS) for line in text.strip().splitlines()[-5:]]
    return "; last console lines: " + " | ".join(lines) if lines else "; the guest console is empty"


def remove_console_log(console_dir: str, sandbox_id: str) -> None:
    """Remove the console log of a sandbox being forgotten (none without a ``console_dir``)."""
    path = console_path(console_dir, sandbox_id)
    if path is not None:
        Path(path).unlink(missing_ok=True)
