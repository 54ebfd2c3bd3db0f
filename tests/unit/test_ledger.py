"""Tests of vmsandbox.adapters.ledger: transactional claims, sandbox/container records, schema versioning."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from vmsandbox.adapters.ledger import MIGRATIONS, SCHEMA_VERSION, ClaimConflict, Ledger
from vmsandbox.errors import AlreadyExists, InfrastructureError, NotFound


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    db = Ledger(tmp_path / "state.db")
    yield db
    db.close()


def test_schema_version_and_wal(ledger: Ledger) -> None:
    assert SCHEMA_VERSION == len(MIGRATIONS) == 2
    assert ledger.schema_version == SCHEMA_VERSION
    raw = sqlite3.connect(ledger.path)
    try:
        assert raw.execute("PRAGMA user_version").fetchone() == (2,)
        assert raw.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        assert {r[0] for r in raw.execute("SELECT name FROM sqlite_master WHERE type = 'table'")} == {
            "claims",
            "sandboxes",
            "containers",
            "meta",
        }
    finally:
        raw.close()


# -- claims ---------------------------------------------------------------------------------------
def test_claim_and_release(ledger: Ledger) -> None:
    ledger.claim("sb1", ["cpu:1", "cpu:0", "hugepages-2048kB:node0:0"])
    ledger.claim("sb2", ["cpu:2"])
    ledger.claim("sb3", [])
    assert ledger.taken() == {"cpu:0", "cpu:1", "cpu:2", "hugepages-2048kB:node0:0"}
    assert ledger.claims_of("sb1") == ("cpu:0", "cpu:1", "hugepages-2048kB:node0:0")
    assert ledger.claim_owners() == {"sb1", "sb2"}
    assert ledger.release("sb1") == 3
    assert ledger.release("sb1") == 0
    assert ledger.release("unknown") == 0
    assert ledger.taken() == {"cpu:2"}
    assert ledger.claims_of("sb1") == ()


@pytest.mark.parametrize(
    ("sandbox", "keys", "conflicting"),
    [
        pytest.param("sb2", ["cpu:5", "cpu:1"], ["cpu:1"], id="one-held"),
        pytest.param("sb2", ["cpu:0", "cpu:9", "cpu:1"], ["cpu:0", "cpu:1"], id="two-held"),
        pytest.param("sb1", ["cpu:7", "cpu:0"], ["cpu:0"], id="same-sandbox-again"),
    ],
)
def test_claim_is_all_or_nothing(ledger: Ledger, sandbox: str, keys: list[str], conflicting: list[str]) -> None:
    ledger.claim("sb1", ["cpu:0", "cpu:1"])
    with pytest.raises(ClaimConflict) as exc:
        ledger.claim(sandbox, keys)
    assert exc.value.keys == conflicting
    assert str(exc.value) == "already held: " + ", ".join(conflicting)
    assert ledger.taken() == {"cpu:0", "cpu:1"}
    assert ledger.claims_of("sb2") == ()
    assert ledger.claim_owners() == {"sb1"}


def test_claims_conflict_across_connections(tmp_path: Path) -> None:
    """Two processes (here: two connections) can never both hold a key."""
    a, b = Ledger(tmp_path / "state.db"), Ledger(tmp_path / "state.db")
    try:
        a.claim("sb1", ["cpu:3"])
        with pytest.raises(ClaimConflict) as exc:
            b.claim("sb2", ["cpu:4", "cpu:3"])
        assert exc.value.keys == ["cpu:3"]
        assert b.taken() == a.taken() == {"cpu:3"}
    finally:
        a.close()
        b.close()


# -- sandboxes and containers -----------------------------------------------------------------
def test_sandboxes(ledger: Ledger) -> None:
    ledger.put_sandbox("sb2", "creating", 200, {"n": 2})
    ledger.put_sandbox("sb1", "creating", 100, {"n": 1, "nested": {"list": [1, "x"]}})
    assert ledger.get_sandbox("sb1") == ("creating", 100, {"n": 1, "nested": {"list": [1, "x"]}})
    assert ledger.get_sandbox("nope") is None
    ledger.put_sandbox("sb1", "ready", 999, {"n": 1, "ready": True})  # update keeps created_ns
    assert ledger.get_sandbox("sb1") == ("ready", 100, {"n": 1, "ready": True})
    assert ledger.sandboxes() == [
        ("sb1", "ready", 100, {"n": 1, "ready": True}),
        ("sb2", "creating", 200, {"n": 2}),
    ]


def test_containers(ledger: Ledger) -> None:
    ledger.put_sandbox("sb1", "ready", 1, {})
    ledger.put_sandbox("sb2", "ready", 2, {})
    ledger.put_container("c2", "sb1", "app", 0, "created", 20, {"x": 2})
    ledger.put_container("c1", "sb1", "init", 0, "created", 10, {"x": 1})
    ledger.put_container("c3", "sb2", "app", 0, "created", 30, {})
    ledger.put_container("c4", "sb1", "app", 1, "created", 40, {})  # a retry under a higher attempt
    ledger.put_container("c1", "sb1", "init", 0, "exited", 999, {"x": 1, "code": 0})  # update
    assert ledger.containers("sb1") == [
        ("c1", "sb1", "exited", 10, {"x": 1, "code": 0}),
        ("c2", "sb1", "created", 20, {"x": 2}),
        ("c4", "sb1", "created", 40, {}),
    ]
    assert [c[0] for c in ledger.containers()] == ["c1", "c2", "c3", "c4"]
    assert ledger.containers("none") == []
    assert ledger.delete_container("c2") is True
    assert ledger.delete_container("c2") is False
    assert [c[0] for c in ledger.containers("sb1")] == ["c1", "c4"]


def test_container_name_and_attempt_are_unique(ledger: Ledger) -> None:
    ledger.put_sandbox("sb1", "ready", 1, {})
    ledger.put_container("c1", "sb1", "app", 0, "created", 10, {})
    with pytest.raises(AlreadyExists) as exc:
        ledger.put_container("c2", "sb1", "app", 0, "created", 11, {})
    assert str(exc.value) == 'container "app" (attempt 0) already exists in sandbox sb1'
    assert [c[0] for c in ledger.containers()] == ["c1"]


def test_container_needs_its_sandbox(ledger: Ledger) -> None:
    with pytest.raises(NotFound) as exc:
        ledger.put_container("c1", "ghost", "app", 0, "created", 10, {})
    assert str(exc.value) == "sandbox ghost is not in the state database"
    assert ledger.containers() == []


def test_delete_sandbox_takes_containers_and_claims(ledger: Ledger) -> None:
    for sid in ("sb1", "sb2"):
        ledger.put_sandbox(sid, "ready", 1, {})
        ledger.put_container(f"{sid}-c", sid, "app", 0, "created", 1, {})
        ledger.claim(sid, [f"cpu:{sid[-1]}"])
    ledger.delete_sandbox("sb1")
    ledger.delete_sandbox("unknown")
    assert ledger.get_sandbox("sb1") is None
    assert [s[0] for s in ledger.sandboxes()] == ["sb2"]
    assert [c[0] for c in ledger.containers()] == ["sb2-c"]
    assert ledger.taken() == {"cpu:2"}


# -- durability and versioning -----------------------------------------------------------------
def test_reopen_keeps_data(tmp_path: Path) -> None:
    first = Ledger(tmp_path / "state.db")
    first.put_sandbox("sb1", "ready", 5, {"k": "v"})
    first.put_container("c1", "sb1", "app", 0, "created", 6, {})
    first.claim("sb1", ["cpu:0"])
    first.close()
    again = Ledger(tmp_path / "state.db")
    try:
        assert again.schema_version == SCHEMA_VERSION
        assert again.get_sandbox("sb1") == ("ready", 5, {"k": "v"})
        assert [c[0] for c in again.containers()] == ["c1"]
        assert again.taken() == {"cpu:0"}
    finally:
        again.close()


def test_committed_rows_survive_a_crash(tmp_path: Path) -> None:
    """A process that dies without closing (no checkpoint, WAL left behind) loses nothing it committed."""
    path = tmp_path / "state.db"
    script = textwrap.dedent(
        f"""
        import os
        from vmsandbox.adapters.ledger import Ledger
        db = Ledger({str(path)!r})
        db.put_sandbox("sb1", "ready", 1, {{"pod": "a"}})
        db.claim("sb1", ["cpu:0", "cpu:1"])
        db._db.execute("BEGIN IMMEDIATE")
        db._db.execute("INSERT INTO claims(key, sandbox_id) VALUES ('cpu:9', 'uncommitted')")
        os._exit(0)
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=Path(__file__).parents[2], timeout=30)
    assert (tmp_path / "state.db-wal").exists()
    db = Ledger(path)
    try:
        assert db.get_sandbox("sb1") == ("ready", 1, {"pod": "a"})
        assert db.taken() == {"cpu:0", "cpu:1"}
    finally:
        db.close()


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    raw = sqlite3.connect(path)
    raw.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    raw.close()
    with pytest.raises(InfrastructureError) as exc:
        Ledger(path)
    assert str(exc.value) == (
        f"state database {path} has schema 3, newer than this vmsandbox (2); refusing to touch it"
    )
    assert _open_fds(path) == []  # the refused connection was closed
    raw = sqlite3.connect(path)
    try:
        assert raw.execute("SELECT count(*) FROM sqlite_master").fetchone() == (0,)  # untouched
        assert raw.execute("PRAGMA user_version").fetchone() == (3,)
    finally:
        raw.close()


def test_not_a_database(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    path.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(InfrastructureError) as exc:
        Ledger(path)
    assert str(exc.value) == f"state database {path}: file is not a database"


def _open_fds(path: Path) -> list[str]:
    fds = Path("/proc/self/fd")
    if not fds.is_dir():
        pytest.skip("needs /proc/self/fd")
    out = []
    for fd in fds.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith(str(path)):
            out.append(target)
    return out
