"""ImageStore.adopt: an image containerd pulled becomes a disk of the store, made once from its
layers, named as containerd names it, and removed like any other image (real mkfs.erofs)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from shim.image_store import ImageStore
from vmsandbox.adapters.layer_view import merged
from vmsandbox.adapters.layers import Limits
from vmsandbox.containerd_rootfs import ImageLayers
from vmsandbox.errors import CannotFit, InvalidArgument

pytestmark = [pytest.mark.integration]

DIFF_IDS = ["sha256:" + "a" * 64, "sha256:" + "b" * 64]


def config_doc(env: str = "A=1") -> bytes:
    doc = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Env": [env], "Cmd": ["/bin/sh"], "User": "0"},
        "rootfs": {"type": "layers", "diff_ids": DIFF_IDS},
    }
    return json.dumps(doc).encode()


def digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "merged"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (root / "hello").write_text("hi\n")
    return root


def test_adopted_image_gets_a_disk_once_and_containerd_names(tmp_path: Path, tree: Path) -> None:
    store = ImageStore(tmp_path / "images")
    made: list[Path] = []

    @contextmanager
    def view() -> Iterator[Path]:
        made.append(tree)
        yield tree

    doc = config_doc()
    image_id = digest(doc)
    names = (["docker.io/library/busybox:1.36"], ["docker.io/library/busybox@sha256:" + "c" * 64])
    record = store.adopt(image_id, doc, names, view)
    assert record.id == image_id and record.repo_tags == ("docker.io/library/busybox:1.36",)
    assert record.blobs == () and record.unpacked_inodes >= 3
    assert store.get("docker.io/library/busybox:1.36") == record
    held = store.acquire(image_id, "c1")
    assert held.disk.is_file() and held.passwd == ("root:x:0:0:root:/root:/bin/sh",)
    store.release(image_id, "c1")
    assert store.adopt(image_id, doc, names, view) == record and len(made) == 1  # stored: no second disk
    # another image of the same layers shares the disk
    other = config_doc("A=2")
    assert store.adopt(digest(other), other, (["example.com/b:1"], []), view).tree == record.tree
    assert len(made) == 1
    # a store opened again knows it
    again = ImageStore(tmp_path / "images")
    assert again.get(image_id) == record


def test_a_config_that_is_not_the_image_is_refused_and_leaves_nothing(tmp_path: Path, tree: Path) -> None:
    store = ImageStore(tmp_path / "images")

    @contextmanager
    def view() -> Iterator[Path]:
        yield tree

    with pytest.raises(InvalidArgument, match="digest"):
        store.adopt("sha256:" + "0" * 64, config_doc(), (["x:1"], []), view)
    assert store.list() == [] and not list((tmp_path / "images" / "disks").glob("*"))


@pytest.mark.parametrize(
    ("limits", "refusal"),
    [
        (Limits(max_bytes=1 << 30, max_entries=2), "more than image_max_entries \\(2\\) entries"),
        (Limits(max_bytes=4096, max_entries=1000), "more than image_max_bytes \\(4096\\)"),
    ],
)
def test_layers_beyond_the_stores_limits_are_refused_before_a_disk_is_made(
    tmp_path: Path, tree: Path, limits: Limits, refusal: str
) -> None:
    """containerd unpacked the layers, bounded by nothing of vmsandbox's: adopting them is held to
    ``image_max_bytes`` and ``image_max_entries`` as a pull is."""
    for i in range(8):
        (tree / f"f{i}").write_bytes(b"x" * 8192)
    store = ImageStore(tmp_path / "images", limits=limits)

    @contextmanager
    def view() -> Iterator[Path]:
        yield tree

    doc = config_doc()
    with pytest.raises(CannotFit, match=refusal):
        store.adopt(digest(doc), doc, (["x:1"], []), view)
    assert store.list() == [] and not list((tmp_path / "images" / "disks").glob("*"))


def test_a_failed_disk_leaves_nothing(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "images")

    @contextmanager
    def view() -> Iterator[Path]:
        raise OSError("the layers are gone")
        yield Path("/")

    doc = config_doc()
    with pytest.raises(OSError, match="gone"):
        store.adopt(digest(doc), doc, (["x:1"], []), view)
    assert store.list() == [] and not list((tmp_path / "images" / "disks").glob("*"))


def test_layers_merge_read_only_with_whiteouts(tmp_path: Path) -> None:
    """The host's view of containerd's overlayfs layers: upper layers win, whiteouts hide."""
    low, top = tmp_path / "low", tmp_path / "top"
    (low / "etc").mkdir(parents=True)
    (low / "etc" / "gone").write_text("x")
    (low / "etc" / "kept").write_text("old")
    (top / "etc").mkdir(parents=True)
    (top / "etc" / "kept").write_text("new")
    os.mknod(top / "etc" / "gone", 0o600 | 0o020000, os.makedev(0, 0))  # overlayfs whiteout
    work = tmp_path / "work"
    work.mkdir()
    with merged(ImageLayers((str(top), str(low))), work) as view:
        assert (view / "etc" / "kept").read_text() == "new" and not (view / "etc" / "gone").exists()
        with pytest.raises(OSError):
            (view / "new").write_text("no")
    assert list(work.iterdir()) == []
    with merged(ImageLayers((str(low),)), work) as view:
        assert view == low
