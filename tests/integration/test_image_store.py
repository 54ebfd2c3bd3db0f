"""ImageStore against a real registry on 127.0.0.1: pulls, names, multi-arch, whiteouts, hostile
layers, single flight, holders, errors, auth, mirrors, a full disk and crashes mid-pull."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shim import metrics
from shim.image_store import ImageStore
from tests.integration.image_setup import (  # noqa: F401
    DockerImage,
    Pushed,
    docker_images,
    pull,
    pushed,
    remove,
    tree_files,
)
from tests.registry_kit import Layout, Registry, busybox_entries, digest_of, push
from vmsandbox.errors import CannotFit, InfrastructureError, InvalidArgument, NotFound, Unauthenticated
from vmsandbox.registries import Credentials, parse_registries

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def store(tmp_path: Path) -> ImageStore:
    return ImageStore(tmp_path / "images")


def blobs(store: ImageStore) -> set[str]:
    return set(store.disk.blob_sizes())


def tree_of(store: ImageStore, image_id: str) -> Path:
    """The files of ``image_id``'s disk, as a container holding it would see them: the disk
    extracted (``fsck.erofs --extract``, owners and modes kept) beside the store, once per disk."""
    disk = store.acquire(image_id, "reader").disk
    store.release(image_id, "reader")
    out = store.root.parent / "extracted" / disk.name
    if not out.exists():
        out.parent.mkdir(exist_ok=True)
        subprocess.run(["fsck.erofs", f"--extract={out}", str(disk)], check=True, capture_output=True)
    return out


def leftovers(store: ImageStore) -> list[str]:
    root = store.root
    work = [p.name for p in (root / "work").iterdir() if p.name != "skopeo"]
    trees = [p.name for p in (root / "trees").iterdir()] + [p.name for p in (root / "disks").iterdir()]

    return work + trees + [p.name for p in (root / "blobs/sha256").iterdir()]


EROFS_MAGIC = (1024, bytes.fromhex("e2e1f5e0"))  # the superblock's magic, little-endian, at 1 KiB


def test_each_image_has_a_read_only_erofs_disk_made_at_pull_and_removed_with_it(
    pushed: Pushed,  # noqa: F811
    store: ImageStore,
) -> None:
    image_id = pull(store, pushed.ref("uid"))
    held = store.acquire(image_id, "c1")
    store.release(image_id, "c1")
    record = store.get(image_id)
    assert record is not None
    assert held.disk.is_file() and held.disk.stat().st_mode & 0o777 == 0o400
    offset, magic = EROFS_MAGIC
    assert held.disk.read_bytes()[offset : offset + 4] == magic
    assert held.serial == record.tree.removeprefix("sha256:")[:20]
    assert held.passwd and held.passwd[0].startswith("root:")  # read from the tree before it went
    assert list((store.root / "trees").iterdir()) == []  # the disk is the only copy of the image's files
    # the guest mounts what the host tree holds: dump.erofs lists the tree's files
    listing = subprocess.run(["dump.erofs", "--path=/bin", "--ls", str(held.disk)], capture_output=True, text=True)
    assert listing.returncode == 0 and "busybox" in listing.stdout, listing.stderr
    remove(store, image_id)
    assert not held.disk.exists() and leftovers(store) == []


def test_pull_names_status_and_remove(pushed: Pushed, store: ImageStore) -> None:  # noqa: F811
    ref = pushed.ref("uid")

    def sample(name: str, **labels: str) -> float:
        return metrics.REGISTRY.get_sample_value(name, labels) or 0.0

    before = (sample("vmsandbox_image_pulls_total", result="ok"), sample("vmsandbox_image_pull_bytes_total"))
    durations = sample("vmsandbox_image_pull_seconds_count")
    image_id = pull(store, ref)
    assert image_id == pushed.id("uid")  # the config digest, as containerd answers
    assert sample("vmsandbox_image_pulls_total", result="ok") == before[0] + 1
    assert sample("vmsandbox_image_pull_bytes_total") - before[1] > 1_000_000  # busybox, compressed
    assert sample("vmsandbox_image_pull_seconds_count") == durations + 1
    repo = ref.rsplit(":", 1)[0]
    for query in (ref, image_id, image_id[7:], image_id[7:19], f"{repo}@{pushed.top('uid')}"):
        found = store.get(query)
        assert found is not None and found.id == image_id, query
    record = store.get(ref)
    assert record is not None
    assert record.repo_tags == (ref,)
    assert record.repo_digests == (f"{repo}@{pushed.top('uid')}",)
    assert record.user == "1000" and record.spec["uid"] == 1000
    tree = tree_of(store, image_id)
    assert (tree / "bin/busybox").read_bytes() == Path("/bin/busybox").read_bytes()
    assert os.readlink(tree / "bin/sh") == "busybox"
    assert store.usage().bytes >= record.size

    pull(store, pushed.ref("named"))  # shares the busybox layer
    named = store.get(pushed.ref("named"))
    assert named is not None and named.spec["username"] == "nobody"
    shared = set(record.layers) & set(named.layers)
    assert shared

    assert tree_of(store, named.id) == tree  # the same layers: one disk
    disk = store.root / "disks" / tree.name

    assert remove(store, ref) == image_id
    assert store.get(ref) is None and store.get(image_id) is None
    assert disk.is_file()  # still the other image's
    assert shared <= blobs(store)  # still used by the other image
    assert remove(store, ref) is None  # absent: fine
    remove(store, pushed.ref("named"))
    assert not disk.exists()
    assert leftovers(store) == []


def test_multi_arch_index_yields_the_amd64_image(pushed: Pushed, store: ImageStore) -> None:  # noqa: F811
    image_id = pull(store, pushed.ref("multi"))
    assert image_id == pushed.id("multi")
    assert (tree_of(store, image_id) / "arch").read_text() == "amd64\n"
    record = store.get(image_id)
    assert record is not None
    assert record.repo_digests == (f"{pushed.ref('multi').rsplit(':', 1)[0]}@{pushed.top('multi')}",)
    by_digest = f"{pushed.ref('multi').rsplit(':', 1)[0]}@{pushed.top('multi')}"
    assert pull(store, by_digest) == image_id


def test_index_without_amd64_is_not_found(pushed: Pushed, store: ImageStore) -> None:  # noqa: F811
    with pytest.raises(NotFound, match=r"no linux/amd64 image in the index \(it has: linux/arm64\)"):
        pull(store, pushed.ref("arm-only"))


def test_whiteouts_and_opaque_directories(pushed: Pushed, store: ImageStore) -> None:  # noqa: F811
    tree = tree_of(store, pull(store, pushed.ref("whiteouts")))
    files = tree_files(tree)
    assert "a/stays" in files and "a/gone" not in files
    assert {f for f in files if f.startswith("o/")} == {"o/new"}
    assert not any(".wh." in f for f in files)


def test_hostile_layer_is_refused_and_leaves_nothing(pushed: Pushed, store: ImageStore, tmp_path: Path) -> None:  # noqa: F811
    with pytest.raises(InvalidArgument, match="climbs out of the image root"):
        pull(store, pushed.ref("hostile"))
    assert store.list() == []
    assert leftovers(store) == []
    assert not any(p.name == "escaped-by-image" for p in tmp_path.parent.rglob("escaped-by-image"))


@pytest.mark.parametrize("name", ["docker", "docker-list", "docker-raw"])
def test_docker_images_are_stored_as_the_registry_serves_them(
    docker_images: dict[str, DockerImage],  # noqa: F811
    store: ImageStore,
    name: str,
) -> None:
    image = docker_images[name]
    top, manifest = image.served()
    config_digest = json.loads(manifest)["config"]["digest"]
    assert pull(store, image.ref) == config_digest  # the id the kubelet and critest compare
    record = store.get(image.ref)
    assert record is not None and record.id == config_digest
    assert record.repo_tags == (image.ref,)
    assert record.repo_digests == (f"{image.host}/{image.repo}@{digest_of(top)}",)
    assert record.manifest == digest_of(manifest)
    assert store.disk.blob_path(record.manifest).read_bytes() == manifest
    assert digest_of(store.disk.blob_path(config_digest).read_bytes()) == config_digest
    config = json.loads(store.disk.blob_path(config_digest).read_bytes())
    assert "container_config" in config  # Docker-only fields kept: the config as served
    tree = tree_of(store, record.id)
    files = tree_files(tree)
    assert "bin/busybox" in files
    if name == "docker-raw":
        assert {(tree / f).read_text() for f in ("plain", "foreign")} == {"plain\n", "foreign\n"}
    else:
        assert (tree / "etc/arch").read_text() == "amd64\n"
        assert record.user == "1000"
    assert pull(store, f"{image.host}/{image.repo}@{digest_of(top)}") == config_digest  # by digest too
    remove(store, record.id)
    assert leftovers(store) == []


def test_docker_zstd_layers_are_refused_before_any_download(
    docker_images: dict[str, DockerImage],  # noqa: F811
    store: ImageStore,
) -> None:
    with pytest.raises(InvalidArgument, match=r"unsupported layer media type .*diff\.tar\.zstd"):
        pull(store, docker_images["docker-zstd"].ref)
    assert leftovers(store) == []


def test_an_image_copying_a_public_config_cannot_poison_the_cache(pushed: Pushed, store: ImageStore) -> None:  # noqa: F811
    """The attacker's config is byte-identical to the public image's (same image id), its layers are
    not: pulled first it is refused; the public image pulled next has its own contents."""
    assert pushed.id("attacker") == pushed.id("public")
    with pytest.raises(InvalidArgument, match=r"layer 2/2 sha256:[0-9a-f]{64}: its uncompressed content") as err:
        pull(store, pushed.ref("attacker"))
    assert "rootfs.diff_ids says sha256:" in str(err.value) and len(str(err.value)) < 600
    assert store.list() == [] and store.get(pushed.id("public")) is None
    assert leftovers(store) == []
    assert pull(store, pushed.ref("public")) == pushed.id("public")
    assert (tree_of(store, pushed.id("public")) / "whoami").read_text() == "public\n"
    # pulled now, the attacker's name gets what its config (the public one) declares, nothing else
    assert pull(store, pushed.ref("attacker")) == pushed.id("public")
    assert (tree_of(store, pushed.id("public")) / "whoami").read_text() == "public\n"


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("lying", r"layer 2/2 .*rootfs.diff_ids says"),
        ("miscount", r"the manifest has 2 layers but the config's rootfs.diff_ids has 1 entries"),
    ],
)
def test_layers_that_do_not_match_the_config_are_refused(
    pushed: Pushed,  # noqa: F811
    store: ImageStore,
    name: str,
    says: str,
) -> None:
    with pytest.raises(InvalidArgument, match=says):
        pull(store, pushed.ref(name))
    assert store.list() == [] and leftovers(store) == []


def test_zstd_layers(pushed: Pushed, store: ImageStore) -> None:  # noqa: F811
    image_id = pull(store, pushed.ref("zstd"))
    assert (tree_of(store, image_id) / "zstd").read_text() == "zstd\n"


@pytest.mark.parametrize("held", [True, False], ids=["old-container-holds-it", "nothing-holds-it"])
def test_a_store_of_the_previous_version_is_verified_at_start(
    pushed: Pushed,  # noqa: F811
    tmp_path: Path,
    held: bool,
) -> None:
    """Trees named by image id and never verified: each is unpacked again with every check under its
    ChainID (a tampered old tree is not given to a new container; it is kept only while a container
    started from it before holds the image) or, when its blobs cannot prove it, dropped."""
    root = tmp_path / "images"
    store = ImageStore(root)
    good, broken = pull(store, pushed.ref("whiteouts")), pull(store, pushed.ref("zstd"))
    broken_layer = store.get(broken).layers[-1]  # type: ignore[union-attr]
    doc = json.loads((root / "catalogue.json").read_text())
    for record in doc["images"]:  # that version had trees named by image id, and no disks
        old = root / "trees" / record["id"][7:]
        shutil.copytree(tree_of(store, record["id"]), old, symlinks=True)
        (old / "planted").write_text("not from any layer")  # what the old version could have served
        store.disk.remove_tree(record.pop("tree"))
    doc["version"] = 1
    (root / "catalogue.json").write_text(json.dumps(doc))
    store.disk.blob_path(broken_layer).unlink()
    shutil.rmtree(root.parent / "extracted")

    again = ImageStore(root)
    assert [r.id for r in again.list()] == [good]
    assert json.loads((root / "catalogue.json").read_text())["version"] == 2
    assert store.disk.blob_path(broken_layer).exists() is False
    # the old tree stays only for containers started from it before the upgrade, which hold the image
    old = root / "trees" / good[7:]
    assert {p.name for p in (root / "trees").iterdir()} == {old.name}
    if held:
        again.acquire(good, "c1")  # such a container, holding it again at start-up
        again.collect()
        assert (old / "planted").exists()
        again.release(good, "c1")  # the last of them gone
    else:
        again.collect()
    tree = tree_of(again, good)
    assert "planted" not in tree_files(tree) and "o/new" in tree_files(tree)
    assert list((root / "trees").iterdir()) == []
    third = ImageStore(root)  # a second start finds nothing to do
    third.collect()
    assert [r.id for r in third.list()] == [good] and tree_of(third, good) == tree


@pytest.mark.parametrize("held", [True, False], ids=["a-container-holds-it", "nothing-holds-it"])
def test_trees_of_the_previous_version_go_once_no_container_holds_them(
    pushed: Pushed,  # noqa: F811
    tmp_path: Path,
    held: bool,
) -> None:
    """The version before kept each image twice, its tree (shared over 9p to its sandboxes, read for
    user names) and its disk: at start the disk gets its facts from the tree, and the tree is
    deleted once no container holds the image (a sandbox of that version may still read it)."""
    root = tmp_path / "images"
    store = ImageStore(root)
    image_id = pull(store, pushed.ref("uid"))
    record = store.get(image_id)
    assert record is not None
    tree = store.disk.tree_path(record.tree)
    shutil.copytree(tree_of(store, image_id), tree, symlinks=True)
    facts = store.disk.facts(record.tree)
    next(root.glob("disks/*.json")).unlink()  # that version kept no facts
    size_before = ImageStore(root).usage().bytes  # what it counted: the tree too

    again = ImageStore(root)
    made = again.disk.facts(record.tree)
    assert (made.passwd, made.group) == (facts.passwd, facts.group) and tree.is_dir()
    if held:
        again.acquire(image_id, "c1")
        again.collect()
        assert tree.is_dir()
        again.release(image_id, "c1")
    else:
        again.collect()
    assert not tree.exists() and again.usage().bytes < size_before
    assert again.acquire(image_id, "c2").passwd == facts.passwd


def test_ten_concurrent_pulls_download_each_blob_once(pushed: Pushed, tmp_path: Path) -> None:  # noqa: F811
    store = ImageStore(tmp_path / "images")
    ref = pushed.ref("big")
    before = pushed.registry.blob_gets()
    shared_before = metrics.REGISTRY.get_sample_value("vmsandbox_image_pulls_shared_total") or 0.0
    results: list[str] = []
    errors: list[BaseException] = []
    start = threading.Barrier(10)

    def one() -> None:
        start.wait()
        try:
            results.append(pull(store, ref))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == [pushed.id("big")] * 10
    after = pushed.registry.blob_gets()
    record = store.get(ref)
    assert record is not None
    fetched = {d: after.get(d, 0) - before.get(d, 0) for d in (record.config, *record.layers)}
    assert fetched == dict.fromkeys(fetched, 1), fetched
    assert (metrics.REGISTRY.get_sample_value("vmsandbox_image_pulls_shared_total") or 0.0) - shared_before == 9


def test_a_removal_between_unpack_and_catalogue_keeps_what_the_pull_uses(
    pushed: Pushed,  # noqa: F811
    store: ImageStore,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``named`` has the layers of ``uid``: removing ``uid`` while ``named``'s pull has its tree and
    blobs but no catalogue entry yet must not free them under it."""
    first = pull(store, pushed.ref("uid"))
    tree = tree_of(store, first)
    unpack = store.unpack

    def unpack_then_remove(*args: Any) -> Any:
        out = unpack(*args)
        remove(store, first)
        return out

    monkeypatch.setattr(store, "unpack", unpack_then_remove)
    second = pull(store, pushed.ref("named"))
    assert tree_of(store, second) == tree and (tree / "bin/busybox").is_file()
    record = store.get(second)
    assert record is not None and set(record.blobs) <= blobs(store)


def test_held_images_are_freed_on_last_release(pushed: Pushed, store: ImageStore) -> None:  # noqa: F811
    image_id = pull(store, pushed.ref("uid"))
    disk = store.acquire(image_id, "c1").disk
    store.acquire(image_id, "c2")
    assert disk.is_file()
    remove(store, image_id)
    assert store.get(image_id) is None and store.list() == []
    assert disk.is_file()  # containers still run from it
    store.release(image_id, "c1")
    store.release(image_id, "c1")  # a second release by the same container changes nothing
    assert disk.exists()
    store.release(image_id, "c2")
    assert not disk.exists() and leftovers(store) == []
    with pytest.raises(NotFound):
        store.acquire(image_id, "c3")


def test_removed_held_image_survives_restart_until_collected(pushed: Pushed, tmp_path: Path) -> None:  # noqa: F811
    store = ImageStore(tmp_path / "images")
    image_id = pull(store, pushed.ref("uid"))
    disk = store.acquire(image_id, "c1").disk
    remove(store, image_id)
    again = ImageStore(tmp_path / "images")  # a restart: containers re-acquire before collect()
    assert disk.is_file() and again.get(image_id) is None
    assert again.acquire(image_id, "c1").disk == disk
    again.collect()
    assert disk.is_file()
    again.release(image_id, "c1")
    assert not disk.exists()


@pytest.mark.parametrize(
    ("suffix", "kind", "says"),
    [
        ("test/busybox:nope", NotFound, "manifest unknown"),
        ("test/nothing:1", NotFound, "test/nothing:1"),
    ],
)
def test_unknown_images(pushed: Pushed, store: ImageStore, suffix: str, kind: type, says: str) -> None:  # noqa: F811
    with pytest.raises(kind, match=says) as exc:
        pull(store, f"{pushed.registry.host}/{suffix}")
    assert f"{pushed.registry.host}/{suffix}" in str(exc.value)


def test_unreachable_registry_and_malformed_reference(store: ImageStore) -> None:
    with pytest.raises(InfrastructureError, match="connection refused"):
        pull(store, "127.0.0.1:1/x/y:1")
    with pytest.raises(InvalidArgument, match="not a valid tag"):
        pull(store, "busybox:-bad")
    assert leftovers(store) == []


@pytest.fixture(scope="module")
def auth_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    tmp = tmp_path_factory.mktemp("auth-registry")
    registry = Registry(tmp / "registry", users={"alice": "s3cret-pass"}).start()
    try:
        layout = Layout(tmp / "layout")
        layout.tag("v1", layout.image([layout.layer(busybox_entries())]))
        push(layout, "v1", f"{registry.host}/private/app:v1", creds="alice:s3cret-pass")
        yield registry
    finally:
        registry.stop()


def test_auth_is_used_for_that_pull_only_and_never_shown(
    auth_registry: Registry, store: ImageStore, caplog: pytest.LogCaptureFixture
) -> None:
    ref = f"{auth_registry.host}/private/app:v1"
    caplog.set_level(logging.DEBUG)
    with pytest.raises(Unauthenticated):
        pull(store, ref)
    with pytest.raises(Unauthenticated):
        pull(store, ref, Credentials(username="alice", password="wrong"))
    assert pull(store, ref, Credentials(username="alice", password="s3cret-pass")).startswith("sha256:")
    remove(store, ref)
    import base64

    token = base64.b64encode(b"alice:s3cret-pass").decode()
    assert pull(store, ref, Credentials(auth=token)).startswith("sha256:")
    assert "s3cret-pass" not in caplog.text and token not in caplog.text
    skopeo_dir = store.root / "work" / "skopeo"
    assert not list(skopeo_dir.glob("auth-*")), "temporary auth files must be deleted"


def test_auth_file_from_the_configuration(auth_registry: Registry, tmp_path: Path) -> None:
    import base64
    import json

    auth_file = tmp_path / "auth.json"
    entry = {"auth": base64.b64encode(b"alice:s3cret-pass").decode()}
    auth_file.write_text(json.dumps({"auths": {auth_registry.host: entry}}))
    store = ImageStore(tmp_path / "images", auth_file=str(auth_file))
    assert pull(store, f"{auth_registry.host}/private/app:v1").startswith("sha256:")


def test_mirrors_are_tried_first_then_the_registry(pushed: Pushed, tmp_path: Path) -> None:  # noqa: F811
    upstream = "upstream.invalid:5000"
    mirror_ns = f"{pushed.registry.host}/test"
    registries = parse_registries(
        [
            {"prefix": upstream, "mirrors": [{"location": "127.0.0.1:1"}, {"location": mirror_ns}]},
            {"prefix": "fallback.invalid", "location": mirror_ns, "mirrors": [{"location": "127.0.0.1:1"}]},
        ]
    )
    store = ImageStore(tmp_path / "images", registries=registries)
    image_id = pull(store, f"{upstream}/busybox:uid")  # first mirror down, second serves it
    assert image_id == pushed.id("uid")
    record = store.get(f"{upstream}/busybox:uid")
    assert record is not None and record.repo_tags == (f"{upstream}/busybox:uid",)
    assert pull(store, "fallback.invalid/busybox:named") == pushed.id("named")


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def _used(path: Path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def test_full_disk_is_resource_exhausted_and_gives_the_space_back(pushed: Pushed, small_disk: Path) -> None:  # noqa: F811
    store = ImageStore(small_disk / "images")
    baseline = _used(small_disk)
    with pytest.raises(CannotFit, match="no space left"):
        pull(store, pushed.ref("big"))
    assert store.list() == []
    assert leftovers(store) == []
    assert _used(small_disk) <= baseline + (64 << 10)
    assert pull(store, pushed.ref("uid")) == pushed.id("uid")  # the store still works


@pytest.mark.parametrize("point", ["PullImage:blobs", "PullImage:disk"])
def test_a_crash_mid_pull_leaves_no_image_and_no_garbage(pushed: Pushed, tmp_path: Path, point: str) -> None:  # noqa: F811
    root = tmp_path / "images"
    code = (
        "import sys, pathlib; from shim.image_store import ImageStore; "
        "from tests.integration.image_setup import pull; "
        "pull(ImageStore(pathlib.Path(sys.argv[1])), sys.argv[2])"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(root), pushed.ref("uid")],
        cwd=REPO,
        env={**os.environ, "VMSANDBOX_FAULT": point},
        capture_output=True,
        check=False,
    )
    assert done.returncode == -9, done.stderr.decode()[-2000:]
    assert any((root / "work").iterdir()) or any((root / "disks").iterdir())  # it died holding something
    (root / "blobs" / "oci-put-blob123").write_bytes(b"half a blob")  # what a killed skopeo leaves
    store = ImageStore(root)
    assert store.list() == [] and store.get(pushed.ref("uid")) is None
    assert leftovers(store) == [] and [p.name for p in (root / "blobs").iterdir()] == ["sha256"]
    assert pull(store, pushed.ref("uid")) == pushed.id("uid")
    shutil.rmtree(root)


def test_a_pull_never_rides_on_another_callers_login(auth_registry: Registry, tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "images")
    ref = f"{auth_registry.host}/private/app:v1"
    outcomes: dict[str, object] = {}
    barrier = threading.Barrier(2)

    def pull_as(who: str, creds: Credentials | None) -> None:
        barrier.wait()
        try:
            outcomes[who] = pull(store, ref, creds)
        except Unauthenticated as exc:
            outcomes[who] = exc

    threads = [
        threading.Thread(target=pull_as, args=("alice", Credentials(username="alice", password="s3cret-pass"))),
        threading.Thread(target=pull_as, args=("anonymous", None)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert str(outcomes["alice"]).startswith("sha256:")
    assert isinstance(outcomes["anonymous"], Unauthenticated)
