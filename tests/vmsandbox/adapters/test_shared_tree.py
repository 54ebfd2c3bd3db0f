"""Host-side operations in a guest-writable tree (vmsandbox.adapters.shared_tree) against hostile
trees made on the host: symlinks to host files and directories (at the end of a path and in the
middle), FIFOs (an open of one blocks), device nodes, sparse files, nesting deeper than a path can
name. Nothing outside the tree may change, nothing may block."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from vmsandbox.adapters import shared_tree
from vmsandbox.errors import InfrastructureError

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def host(tmp_path: Path) -> Path:
    """Host files a guest would love to reach."""
    outside = tmp_path / "host"
    (outside / "c1").mkdir(parents=True)
    (outside / "c1" / "precious").write_text("host\n")
    (outside / "shadow").write_text("secret\n")
    return outside


def snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() if p.is_file() else b"" for p in sorted(path.rglob("*"))}


def hostile_tree(share: Path, host: Path) -> None:
    c = share / "containers" / "c1"
    (c / "mounts").mkdir(parents=True)
    (c / "to-dir").symlink_to(host)
    (c / "to-file").symlink_to(host / "shadow")
    (c / "dangling").symlink_to("/nonexistent")
    os.mkfifo(c / "fifo")
    (c / "mounts" / "0").symlink_to(host / "c1")
    with open(c / "sparse", "wb") as f:
        f.truncate(3 << 30)
    if os.geteuid() == 0:
        os.mknod(c / "zero", stat.S_IFCHR | 0o666, os.makedev(1, 5))
    deep = c / "deep"
    deep.mkdir()
    fd = os.open(deep, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(300):  # deeper than PATH_MAX can name from the root
        os.mkdir("d" * 200, dir_fd=fd)
        child = os.open("d" * 200, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = child
    os.mkfifo("fifo-deep", dir_fd=fd)
    os.symlink(str(host), "up", dir_fd=fd)
    os.close(fd)


def test_remove_tree_deletes_a_hostile_tree_and_nothing_outside(tmp_path: Path, host: Path) -> None:
    share = tmp_path / "share"
    hostile_tree(share, host)
    before = snapshot(host)
    shared_tree.remove_tree(share, "containers/c1")
    assert not (share / "containers" / "c1").exists()
    assert snapshot(host) == before


@pytest.mark.parametrize("where", ["containers", "containers/c1"])
def test_remove_tree_through_a_symlink_removes_the_link_only(tmp_path: Path, host: Path, where: str) -> None:
    share = tmp_path / "share"
    share.mkdir()
    if where == "containers":
        (share / "containers").symlink_to(host)  # containers/c1 would be host/c1
    else:
        (share / "containers").mkdir()
        (share / "containers" / "c1").symlink_to(host / "c1")
    before = snapshot(host)
    shared_tree.remove_tree(share, "containers/c1")
    assert snapshot(host) == before
    assert where == "containers" or not os.path.lexists(share / "containers" / "c1")


@pytest.mark.parametrize("kind", ["fifo", "file", "device"])
def test_remove_tree_of_a_non_directory_unlinks_it(tmp_path: Path, kind: str) -> None:
    share = tmp_path / "share"
    share.mkdir()
    node = share / "x"
    if kind == "fifo":
        os.mkfifo(node)
    elif kind == "file":
        node.write_text("x")
    else:
        if os.geteuid() != 0:
            pytest.skip("mknod needs root")
        os.mknod(node, stat.S_IFCHR | 0o600, os.makedev(1, 3))
    shared_tree.remove_tree(share, "x")
    assert not os.path.lexists(node)


@pytest.mark.parametrize("planted", ["symlink", "fifo", "file"])
def test_make_dirs_refuses_what_is_not_a_directory(tmp_path: Path, host: Path, planted: str) -> None:
    share = tmp_path / "share"
    share.mkdir()
    if planted == "symlink":
        (share / "containers").symlink_to(host)
    elif planted == "fifo":
        os.mkfifo(share / "containers")
    else:
        (share / "containers").write_text("")
    before = snapshot(host)
    with pytest.raises(InfrastructureError, match="not the directory the host made"):
        shared_tree.make_dirs(share, "containers/c1/mounts")
    assert snapshot(host) == before


def test_make_dirs_and_make_empty(tmp_path: Path, host: Path) -> None:
    share = tmp_path / "share"
    share.mkdir()
    shared_tree.make_dirs(share, "containers/c1/mounts")
    shared_tree.make_dirs(share, "containers/c1/mounts")  # again: fine
    shared_tree.make_empty(share, "containers/c1/mounts/0", is_dir=True)
    shared_tree.make_empty(share, "containers/c1/mounts/1", is_dir=False)
    assert (share / "containers/c1/mounts/0").is_dir()
    assert (share / "containers/c1/mounts/1").stat().st_size == 0
    (share / "containers/c1/mounts/2").symlink_to(host / "shadow")
    with pytest.raises(InfrastructureError):
        shared_tree.make_empty(share, "containers/c1/mounts/2", is_dir=False)
    assert (host / "shadow").read_text() == "secret\n"
    with pytest.raises(ValueError):
        shared_tree.make_dirs(share, "../host")


def test_write_once_never_writes_through_a_guest_link(tmp_path: Path, host: Path) -> None:
    share = tmp_path / "share"
    (share / "pod").mkdir(parents=True)
    assert shared_tree.write_once(share, "pod/resolv.conf", b"nameserver 10.0.0.1\n")
    assert (share / "pod/resolv.conf").read_text() == "nameserver 10.0.0.1\n"
    assert stat.S_IMODE((share / "pod/resolv.conf").stat().st_mode) == 0o644
    assert not shared_tree.write_once(share, "pod/resolv.conf", b"other\n")  # once
    # a link where the file goes is the guest's own file: left alone, never written through
    (share / "pod/hostname").symlink_to(host / "shadow")
    (share / "pod/.hosts.tmp").symlink_to(host / "shadow")  # the scratch name, planted
    assert not shared_tree.write_once(share, "pod/hostname", b"pwned\n")
    assert shared_tree.write_once(share, "pod/hosts", b"127.0.0.1 localhost\n")
    assert (host / "shadow").read_text() == "secret\n"
    # the directory itself swapped for a link to a host directory
    (share / "pod").rename(share / "old-pod")
    (share / "pod").symlink_to(host)
    with pytest.raises(InfrastructureError):
        shared_tree.write_once(share, "pod/resolv.conf", b"pwned\n")
    assert not (host / "resolv.conf").exists()


def _nest(top: Path, depth: int) -> None:
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    for i in range(depth):
        os.mkdir("d", dir_fd=fd)
        if i % 100 == 0:
            os.close(os.open("f", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
        child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = child
    os.close(fd)


def test_remove_tree_of_a_nesting_deeper_than_the_recursion_limit(tmp_path: Path) -> None:
    """A guest nests 1,500 directories: the removal keeps its own stack (no RecursionError) and
    never holds more than a bounded number of descriptors."""
    share = tmp_path / "share"
    (share / "containers" / "c1").mkdir(parents=True)
    _nest(share / "containers" / "c1", 1500)
    shared_tree.remove_tree(share, "containers/c1")
    assert list((share / "containers").iterdir()) == []


def test_remove_tree_lists_a_bounded_number_of_entries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past its budget of entries a removal stops and leaves the rest (for the next removal, or the
    sandbox's file system going whole), without an error."""
    share = tmp_path / "share"
    wide = share / "containers" / "c1"
    wide.mkdir(parents=True)
    for i in range(50):
        (wide / f"f{i}").write_text("x")
    monkeypatch.setattr(shared_tree, "_MAX_ENTRIES", 20)
    shared_tree.remove_tree(share, "containers/c1")
    assert len(list(wide.iterdir())) == 30
    monkeypatch.setattr(shared_tree, "_MAX_ENTRIES", 1000)
    shared_tree.remove_tree(share, "containers/c1")
    assert not wide.exists()
