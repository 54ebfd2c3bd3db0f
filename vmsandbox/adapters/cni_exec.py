"""Runs one CNI plugin: finds its executable in the plugin directories, gives it the CNI
environment and its configuration on stdin, bounds its time and output, and turns a failure into
a ``CniError`` carrying the plugin's own message (``vmsandbox.cni`` builds input, reads output)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vmsandbox import cni

TIMEOUT_S = 60.0
MAX_OUTPUT = 1 << 20


def find_plugin(kind: str, bin_dirs: Sequence[str]) -> Path:
    """The executable for plugin type ``kind`` (a plain name checked by ``cni.parse_config``)."""
    for d in bin_dirs:
        path = Path(d) / kind
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise cni.CniError(f"CNI plugin {kind!r} not found in {', '.join(bin_dirs)}")


def run_plugin(
    kind: str, stdin: bytes, env: Mapping[str, str], bin_dirs: Sequence[str], *, want_result: bool
) -> dict[str, Any] | None:
    path = find_plugin(kind, bin_dirs)
    full_env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), **env}
    try:
        done = subprocess.run(
            [str(path)], input=stdin, env=full_env, capture_output=True, timeout=TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        raise cni.CniError(f"CNI plugin {kind} {env.get('CNI_COMMAND')} took longer than {TIMEOUT_S:.0f} s") from None
    except OSError as exc:
        raise cni.CniError(f"CNI plugin {kind} could not be run: {exc}") from None
    out, err = done.stdout[:MAX_OUTPUT], done.stderr[:MAX_OUTPUT]
    if done.returncode != 0:
        raise cni.CniError(
            f"CNI plugin {kind} {env.get('CNI_COMMAND')} failed: {cni.error_message(out, err, done.returncode)}"
        )
    return cni.parse_result(out, kind) if want_result else None
