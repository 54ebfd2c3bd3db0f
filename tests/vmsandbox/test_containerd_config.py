"""containerd's drop-in for shim mode (vmsandbox/containerd_config.py), and the CLI that prints it."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from cli.main import main
from vmsandbox.containerd_config import RUNTIME_TYPE, drop_in
from vmsandbox.errors import InvalidArgument

REPO = Path(__file__).resolve().parents[2]


def test_each_handler_is_a_shim_runtime_the_launcher_can_read() -> None:
    doc = tomllib.loads(drop_in(["vmsandbox", "vmsandbox-medium"], "/run/vmsandbox/containerd"))
    assert doc["version"] == 3
    runtimes = doc["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]
    assert sorted(runtimes) == ["vmsandbox", "vmsandbox-medium"]
    r = runtimes["vmsandbox-medium"]
    assert (r["runtime_type"], r["sandboxer"], r["snapshotter"], r["disable_pause_image_pull"]) == (
        RUNTIME_TYPE, "shim", "overlayfs", True
    )  # fmt: skip
    assert r["options"] == {"Handler": "vmsandbox-medium", "ShimDir": "/run/vmsandbox/containerd"}


@pytest.mark.parametrize(("handlers", "shim_dir"), [(["Bad_Name"], "/run/x"), (["ok"], "relative"), (["a'b"], "/r")])
def test_what_would_break_the_toml_is_refused(handlers: list[str], shim_dir: str) -> None:
    with pytest.raises(InvalidArgument):
        drop_in(handlers, shim_dir)


def test_the_cli_prints_it_for_the_profiles(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "containerd", str(REPO / "deploy" / "profiles.yaml"), "--shim-dir", "/run/s"]) == 0
    doc = tomllib.loads(capsys.readouterr().out)
    assert "vmsandbox" in doc["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]
