"""The check that a package under gen/ is what scripts/gen-proto.sh makes of proto/gen/ now."""

from __future__ import annotations

import filecmp
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def assert_up_to_date(tmp_path: Path, package: str) -> None:
    """gen/<package>'s generated files (every file but the hand-written ``__init__.py`` files, in
    every directory below it) are exactly what a fresh run of scripts/gen-proto.sh writes."""
    if importlib.util.find_spec("grpc_tools") is None:
        pytest.skip("grpcio-tools is not installed, cannot regenerate")
    result = subprocess.run(
        ["bash", str(REPO_ROOT / "scripts" / "gen-proto.sh"), str(tmp_path)],
        cwd=REPO_ROOT,
        env=dict(os.environ, PYTHON=sys.executable),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    fresh, kept = tmp_path / "gen" / package, REPO_ROOT / "gen" / package
    made = sorted(str(p.relative_to(fresh)) for p in fresh.rglob("*") if p.is_file())
    ours = sorted(
        str(p.relative_to(kept))
        for p in kept.rglob("*")
        if p.is_file() and p.name != "__init__.py" and "__pycache__" not in p.parts
    )
    assert made == ours
    assert [n for n in made if not filecmp.cmp(fresh / n, kept / n, shallow=False)] == []
