"""Helpers for the CLI tests: run the real ``vmsandbox`` entry point in a subprocess.

Every test here goes through ``python -m shim`` (the same ``main`` as the installed ``vmsandbox``
script), on fixture sysfs hosts and manifests under ``tests/cli/manifests``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
MANIFESTS = HERE / "manifests"
GOLDEN = HERE / "golden"
PROFILES = HERE / "profiles.yaml"
DEPLOY = REPO / "deploy"
SYSFS = REPO / "tests" / "fixtures" / "sysfs"
TWO_SOCKET = SYSFS / "two-socket-64-thread"
ONE_NODE = SYSFS / "one-node-2cpu"
VFIO_HOST = SYSFS / "vfio-two-node"
UPDATE_GOLDEN = os.environ.get("VMSANDBOX_UPDATE_GOLDEN") == "1"


def vmsandbox(*args: str | Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``vmsandbox ARGS...`` as a subprocess from the repository root; never raises on exit status."""
    return subprocess.run(
        [sys.executable, "-m", "shim", *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def vmsandbox_json(*args: str | Path) -> tuple[int, Any]:
    done = vmsandbox(*args, "--format", "json")
    assert done.stdout, f"no JSON on stdout (exit {done.returncode}); stderr: {done.stderr}"
    return done.returncode, json.loads(done.stdout)
