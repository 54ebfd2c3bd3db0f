"""PullImage's and RemoveImage's steps (``shim.rpc.pull_image``, ``shim.rpc.remove_image``) in
process, against a real local registry: a fault injected after any step of a pull leaves no image
and nothing of it (blobs, disk, work directory), and what another image shares with it whole; a
removal is not taken back, so a fault after any of its steps leaves the image hidden and a retry
finishes it. Each test looks at its own store only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shim import faults, rpc
from shim.image_store import ImageStore
from tests.integration.image_setup import Pushed, pull, pushed, remove  # noqa: F401
from tests.registry_kit import put_manifest, served_manifest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def files(store: ImageStore) -> list[str]:
    """Every file of the store but its catalogue (and skopeo's own scratch directory)."""
    root = store.root
    found = [p for d in ("blobs", "disks", "trees", "work") for p in (root / d).rglob("*")]
    return sorted(str(p.relative_to(root)) for p in found if p.is_file() and "work/skopeo" not in str(p))


def catalogue(store: ImageStore) -> list[dict[str, object]]:
    """The image records written (hidden ones too)."""
    images: list[dict[str, object]] = json.loads((store.root / "catalogue.json").read_text())["images"]
    return images


@pytest.mark.parametrize("point", rpc.rpc_points("PullImage"))
def test_a_fault_after_any_pull_step_leaves_no_image_and_nothing_of_it(
    pushed: Pushed,  # noqa: F811
    tmp_path: Path,
    point: str,
) -> None:
    store = ImageStore(tmp_path / "images")
    with faults.raising(point), pytest.raises(faults.InjectedFault, match=point):
        pull(store, pushed.ref("uid"))
    assert store.list() == [] and files(store) == []
    assert pull(store, pushed.ref("uid")) == pushed.id("uid")  # the kubelet's retry


@pytest.mark.parametrize("point", rpc.rpc_points("PullImage"))
def test_a_failed_pull_leaves_what_another_image_shares_with_it(
    pushed: Pushed,  # noqa: F811
    tmp_path: Path,
    point: str,
) -> None:
    store = ImageStore(tmp_path / "images")
    pull(store, pushed.ref("uid"))
    before = (files(store), catalogue(store))
    with faults.raising(point), pytest.raises(faults.InjectedFault):
        pull(store, pushed.ref("named"))  # the busybox layer is uid's too
    assert (files(store), catalogue(store)) == before
    assert [r.id for r in store.list()] == [pushed.id("uid")]


def _tag(pushed: Pushed, image: str, tag: str) -> str:  # noqa: F811
    """``tag`` names what ``image`` names in the registry (as a push of it would); the reference."""
    repo_ref = pushed.ref(image).rsplit(":", 1)[0]
    repo = repo_ref.split("/", 1)[1]
    served = served_manifest(pushed.registry.host, repo, pushed.ref(image).rsplit(":", 1)[1])
    put_manifest(pushed.registry.host, repo, tag, json.loads(served))
    return f"{repo_ref}:{tag}"


@pytest.mark.parametrize("point", rpc.rpc_points("PullImage"))
def test_a_failed_pull_of_a_stored_image_leaves_every_name_as_it_was(
    pushed: Pushed,  # noqa: F811
    tmp_path: Path,
    point: str,
) -> None:
    """The tag moves from one stored image to another: a pull that fails leaves it where it was."""
    store = ImageStore(tmp_path / "images")
    uid = pull(store, pushed.ref("uid"))
    moving = _tag(pushed, "named", "moving")
    named = pull(store, moving)
    before = (files(store), catalogue(store))
    _tag(pushed, "uid", "moving")
    with faults.raising(point), pytest.raises(faults.InjectedFault):
        pull(store, moving)  # nothing to fetch: uid is stored; the tag only moves
    assert (files(store), catalogue(store)) == before
    found = store.get(moving)
    assert found is not None and found.id == named
    assert pull(store, moving) == uid  # the kubelet's retry moves it


@pytest.mark.parametrize("point", rpc.rpc_points("RemoveImage"))
def test_a_fault_after_any_removal_step_leaves_what_a_retry_finishes(
    pushed: Pushed,  # noqa: F811
    tmp_path: Path,
    point: str,
) -> None:
    store = ImageStore(tmp_path / "images")
    pull(store, pushed.ref("named"))
    only_named = files(store)
    image_id = pull(store, pushed.ref("uid"))
    with faults.raising(point), pytest.raises(faults.InjectedFault, match=point):
        remove(store, pushed.ref("uid"))
    assert store.get(pushed.ref("uid")) is None  # hidden from its first step on
    retried = remove(store, pushed.ref("uid"))  # the kubelet's retry finds it, and finishes what is left
    assert retried == (None if point.endswith(":forget") else image_id)
    assert files(store) == only_named and [r["id"] for r in catalogue(store)] == [pushed.id("named")]
    assert remove(store, pushed.ref("uid")) is None  # gone


def test_a_removal_of_a_held_image_hides_it_and_its_last_release_frees_it(
    pushed: Pushed,  # noqa: F811
    tmp_path: Path,
) -> None:
    store = ImageStore(tmp_path / "images")
    image_id = pull(store, pushed.ref("uid"))
    store.acquire(image_id, "c1")
    assert remove(store, pushed.ref("uid")) == image_id
    assert store.get(image_id) is None and files(store) != []
    assert remove(store, image_id) is None  # hidden and held: nothing more a removal can do
    store.release(image_id, "c1")
    assert files(store) == [] and catalogue(store) == []
