"""shim.dra.store: prepared claims survive a restart, written atomically, read back defensively."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from shim.dra.record_files import MAX_RECORD_BYTES
from shim.dra.store import ClaimStore
from vmsandbox.dra import NetworkConfig, PreparedClaim, PreparedDevice, claim_record
from vmsandbox.errors import InvalidArgument

A = PreparedClaim("uid-a", "ns", "a", ("pod-1",), (PreparedDevice("net", "n-networks", "lan", NetworkConfig("net1")),))
B = PreparedClaim("uid-b", "ns", "b", ("pod-1", "pod-2"), (PreparedDevice("net", "n-networks", "wan"),))


def test_put_get_remove_and_restart(tmp_path: Path) -> None:
    store = ClaimStore(tmp_path / "claims")
    store.put(A)
    store.put(B)
    assert store.get("uid-a") == A
    assert store.for_pod("pod-1") == [A, B]
    assert store.for_pod("pod-2") == [B]
    again = ClaimStore(tmp_path / "claims")
    assert again.all() == [A, B]
    assert again.remove("uid-a") is True
    assert again.remove("uid-a") is False  # idempotent
    assert ClaimStore(tmp_path / "claims").all() == [B]


def test_modes(tmp_path: Path) -> None:
    store = ClaimStore(tmp_path / "claims")
    store.put(A)
    assert stat.S_IMODE(os.stat(tmp_path / "claims").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(tmp_path / "claims" / "uid-a.json").st_mode) == 0o600


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("uid-x.json", b"not json"),
        ("uid-x.json", b"{}"),
        ("uid-x.json", b" " * (MAX_RECORD_BYTES + 1)),
        ("uid-x.json", json.dumps(claim_record(A)).encode()),  # names another claim
        ("notes.txt", b"whatever"),
    ],
)
def test_unreadable_records_are_left_out(tmp_path: Path, name: str, content: bytes) -> None:
    directory = tmp_path / "claims"
    ClaimStore(directory).put(B)
    (directory / name).write_bytes(content)
    assert ClaimStore(directory).all() == [B]


def test_symlinked_record_is_not_followed(tmp_path: Path) -> None:
    directory = tmp_path / "claims"
    ClaimStore(directory)
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps(claim_record(A)))
    (directory / "uid-a.json").symlink_to(target)
    assert ClaimStore(directory).all() == []


def test_interrupted_write_is_dropped(tmp_path: Path) -> None:
    directory = tmp_path / "claims"
    ClaimStore(directory)
    (directory / ".uid-a.tmp").write_text(json.dumps(claim_record(A))[:10])
    assert ClaimStore(directory).all() == []
    assert not (directory / ".uid-a.tmp").exists()


@pytest.mark.parametrize("uid", ["../x", "", "a/b"])
def test_bad_uid_refused(tmp_path: Path, uid: str) -> None:
    store = ClaimStore(tmp_path / "claims")
    with pytest.raises(InvalidArgument):
        store.remove(uid)
