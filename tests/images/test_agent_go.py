"""The guest agent's own Go tests (images/agent/*_test.go: its CRI log writer, log buffer, volume
copies, and its answers against the protocol's schema), with ``go vet`` and the race detector.
They need root (the volume tests set owners), Go and the schema validator the tests use in the Go
module cache (scripts/setup-host.sh installs both)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

AGENT = Path(__file__).resolve().parents[2] / "images" / "agent"


def _go(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CGO_ENABLED": "1", "GOFLAGS": "-mod=mod", "GOPROXY": "off"}
    return subprocess.run(["go", *args], cwd=AGENT, env=env, capture_output=True, text=True, timeout=600)


def test_agent_go_tests_pass() -> None:
    if shutil.which("go") is None or os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail("the agent's Go tests need go and root under CI (scripts/setup-host.sh installs go)")
        pytest.skip("needs go and root")
    vet = _go("vet", "./...")
    assert vet.returncode == 0, vet.stdout[-4000:] + vet.stderr[-4000:]
    out = _go("test", "-race", "-count=1", ".")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
