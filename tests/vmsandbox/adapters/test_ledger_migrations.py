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
from vmsandbox.claims import Claim
from vmsandbox.errors import InfrastructureError

V1_STATEMENTS = MIGRATIONS[0]
P2M = 2 << 20


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
        assert db.schema_version == SCHEMA_VERSION == 3
        assert db.get_sandbox("sb1") == ("SANDBOX_READY", 11, {"pod": "web"})
        assert db.claims_of("sb1") == Claim(cpus=(0,), pages=((0, P2M, 1),))
        assert db.claim_owners() == {"sb1", "orphan"}
        assert [(c[0], c[1], c[2], c[4]) for c in db.containers()] == [
            ("c1", "sb1", "CONTAINER_CREATED", {"image": "busybox"})
        ]
        instance = db.instance_id
        assert re.fullmatch(r"[0-9a-f]{32}", instance)
        # the unique constraint survived: a held key still cannot be claimed again
        with pytest.raises(ledger_mod.ClaimConflict):
            db.claim("sb2", Claim(cpus=(0,)), page_limits={}, memory_limits={})
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
    # versions 2 and 3 were committed on their own; the failing step 3 -> 4 left nothing behind
    assert _user_version(path) == 3
    assert "half_done" not in _tables(path)
    monkeypatch.undo()
    db = Ledger(path)  # the real code opens the file at its last good version, data intact
    try:
        assert db.schema_version == 3
        assert db.claims_of("sb1") == Claim(cpus=(0,), pages=((0, P2M, 1),))
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
        assert reads[:2] == [3, 3]  # migration saw 1 (stale), then re-read 3 inside the transaction
        assert second.instance_id == first.instance_id
    finally:
        first.close()
        second.close()


def build_v2(path: Path) -> None:
    """A state database as a schema-2 shim left it: one claim row per hugepage."""
    raw = sqlite3.connect(path, isolation_level=None)
    try:
        raw.execute("PRAGMA journal_mode=WAL")
        raw.execute("BEGIN")
        for stmt in (*MIGRATIONS[0], *MIGRATIONS[1]):
            raw.execute(stmt)
        raw.execute("PRAGMA user_version = 2")
        rows = [("cpu:2", "sb1"), ("cpu:3", "sb1"), ("pci:0000:3b:00.0", "sb1"), ("cpu:5", "sb2")]
        rows += [(f"hugepages-2048kB:node0:{i}", "sb1") for i in range(144)]
        rows += [(f"hugepages-2048kB:node1:{i}", "sb1") for i in range(10, 16)]
        rows += [(f"hugepages-1048576kB:node1:{i}", "sb2") for i in range(2)]
        rows += [(f"hugepages-2048kB:node0:{i}", "sb2") for i in range(144, 160)]
        raw.executemany("INSERT INTO claims(key, sandbox_id) VALUES (?, ?)", rows)
        raw.execute("COMMIT")
    finally:
        raw.close()


def test_v2_page_rows_become_counted_amounts(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    build_v2(path)
    db = Ledger(path)
    try:
        assert db.schema_version == 3
        assert db.held() == {
            "sb1": Claim(cpus=(2, 3), pci=("0000:3b:00.0",), pages=((0, P2M, 144), (1, P2M, 6))),
            "sb2": Claim(cpus=(5,), pages=((0, P2M, 16), (1, 1 << 30, 2))),
        }
        raw = sqlite3.connect(path)
        try:  # one row per (sandbox, resource, node); no page row is left in claims; totals add up
            assert raw.execute("SELECT count(*) FROM amounts").fetchone() == (4,)
            assert raw.execute("SELECT count(*) FROM claims WHERE key LIKE 'hugepages-%'").fetchone() == (0,)
            assert sorted(raw.execute("SELECT resource, node, held FROM totals")) == [
                ("hugepages-1048576kB", 1, 2),
                ("hugepages-2048kB", 0, 160),
                ("hugepages-2048kB", 1, 6),
            ]
        finally:
            raw.close()
        # the migrated totals are enforced: node 0 has a budget of 161 pages, 160 are held
        with pytest.raises(ledger_mod.ClaimConflict):
            db.claim("sb3", Claim(pages=((0, P2M, 2),)), page_limits={(0, P2M): 161}, memory_limits={})
        db.claim("sb3", Claim(pages=((0, P2M, 1),)), page_limits={(0, P2M): 161}, memory_limits={})
        assert db.release("sb1") == 5  # two CPUs, one PCI function, two page amounts
        db.claim("sb4", Claim(pages=((0, P2M, 144),)), page_limits={(0, P2M): 161}, memory_limits={})
    finally:
        db.close()


def test_v2_file_is_read_by_the_admin_tools_before_it_is_migrated(tmp_path: Path) -> None:
    """``vmsandbox ls``/``plan --state-dir`` read a file a not-yet-upgraded shim still writes."""
    path = tmp_path / "state.db"
    build_v2(path)
    raw = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        assert ledger_mod.read_claims(raw)["sb1"] == Claim(
            cpus=(2, 3), pci=("0000:3b:00.0",), pages=((0, P2M, 144), (1, P2M, 6))
        )
        assert ledger_mod.read_claims(raw, "sb2") == {"sb2": Claim(cpus=(5,), pages=((0, P2M, 16), (1, 1 << 30, 2)))}
    finally:
        raw.close()
    assert _user_version(path) == 2
