"""The CRI front's own tests (front/*_test.go: its wire formats, and its relay between an HTTP/2
client and two HTTP/2 upstreams in one process), run with the race detector."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GOPATH_DEBIAN = Path("/usr/share/gocode")


def test_front_go_tests_pass() -> None:
    if shutil.which("go") is None or not (GOPATH_DEBIAN / "src/golang.org/x/net/http2").is_dir():
        pytest.skip("needs go and golang-golang-x-net-dev (scripts/setup-host.sh installs both)")
    env = {**os.environ, "GO111MODULE": "off", "GOPATH": str(GOPATH_DEBIAN), "GOFLAGS": ""}
    out = subprocess.run(
        ["go", "test", "-race", "-count=1", "."],
        cwd=REPO / "front",
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
