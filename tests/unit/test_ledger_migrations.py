"""Schema migrations of the state database: old files upgrade with their data, newer files are
refused untouched, and a migration that fails half-way leaves the file at its old version."""

from __future__ import annotations

import json
import re
import sqlite3
from pathlib import Path

import pytest

from vmsandbox.adapters import ledger as ledger_mod
from vmsandbox.adapters.ledger import MIGRATIONS, SCHEMA_VERSION, Ledger
from vmsandbox.errors import InfrastructureError

V1_STATEMENTS = MIGRATIONS[0]


def _user_version(path: Path) -> int:
    raw = sqlite3.connect(path)
    try:
        return int(raw.execute("PRAGMA user_version").fetchone()[0])
    finally:
        raw.close()


def _tables(path: Path) -> set[str]:
    raw = sqlite3.connect(path)
    try:
        return {r[0] for r in raw.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    finally:
        raw.close()


def build_v1(path: Path) -> None:
    """A state database as a schema-1 shim left it: WAL, one READY sandbox with claims and a container."""
    raw = sqlite3.connect(path, isolation_level=None)
    try:
        raw.execute("PRAGMA journal_mode=WAL")
        raw.execute("BEGIN")
        for stmt in V1_STATEMENTS:
            raw.execute(stmt)
        raw.execute("PRAGMA user_version = 1")
        raw.execute(
            "INSERT INTO sandboxes(id, state, created_ns, record) VALUES (?, ?, ?, ?)",
            ("sb1", "SANDBOX_READY", 11, json.dumps({"pod": "web"})),
        )
        raw.executemany(
            "INSERT INTO claims(key, sandbox_id) VALUES (?, ?)",
            [("cpu:0", "sb1"), ("hugepages-2048kB:node0:0", "sb1"), ("cpu:1", "orphan")],
        )
        raw.execute(
            "INSERT INTO containers(id, sandbox_id, name, attempt, state, created_ns, record) "
            "VALUES ('c1', 'sb1', 'app', 0, 'CONTAINER_CREATED', 12, '{\"image\": \"busybox\"}')"
        )
        raw.execute("COMMIT")
    finally:
        raw.close()


def test_v1_file_migrates_to_current_with_data_intact(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    build_v1(path)
    assert _user_version(path) == 1
    db = Ledger(path)
    try:
        assert db.schema_version == SCHEMA_VERSION == 2
        assert db.get_sandbox("sb1") == ("SANDBOX_READY", 11, {"pod": "web"})
        assert db.claims_of("sb1") == ("cpu:0", "hugepages-2048kB:node0:0")
        assert db.claim_owners() == {"sb1", "orphan"}
        assert [(c[0], c[1], c[2], c[4]) for c in db.containers()] == [
            ("c1", "sb1", "CONTAINER_CREATED", {"image": "busybox"})
        ]
        instance = db.instance_id
        assert re.fullmatch(r"[0-9a-f]{32}", instance)
        # the unique constraint survived: a held key still cannot be claimed again
        with pytest.raises(ledger_mod.ClaimConflict):
            db.claim("sb2", ["cpu:0"])
    finally:
        db.close()
    # the id is minted once: reopening keeps it
    again = Ledger(path)
    try:
        assert again.instance_id == instance
        assert again.schema_version == SCHEMA_VERSION
    finally:
        again.close()


def test_fresh_databases_get_distinct_instance_ids(tmp_path: Path) -> None:
    a, b = Ledger(tmp_path / "a.db"), Ledger(tmp_path / "b.db")
    try:
        assert a.instance_id != b.instance_id
    finally:
        a.close()
        b.close()


def test_newer_than_known_version_is_refused_untouched(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    build_v1(path)
    raw = sqlite3.connect(path)
    raw.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 5}")
    raw.close()
    with pytest.raises(InfrastructureError) as err:
        Ledger(path)
    assert f"has schema {SCHEMA_VERSION + 5}, newer than this vmsandbox ({SCHEMA_VERSION})" in str(err.value)
    assert _user_version(path) == SCHEMA_VERSION + 5
    assert "meta" not in _tables(path)


def test_failing_migration_leaves_the_old_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A migration whose last statement fails rolls back its earlier statements and the version bump."""
    path = tmp_path / "state.db"
    build_v1(path)
    broken = (
        *MIGRATIONS,
        ("CREATE TABLE half_done (x INTEGER)", "ALTER TABLE claims ADD COLUMN key TEXT"),  # duplicate column
    )
    monkeypatch.setattr(ledger_mod, "MIGRATIONS", broken)
    monkeypatch.setattr(ledger_mod, "SCHEMA_VERSION", len(broken))
    with pytest.raises(InfrastructureError) as err:
        Ledger(path)
    assert "duplicate column name: key" in str(err.value)
    # version 2 was committed on its own; the failing step 2 -> 3 left nothing behind
    assert _user_version(path) == 2
    assert "half_done" not in _tables(path)
    monkeypatch.undo()
    db = Ledger(path)  # the real code opens the file at its last good version, data intact
    try:
        assert db.schema_version == 2
        assert db.claims_of("sb1") == ("cpu:0", "hugepages-2048kB:node0:0")
    finally:
        db.close()


def test_failing_first_step_leaves_v1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "state.db"
    build_v1(path)
    broken = (MIGRATIONS[0], (*MIGRATIONS[1], "INSERT INTO meta(key, value) VALUES ('instance_id', 'twice')"))
    monkeypatch.setattr(ledger_mod, "MIGRATIONS", broken)
    with pytest.raises(InfrastructureError):
        Ledger(path)
    assert _user_version(path) == 1
    assert "meta" not in _tables(path)


def test_migration_step_is_skipped_when_another_process_got_there_first(tmp_path: Path) -> None:
    """The version is read again inside the migration's transaction: a shim that saw version 1 just
    before another one migrated the file skips the step instead of failing on ``meta`` existing."""
    path = tmp_path / "state.db"
    build_v1(path)
    first = Ledger(path)
    reads: list[int] = []

    class Stale(Ledger):
        @property
        def schema_version(self) -> int:
            actual = super().schema_version
            reads.append(actual)
            return 1 if len(reads) == 1 else actual  # the first read is from before the other migrated

    second = Stale(path)
    try:
        assert reads[:2] == [2, 2]  # migration saw 1 (stale), then re-read 2 inside the transaction
        assert second.instance_id == first.instance_id
    finally:
        first.close()
        second.close()
