"""Tests of vmsandbox.adapters.snapshot_store on a temporary state directory: snapshots are found
only under the key their inputs hash to, a restore reads a retargeted copy that is gone afterwards
(the spare copy made ahead when it is of the very image), a truncated image is refused, and a sweep
removes what a killed shim left."""

from __future__ import annotations

import json
import stat
from dataclasses import replace
from pathlib import Path

import pytest

from tests.vmsandbox.test_snapshot_rules import BASE, save_image
from vmsandbox.adapters.snapshot_store import SavedAgent, SnapshotStore
from vmsandbox.errors import InfrastructureError
from vmsandbox.snapshot_rules import parse_save_header

SID = "7" * 64
NAME, UUID = "vmsandbox-" + "7" * 32, "11111111-2222-4333-8444-555555555555"
QEMU_UID = 2_100_000_123
AGENT = SavedAgent("a" * 32, 8)


def made(store: SnapshotStore, image: bytes = save_image(stream=b"QEVM" * 1000)) -> str:
    making = store.making_dir(BASE.key)
    store.share_dirs(making, 2, QEMU_UID)
    Path(store.image_path(making)).write_bytes(image)
    return store.commit(BASE.key, BASE, making, 1234, AGENT).key


def test_a_committed_snapshot_is_found_by_its_key_only(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    key = made(store)
    found = store.get(key)
    assert found is not None and found.inputs == BASE and found.make_ms == 1234 and found.agent == AGENT
    assert store.get(replace(BASE, qemu_version="8.0.0").key) is None
    assert [s.key for s in store.all()] == [key]
    assert not list((tmp_path / "snapshots" / "making").iterdir())


def test_the_making_qemus_uid_owns_its_shares_only_until_the_snapshot_is_stored(tmp_path: Path) -> None:
    """The snapshot guest's QEMU (an unprivileged uid) passes down to its shares, which are its own;
    once stored, nothing of the snapshot is that uid's (a pod's QEMU may get the uid next)."""
    store = SnapshotStore(tmp_path)
    making = store.making_dir(BASE.key)
    shares = store.share_dirs(making, 2, QEMU_UID)
    root = tmp_path / "snapshots"
    for d in (root, root / "making", making, making / "share"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o711, d
    for s in map(Path, shares):
        st = s.stat()
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (QEMU_UID, QEMU_UID, 0o700)
    Path(store.image_path(making)).write_bytes(save_image(stream=b"QEVM"))
    key = store.commit(BASE.key, BASE, making, 1, AGENT).key
    stored = root / key
    assert stat.S_IMODE(stored.stat().st_mode) == 0o700
    owners = {(p.stat().st_uid, p.stat().st_gid) for p in [stored, *stored.rglob("*")]}
    assert owners == {(0, 0)}, owners


def test_a_store_of_an_earlier_version_becomes_passable(tmp_path: Path) -> None:
    (tmp_path / "snapshots" / "making").mkdir(parents=True, mode=0o700)
    (tmp_path / "snapshots").chmod(0o700)
    store = SnapshotStore(tmp_path)
    store.making_dir(BASE.key)
    assert stat.S_IMODE((tmp_path / "snapshots").stat().st_mode) == 0o711
    assert stat.S_IMODE((tmp_path / "snapshots" / "restore").stat().st_mode) == 0o700


def test_inputs_that_do_not_hash_to_the_key_are_ignored(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    key = made(store)
    doc_path = tmp_path / "snapshots" / key / "inputs.json"
    doc = json.loads(doc_path.read_text())
    doc["inputs"]["image_digest"] = "b" * 64  # edited by hand: not what the image was made from
    doc_path.write_text(json.dumps(doc))
    assert store.get(key) is None and store.all() == []


def test_a_restore_reads_a_retargeted_copy_that_is_removed_after(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    key = made(store)
    with store.staged(key, SID, NAME, UUID) as path:
        data = Path(path).read_bytes()
        header = parse_save_header(data)
        assert f"<name>{NAME}</name>" in header.xml and f"<uuid>{UUID}</uuid>" in header.xml
        assert data[header.stream_offset :] == b"QEVM" * 1000
    assert not Path(path).exists()


def test_a_truncated_image_is_refused_and_leaves_no_copy(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    key = made(store, save_image(stream=b""))
    with pytest.raises(InfrastructureError, match="truncated"), store.staged(key, SID, NAME, UUID):
        pass
    assert list((tmp_path / "snapshots" / "restore").iterdir()) == []


def test_sweep_removes_copies_and_half_made_snapshots(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    key = made(store)
    (tmp_path / "snapshots" / "restore" / f"{SID}.save").write_bytes(b"left by a killed shim")
    (tmp_path / "snapshots" / "restore" / f"{'8' * 64}.save").write_bytes(b"in flight")
    store.making_dir(replace(BASE, vcpus=2).key)
    removed = store.sweep(keep={"8" * 64})
    assert len(removed) == 2
    assert [p.name for p in (tmp_path / "snapshots" / "restore").iterdir()] == [f"{'8' * 64}.save"]
    assert store.get(key) is not None
    assert store.remove(key) and store.get(key) is None and not store.remove(key)


def test_a_snapshot_stored_without_its_agent_is_not_found(tmp_path: Path) -> None:
    """An earlier store's snapshot does not say which instance its agent restores with: it is made again."""
    store = SnapshotStore(tmp_path)
    key = made(store)
    doc_path = tmp_path / "snapshots" / key / "inputs.json"
    doc = json.loads(doc_path.read_text())
    del doc["agent"]
    doc_path.write_text(json.dumps(doc))
    assert store.get(key) is None


def restore_dir(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "snapshots" / "restore").iterdir())


def test_a_restore_takes_the_spare_copy_and_rewrites_only_its_header(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    key = made(store)
    assert store.refill_spare(key) and not store.refill_spare(key)  # one spare at most
    [spare] = restore_dir(tmp_path)
    assert spare.startswith(f"spare-{key}-") and spare.endswith(".save")
    spare_ino = (tmp_path / "snapshots" / "restore" / spare).stat().st_ino
    with store.staged(key, SID, NAME, UUID) as path:
        assert Path(path).stat().st_ino == spare_ino  # taken, not copied
        assert restore_dir(tmp_path) == [f"{SID}.save"]
        data = Path(path).read_bytes()
        header = parse_save_header(data)
        assert f"<name>{NAME}</name>" in header.xml and f"<uuid>{UUID}</uuid>" in header.xml
        assert data[header.stream_offset :] == b"QEVM" * 1000
    assert restore_dir(tmp_path) == []  # the next restore copies, until a spare is made again
    with store.staged(key, SID, NAME, UUID) as path:
        assert parse_save_header(Path(path).read_bytes()).xml.count(NAME) == 1


def test_a_spare_of_an_image_since_replaced_is_never_used(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    key = made(store)
    store.refill_spare(key)
    [old_spare] = restore_dir(tmp_path)
    made(store, save_image(stream=b"NEWS" * 1000))  # the same key made again: commit drops spares
    assert restore_dir(tmp_path) == []
    (tmp_path / "snapshots" / "restore" / old_spare).write_bytes(b"stale")  # one left by a race
    with store.staged(key, SID, NAME, UUID) as path:
        data = Path(path).read_bytes()
        assert data[parse_save_header(data).stream_offset :] == b"NEWS" * 1000
    assert store.refill_spare(key)
    assert old_spare not in restore_dir(tmp_path)  # a refill removes the key's other spares


def test_removing_a_snapshot_removes_its_spare_and_sweep_removes_spares(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    key = made(store)
    store.refill_spare(key)
    assert store.remove(key) and restore_dir(tmp_path) == []
    assert not store.refill_spare(key)  # no snapshot, no spare
    key = made(store)
    store.refill_spare(key)
    (tmp_path / "snapshots" / "restore" / f"spare-{key}.partial-1-2").write_bytes(b"half")
    assert len(store.sweep(keep=set())) == 2 and restore_dir(tmp_path) == []
