"""How containerd reaches vmsandbox in shim mode (vmsandbox/containerd_config.py): the drop-in, each
handler's runtime type and launcher name (and the handler read back from it), the shim directory's
file, and the CLI that prints the drop-in and links the launchers."""

from __future__ import annotations

import os
import sys
import tomllib
from pathlib import Path

import pytest

from cli.main import main
from vmsandbox.containerd_config import (
    LAUNCHER,
    SHIM_DIR_FILE,
    drop_in,
    handler_of_launcher,
    launcher_name,
    runtime_type,
    shim_dir_of,
    shim_dir_text,
)
from vmsandbox.errors import InvalidArgument

REPO = Path(__file__).resolve().parents[2]


def test_each_handler_is_a_shim_runtime_of_its_own_type_without_options() -> None:
    doc = tomllib.loads(drop_in(["vmsandbox", "vmsandbox-medium"]))
    assert doc["version"] == 3
    runtimes = doc["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]
    assert sorted(runtimes) == ["vmsandbox", "vmsandbox-medium"]
    r = runtimes["vmsandbox-medium"]
    assert r == {
        "runtime_type": "io.containerd.vmsandbox-vmsandbox-medium.v1",
        "sandboxer": "shim",
        "snapshotter": "overlayfs",
        "disable_pause_image_pull": True,
    }  # no options: containerd's CRI can then give a user-namespaced container's task runc's
    assert runtimes["vmsandbox"]["runtime_type"] == "io.containerd.vmsandbox.v1"


def _binary_name(runtime: str) -> str:
    """containerd's shim binary name rule (pkg/shim/util.go BinaryName, v2.4.2)."""
    parts = runtime.split(".")
    return f"containerd-shim-{parts[-2]}-{parts[-1]}"


@pytest.mark.parametrize(
    ("handler", "launcher"),
    [
        ("vmsandbox", "containerd-shim-vmsandbox-v1"),
        ("fast", "containerd-shim-vmsandbox-fast-v1"),
        ("vmsandbox-medium", "containerd-shim-vmsandbox-vmsandbox-medium-v1"),
        ("x-v1", "containerd-shim-vmsandbox-x-v1-v1"),
        ("v1", "containerd-shim-vmsandbox-v1-v1"),
        ("a" * 63, f"containerd-shim-vmsandbox-{'a' * 63}-v1"),
    ],
)
def test_the_launchers_name_is_containerds_binary_of_the_runtime_type_and_names_the_handler_back(
    handler: str, launcher: str
) -> None:
    assert launcher_name(handler) == launcher == _binary_name(runtime_type(handler))
    assert handler_of_launcher(launcher) == handler


def test_the_launcher_as_installed_is_the_default_handlers() -> None:
    assert handler_of_launcher(LAUNCHER) == "vmsandbox"


@pytest.mark.parametrize(
    "name",
    [
        "containerd-shim-runc-v2",
        "containerd-shim-vmsandbox-v2",
        "containerd-shim-kata-v1",
        "containerd-shim-vmsandbox--v1",
        "containerd-shim-vmsandbox-Bad_Name-v1",
        "launch.py",
        "python3",
        "",
    ],
)
def test_a_name_that_is_no_launchers_names_no_handler(name: str) -> None:
    with pytest.raises(InvalidArgument, match="runtime handler"):
        handler_of_launcher(name)


@pytest.mark.parametrize("handler", ["Bad_Name", "a'b", "", "a.b"])
def test_what_would_break_the_toml_or_the_name_is_refused(handler: str) -> None:
    with pytest.raises(InvalidArgument):
        drop_in([handler])


def test_the_shim_directorys_file_reads_back() -> None:
    assert shim_dir_of(shim_dir_text("/run/x/containerd")) == "/run/x/containerd"
    assert shim_dir_of("/run/y") == "/run/y"


@pytest.mark.parametrize("text", ["relative\n", "\n", "", "/a\n/b\n", "/a/../b\n"])
def test_a_shim_directorys_file_that_names_no_absolute_path_is_refused(text: str) -> None:
    with pytest.raises(InvalidArgument):
        shim_dir_of(text)


def test_the_cli_prints_it_for_the_profiles(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "containerd", str(REPO / "deploy" / "profiles.yaml")]) == 0
    doc = tomllib.loads(capsys.readouterr().out)
    assert "vmsandbox" in doc["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]


def test_the_cli_links_each_handlers_launcher_with_the_shim_directory_beside(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profiles = str(REPO / "deploy" / "profiles.yaml")
    args = ["profile", "containerd", profiles, "--launchers", str(tmp_path), "--shim-dir", "/run/s"]
    assert main(args) == 0
    runtimes = tomllib.loads(capsys.readouterr().out)["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]
    target = os.path.join(os.path.dirname(sys.executable), LAUNCHER)
    for handler in runtimes["runtimes"]:
        assert os.readlink(tmp_path / launcher_name(handler)) == target
    assert (tmp_path / SHIM_DIR_FILE).read_text() == "/run/s\n"
    assert main(args) == 0  # again: the same links are there


def test_the_cli_refuses_a_shim_directory_without_launchers() -> None:
    assert main(["profile", "containerd", str(REPO / "deploy" / "profiles.yaml"), "--shim-dir", "/run/s"]) != 0
