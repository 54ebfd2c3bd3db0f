"""The CRI front's own checks (front/, a Go module): go vet, its tests (its wire formats, its
relay between an HTTP/2 client and two HTTP/2 upstreams in one process, and hostile clients) with
the race detector, and a short run of each of its fuzz targets (its framing, fed arbitrary bytes)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FRONT = REPO / "front"
FUZZ_TIME = "15s"  # per target; CI runs every target this long


def go() -> str:
    """The go command (/usr/local/go first, as scripts/build-front.sh takes it); skipped without one,
    failed under CI."""
    found = "/usr/local/go/bin/go" if os.access("/usr/local/go/bin/go", os.X_OK) else shutil.which("go")
    if found is None:
        message = "needs Go 1.26 or newer (in /usr/local/go or on PATH)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return found


def run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GOTOOLCHAIN": "local", "GO111MODULE": "on", "GOFLAGS": "-mod=readonly"}
    return subprocess.run(
        [go(), *args], cwd=FRONT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def test_front_go_vet() -> None:
    out = run("vet", "./...")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]


def test_front_go_tests_pass() -> None:
    out = run("test", "-race", "-count=1", "./...")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]


def _declared_targets() -> list[str]:
    """The fuzz targets declared in front/*_test.go (one test each, so workers run them side by side)."""
    return sorted({t for f in FRONT.glob("*_test.go") for t in re.findall(r"^func (Fuzz\w+)\(", f.read_text(), re.M)})


def test_every_fuzz_target_is_run() -> None:
    """The targets run below are exactly those ``go test -list`` finds."""
    listed = run("test", "-list", "^Fuzz", ".")
    assert listed.returncode == 0, listed.stdout[-4000:] + listed.stderr[-4000:]
    targets = sorted(re.findall(r"^(Fuzz\w+)$", listed.stdout, re.MULTILINE))
    assert targets, f"no fuzz target in front/: {listed.stdout}"
    assert targets == _declared_targets()


@pytest.mark.fuzz
@pytest.mark.parametrize("target", _declared_targets())
def test_front_fuzz_target_finds_nothing(target: str) -> None:
    out = run("test", "-run=^$", f"-fuzz=^{target}$", f"-fuzztime={FUZZ_TIME}", ".")
    assert out.returncode == 0, f"{target}:\n" + out.stdout[-4000:] + out.stderr[-4000:]
