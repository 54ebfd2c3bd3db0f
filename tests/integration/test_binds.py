"""The bind mounts that share container volumes live (vmsandbox/adapters/binds.py): real mounts in
the host's namespace. What matters most is that deleting a sandbox's tree never deletes the host
files a bind made reachable in it."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from vmsandbox.adapters import binds
from vmsandbox.errors import InfrastructureError

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="bind mounts need root"),
]


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path
    binds.unmount_all(tmp_path)


def test_a_bind_shows_the_host_files_both_ways_and_removal_spares_them(tree: Path) -> None:
    volume = tree / "volume"
    volume.mkdir()
    (volume / "data").write_text("from the host\n")
    shared = tree / "sandbox" / "shared"
    (shared / "containers" / "c1").mkdir(parents=True)
    binds.make_shared(shared)
    binds.make_shared(shared)  # idempotent
    target = shared / "containers" / "c1" / "0"
    target.mkdir()
    binds.bind(volume, target, readonly=False)
    assert (target / "data").read_text() == "from the host\n"
    (target / "written").write_text("from the sandbox\n")
    assert (volume / "written").read_text() == "from the sandbox\n"
    assert binds.mounts_under(tree / "sandbox") == [str(target), str(shared)]

    binds.remove_tree(tree / "sandbox")
    assert not (tree / "sandbox").exists()
    assert sorted(p.name for p in volume.iterdir()) == ["data", "written"]
    assert binds.mounts_under(tree) == []


def test_read_only_binds_refuse_writes_and_file_binds_work(tree: Path) -> None:
    log = tree / "termination-log"
    log.write_text("")
    config = tree / "config"
    config.mkdir()
    (config / "key").write_text("value\n")
    shared = tree / "shared"
    shared.mkdir()
    binds.make_shared(shared)
    (shared / "log").touch()
    (shared / "config").mkdir()
    binds.bind(log, shared / "log", readonly=False)
    binds.bind(config, shared / "config", readonly=True)
    (shared / "log").write_text("done\n")
    assert log.read_text() == "done\n"
    with pytest.raises(OSError):
        (shared / "config" / "key").write_text("changed\n")
    assert (config / "key").read_text() == "value\n"
    binds.remove_tree(shared)
    assert log.read_text() == "done\n" and (config / "key").exists()


@pytest.mark.parametrize("recursive", [False, True])
def test_read_only_holds_in_a_namespace_made_before_the_bind(tree: Path, recursive: bool) -> None:
    """QEMU's mount namespace is a slave copy made when the guest started; a bind made later must
    reach it read-only, and (recursive or not) the mounts below the source must follow suit."""
    source = tree / "source"
    (source / "tmpfs").mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "none", str(source / "tmpfs")], check=True)
    shared = tree / "shared"
    shared.mkdir()
    binds.make_shared(shared)
    namespace = subprocess.Popen(["unshare", "--mount", "--propagation", "slave", "sleep", "60"])
    try:
        target = shared / "volume"
        target.mkdir()
        binds.bind(source, target, readonly=True, recursive=recursive)

        def writes(path: Path) -> bool:
            script = f"echo x > {path}"
            argv = ["nsenter", "-t", str(namespace.pid), "-m", "sh", "-c", script]
            return subprocess.run(argv, capture_output=True).returncode == 0

        assert not writes(target / "top")
        assert writes(target / "tmpfs" / "below") is not recursive
        assert not (target / "top").exists()
    finally:
        namespace.kill()
        namespace.wait()
        binds.remove_tree(shared)
        binds.unmount_all(source)


@pytest.mark.parametrize(
    ("propagation", "seen"), [("private", False), ("host-to-container", True), ("bidirectional", True)]
)
def test_host_mounts_made_later_reach_the_guest_as_propagation_says(tree: Path, propagation: str, seen: bool) -> None:
    source = tree / "source"
    (source / "later").mkdir(parents=True)
    subprocess.run(["mount", "--bind", str(source), str(source)], check=True)
    subprocess.run(["mount", "--make-rshared", str(source)], check=True)
    shared = tree / "shared"
    shared.mkdir()
    binds.make_shared(shared)
    namespace = subprocess.Popen(["unshare", "--mount", "--propagation", "slave", "sleep", "60"])
    try:
        target = shared / "volume"
        target.mkdir()
        binds.bind(source, target, readonly=False, propagation=propagation)
        subprocess.run(["mount", "-t", "tmpfs", "none", str(source / "later")], check=True)
        (source / "later" / "flag").write_text("mounted after the bind\n")
        probe = ["nsenter", "-t", str(namespace.pid), "-m", "cat", str(target / "later" / "flag")]
        assert (subprocess.run(probe, capture_output=True).returncode == 0) is seen
    finally:
        namespace.kill()
        namespace.wait()
        binds.remove_tree(shared)
        binds.unmount_all(source)


def test_bind_errors_name_the_paths(tree: Path) -> None:
    with pytest.raises(InfrastructureError, match=r"bind .*missing onto .*No such file"):
        binds.bind(tree / "missing", tree, readonly=False)


def test_mountinfo_paths_are_unescaped() -> None:
    info = (
        "36 35 98:0 / /run/a\\040b rw,noatime master:1 - ext3 /dev/root rw\n"
        "37 35 98:0 / /run/a\\040b/c rw - ext3 /dev/root rw\n"
        "38 35 98:0 / /run/ab rw - ext3 /dev/root rw\n"
    )
    assert binds.mounts_under("/run/a b", info) == ["/run/a b/c", "/run/a b"]
    assert binds.is_mount_point("/run/ab", info)
    assert not binds.is_mount_point("/run/a", info)
