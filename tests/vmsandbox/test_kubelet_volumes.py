"""The kubelet's atomic-writer volumes as the host reads them and plans their copy into a guest
(vmsandbox.kubelet_volumes, vmsandbox.adapters.volume_reader), on the kubelet's own layout
(tests/kubelet_layout.py), and PodVolumes' bookkeeping against a recording agent."""

from __future__ import annotations

import base64
import os
import threading
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shim.pod_volumes import PodVolumes
from tests.kubelet_layout import volume_dir, write_volume
from vmsandbox import kubelet_volumes as kv
from vmsandbox.adapters import volume_reader
from vmsandbox.errors import InfrastructureError, InvalidArgument

PODS = "/var/lib/kubelet/pods"


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        (f"{PODS}/u1/volumes/kubernetes.io~configmap/cfg", True),
        (f"{PODS}/u1/volumes/kubernetes.io~secret/s", True),
        (f"{PODS}/u1/volumes/kubernetes.io~projected/kube-api-access-abcde", True),
        (f"{PODS}/u1/volumes/kubernetes.io~downward-api/info", True),
        (f"{PODS}/u1/volumes/kubernetes.io~empty-dir/scratch", False),
        (f"{PODS}/u1/volumes/kubernetes.io~configmap", False),
        (f"{PODS}/u1/volumes/kubernetes.io~configmap/cfg/key", False),
        (f"{PODS}/u1/volume-subpaths/cfg/c/0", False),
        (f"{PODS}/u1/etc-hosts", False),
        ("/elsewhere/u1/volumes/kubernetes.io~configmap/cfg", False),
        (f"{PODS}/../u1/volumes/kubernetes.io~configmap/cfg", False),
    ],
)
def test_which_paths_are_atomic_writer_volumes(path: str, expected: bool) -> None:
    assert kv.is_atomic_volume(os.path.normpath(path), PODS) is expected


@pytest.mark.parametrize(
    ("name", "ok"),
    [("..2026_11_27_14_35_00.1234567890", True), ("..data", False), ("..", False), ("data", False), ("../x", False)],
)
def test_version_names(name: str, ok: bool) -> None:
    assert kv.is_version(name) is ok


def _tree(files: dict[str, bytes]) -> kv.VolumeTree:
    meta = kv.Meta(0o644, 0, 0)
    dirs = sorted({"/".join(p.split("/")[:i]) for p in files for i in range(1, p.count("/") + 1)})
    entries = [kv.Entry(d, "dir", kv.Meta(0o755, 0, 0)) for d in dirs]
    entries += [kv.Entry(p, "file", meta, data) for p, data in sorted(files.items())]
    return kv.VolumeTree("..v1", kv.Meta(0o1777, 0, 0), kv.Meta(0o755, 0, 0), tuple(entries))


@given(
    st.dictionaries(st.sampled_from(["a", "b", "d/c", "d/e/f"]), st.binary(max_size=3000), min_size=1),
    st.integers(min_value=1, max_value=1000),
)
def test_batches_carry_every_byte_once_in_order_and_within_the_chunk(files: dict[str, bytes], chunk: int) -> None:
    tree = _tree(files)
    got: dict[str, bytes] = {}
    seen_dirs = []
    for batch in kv.write_batches("v" * 32, tree, chunk):
        assert batch["volume"] == "v" * 32 and batch["version"] == "..v1"
        entries = batch["entries"]
        assert isinstance(entries, list) and entries
        assert sum(len(base64.b64decode(e["data"])) for e in entries if e["type"] == "file") <= chunk
        for e in entries:
            if e["type"] == "dir":
                seen_dirs.append(e["path"])
                continue
            parent = e["path"].rpartition("/")[0]
            assert not parent or parent in seen_dirs  # parents before what they hold
            data = base64.b64decode(e["data"])
            assert e["offset"] == len(got.get(e["path"], b""))
            got[e["path"]] = got.get(e["path"], b"") + data
    assert got == files


def test_commit_names_the_first_components() -> None:
    args = kv.commit_args("v" * 32, _tree({"a": b"", "d/c": b"x"}))
    assert args["names"] == ["a", "d"] and args["root"] == {"mode": 0o1777, "uid": 0, "gid": 0}


# ---- the host reader, on the kubelet's layout ---------------------------------------------------


def test_reads_the_version_with_owners_and_modes(tmp_path: Path) -> None:
    vol = volume_dir(tmp_path, "uid-1", "secret", "creds")
    version = write_volume(vol, {"user": b"admin", "nested/pass": b"s3cret"}, mode=0o400, fs_group=2000)
    tree = volume_reader.read_tree(str(vol))
    assert tree.version == version == volume_reader.read_version(str(vol))
    by_path = {e.path: e for e in tree.entries}
    assert by_path["user"].data == b"admin" and by_path["nested/pass"].data == b"s3cret"
    assert by_path["user"].meta == kv.Meta(0o440, 0, 2000)  # defaultMode, then the fsGroup's g+r
    assert by_path["nested"].kind == "dir" and by_path["nested"].meta.mode & 0o2000
    assert tree.root.gid == 2000 and tree.names == ("nested", "user")


def test_an_update_is_read_as_the_new_version(tmp_path: Path) -> None:
    vol = volume_dir(tmp_path, "uid-1", "configmap", "cfg")
    write_volume(vol, {"greeting": b"hello", "old": b"x"})
    new = write_volume(vol, {"greeting": b"bye"})
    tree = volume_reader.read_tree(str(vol))
    assert tree.version == new and [(e.path, e.data) for e in tree.entries] == [("greeting", b"bye")]


def test_a_version_swapped_while_read_is_read_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    vol = volume_dir(tmp_path, "uid-1", "configmap", "cfg")
    write_volume(vol, {"k": b"1"})
    real_read = volume_reader._read
    calls = []

    def swapping(volume: str, version: str) -> kv.VolumeTree:
        calls.append(version)
        if len(calls) == 1:  # the kubelet writes a new version (and deletes this one) mid-read
            write_volume(vol, {"k": b"2"})
        return real_read(volume, version)

    monkeypatch.setattr(volume_reader, "_read", swapping)
    tree = volume_reader.read_tree(str(vol))
    assert len(calls) == 2 and tree.entries[0].data == b"2"


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda top: os.symlink("/etc/shadow", top / "link"), InvalidArgument, "neither a regular file"),
        (lambda top: os.mkfifo(top / "fifo"), InvalidArgument, "neither a regular file"),
        (lambda top: (top / "big").write_bytes(b"x" * (kv.MAX_BYTES + 1)), InvalidArgument, "more than"),
        (lambda top: (top / "..hidden").write_bytes(b""), InvalidArgument, "cannot be given"),
    ],
    ids=["symlink", "fifo", "too-large", "dot-dot-name"],
)
def test_what_a_guest_cannot_be_given_is_refused(
    make: object, error: type[Exception], match: str, tmp_path: Path
) -> None:
    vol = volume_dir(tmp_path, "uid-1", "projected", "p")
    version = write_volume(vol, {"ok": b"1"})
    make(vol / version)  # type: ignore[operator]
    with pytest.raises(error, match=match):
        volume_reader.read_tree(str(vol))


def test_too_many_entries_and_too_deep_are_refused(tmp_path: Path) -> None:
    vol = volume_dir(tmp_path, "uid-1", "projected", "many")
    write_volume(vol, {f"f{i}": b"" for i in range(kv.MAX_ENTRIES + 1)})
    with pytest.raises(InvalidArgument, match="more than 4096"):
        volume_reader.read_tree(str(vol))
    deep = volume_dir(tmp_path, "uid-1", "projected", "deep")
    write_volume(deep, {"/".join(["d"] * (kv.MAX_DEPTH + 1)) + "/f": b""})
    with pytest.raises(InvalidArgument, match="deeper than"):
        volume_reader.read_tree(str(deep))


def test_a_volume_without_data_link_is_not_read(tmp_path: Path) -> None:
    vol = volume_dir(tmp_path, "uid-1", "configmap", "empty")
    with pytest.raises(InfrastructureError, match=r"no \.\.data link"):
        volume_reader.read_tree(str(vol))


# ---- PodVolumes against a recording agent ------------------------------------------------------


class FakeAgent:
    """Records the volume ops; keeps what a guest would hold (volume id -> committed version)."""

    def __init__(self) -> None:
        self.ops: list[tuple[str, str]] = []
        self.versions: dict[str, str] = {}
        self.fail_on = ""
        self.lock = threading.Lock()

    def __call__(self, sandbox_id: str, op: str, *args: object, **kw: object) -> object:
        with self.lock:
            self.ops.append((sandbox_id, op))
            if op == self.fail_on:
                raise InfrastructureError(f"{op} failed")
            if op == "volume_begin":
                vid, version = str(args[0]), str(args[1])
                return self.versions.get(vid) == version
            if op == "volume_commit":
                a = args[0]
                assert isinstance(a, dict)
                self.versions[str(a["volume"])] = str(a["version"])
            if op == "volume_remove":
                self.versions.pop(str(args[0]), None)
            return None


def test_one_copy_per_pod_shared_by_its_containers_and_removed_with_the_last(tmp_path: Path) -> None:
    agent = FakeAgent()
    volumes = PodVolumes(agent)
    vol = volume_dir(tmp_path, "uid-1", "configmap", "cfg")
    write_volume(vol, {"k": b"v"})
    src = volumes.attach("s1", "c1", str(vol))
    assert src == kv.guest_path(kv.volume_id(str(vol)))
    assert volumes.attach("s1", "c2", str(vol)) == src
    assert [op for _, op in agent.ops] == ["volume_begin", "volume_write", "volume_commit"]  # the second: nothing
    assert volumes.used_by("s1", "c2") == (str(vol),)
    volumes.release("s1", "c1")
    assert "volume_remove" not in [op for _, op in agent.ops]
    volumes.release("s1", "c2")
    assert agent.ops[-1] == ("s1", "volume_remove") and not agent.versions


def test_a_failed_attach_leaves_no_copy(tmp_path: Path) -> None:
    agent = FakeAgent()
    agent.fail_on = "volume_commit"
    volumes = PodVolumes(agent)
    vol = volume_dir(tmp_path, "uid-1", "secret", "s")
    write_volume(vol, {"k": b"v"})
    with pytest.raises(InfrastructureError, match="volume_commit failed"):
        volumes.attach("s1", "c1", str(vol))
    assert volumes.used_by("s1", "c1") == () and agent.ops[-1] == ("s1", "volume_remove")


def test_refresh_sends_a_new_version_and_only_then(tmp_path: Path) -> None:
    agent = FakeAgent()
    volumes = PodVolumes(agent)
    vol = volume_dir(tmp_path, "uid-1", "projected", "token")
    write_volume(vol, {"token": b"t1"})
    vid = kv.volume_id(str(vol))
    volumes.attach("s1", "c1", str(vol))
    before = len(agent.ops)
    volumes.refresh()
    _settle()
    assert len(agent.ops) == before  # unchanged: one readlink, no guest call
    new = write_volume(vol, {"token": b"t2"})
    volumes.refresh()
    _settle()
    assert agent.versions[vid] == new


def test_an_adopted_copy_the_guest_has_is_not_sent_again(tmp_path: Path) -> None:
    agent = FakeAgent()
    vol = volume_dir(tmp_path, "uid-1", "configmap", "cfg")
    version = write_volume(vol, {"k": b"v"})
    agent.versions[kv.volume_id(str(vol))] = version  # the guest kept it across the shim's restart
    volumes = PodVolumes(agent)
    volumes.adopt("s1", "c1", (str(vol),))
    volumes.refresh()
    _settle()
    assert [op for _, op in agent.ops] == ["volume_begin"]


def _settle() -> None:
    for t in threading.enumerate():
        if t.name.startswith("volume-sync-"):
            t.join(timeout=10)
