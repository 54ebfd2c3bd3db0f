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
from vmsandbox.claims import Claim
from vmsandbox.errors import AlreadyExists, InfrastructureError, NotFound

P2M = 2 << 20
PAGES = {(0, P2M): 8, (1, P2M): 8}
MEMORY = {0: 1 << 30}


def claim(db: Ledger, sandbox_id: str, what: Claim) -> None:
    db.claim(sandbox_id, what, page_limits=PAGES, memory_limits=MEMORY)


def cpus(*ids: int) -> Claim:
    return Claim(cpus=ids)


def held_cpus(db: Ledger) -> set[int]:
    return {c for held in db.held().values() for c in held.cpus}


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    db = Ledger(tmp_path / "state.db")
    yield db
    db.close()


def test_schema_version_and_wal(ledger: Ledger) -> None:
    assert SCHEMA_VERSION == len(MIGRATIONS) == 3
    assert ledger.schema_version == SCHEMA_VERSION
    raw = sqlite3.connect(ledger.path)
    try:
        assert raw.execute("PRAGMA user_version").fetchone() == (3,)
        assert raw.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        assert {r[0] for r in raw.execute("SELECT name FROM sqlite_master WHERE type = 'table'")} == {
            "claims",
            "sandboxes",
            "containers",
            "meta",
            "amounts",
            "totals",
        }
    finally:
        raw.close()


# -- claims ---------------------------------------------------------------------------------------
def test_claim_and_release(ledger: Ledger) -> None:
    one = Claim.of(cpus=(1, 0), pages=[(0, P2M, 3)], memory=[(0, 64 << 20)], pci=("0000:3b:00.0",))
    claim(ledger, "sb1", one)
    claim(ledger, "sb2", Claim.of(cpus=(2,), pages=[(0, P2M, 5)]))
    claim(ledger, "sb3", Claim())
    assert ledger.held() == {
        "sb1": Claim.of(cpus=(0, 1), pages=[(0, P2M, 3)], memory=[(0, 64 << 20)], pci=("0000:3b:00.0",)),
        "sb2": Claim.of(cpus=(2,), pages=[(0, P2M, 5)]),
    }
    assert ledger.claims_of("sb1").pages == ((0, P2M, 3),)
    assert ledger.claim_owners() == {"sb1", "sb2"}
    assert ledger.release("sb1") == 5  # two CPUs, one PCI function, one page amount, one memory amount
    assert ledger.release("sb1") == 0
    assert ledger.release("unknown") == 0
    assert held_cpus(ledger) == {2}
    assert ledger.claims_of("sb1") == Claim()
    claim(ledger, "sb4", Claim.of(pages=[(0, P2M, 3)]))  # the 3 pages sb1 gave back are free again


@pytest.mark.parametrize(
    ("sandbox", "wanted", "conflicting"),
    [
        pytest.param("sb2", cpus(5, 1), ["cpu:1"], id="one-held"),
        pytest.param("sb2", cpus(0, 9, 1), ["cpu:0", "cpu:1"], id="two-held"),
        pytest.param("sb1", cpus(7, 0), ["cpu:0"], id="same-sandbox-again"),
        pytest.param(
            "sb2",
            Claim.of(cpus=(5,), pages=[(0, P2M, 5)]),
            ["hugepages-2048kB on node 0: 5 more would exceed 8 (4 held)"],
            id="pages-beyond-the-limit",
        ),
        pytest.param(
            "sb2",
            Claim.of(pages=[(1, P2M, 9)]),
            ["hugepages-2048kB on node 1: 9 more would exceed 8 (0 held)"],
            id="pages-beyond-an-unused-pool",
        ),
        pytest.param(
            "sb2",
            Claim.of(pages=[(0, 1 << 30, 1)]),
            ["hugepages-1048576kB on node 0: 1 more would exceed 0 (0 held)"],
            id="pages-of-a-pool-without-limit",
        ),
        pytest.param(
            "sb2",
            Claim.of(memory=[(0, (1 << 30) + 1)]),
            ["memory on node 0: 1073741825 more would exceed 1073741824 (0 held)"],
            id="memory-beyond-the-limit",
        ),
    ],
)
def test_claim_is_all_or_nothing(ledger: Ledger, sandbox: str, wanted: Claim, conflicting: list[str]) -> None:
    before = Claim.of(cpus=(0, 1), pages=[(0, P2M, 4)])
    claim(ledger, "sb1", before)
    with pytest.raises(ClaimConflict) as exc:
        claim(ledger, sandbox, wanted)
    assert exc.value.what == conflicting
    assert str(exc.value) == "already held: " + ", ".join(conflicting)
    assert ledger.held() == {"sb1": before}
    assert ledger.claim_owners() == {"sb1"}
    claim(ledger, "sb3", Claim.of(pages=[(0, P2M, 4)]))  # the refused claim left no amount behind either


def test_claims_conflict_across_connections(tmp_path: Path) -> None:
    """Two processes (here: two connections) can never both hold a CPU, nor more pages than the limit."""
    a, b = Ledger(tmp_path / "state.db"), Ledger(tmp_path / "state.db")
    try:
        claim(a, "sb1", Claim.of(cpus=(3,), pages=[(0, P2M, 6)]))
        with pytest.raises(ClaimConflict) as exc:
            claim(b, "sb2", cpus(4, 3))
        assert exc.value.what == ["cpu:3"]
        with pytest.raises(ClaimConflict):
            claim(b, "sb2", Claim.of(pages=[(0, P2M, 3)]))
        claim(b, "sb2", Claim.of(pages=[(0, P2M, 2)]))
        assert (
            b.held()
            == a.held()
            == {"sb1": Claim.of(cpus=(3,), pages=[(0, P2M, 6)]), "sb2": Claim.of(pages=[(0, P2M, 2)])}
        )
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
        claim(ledger, sid, Claim.of(cpus=(int(sid[-1]),), pages=[(0, P2M, 4)]))
    ledger.delete_sandbox("sb1")
    ledger.delete_sandbox("unknown")
    assert ledger.get_sandbox("sb1") is None
    assert [s[0] for s in ledger.sandboxes()] == ["sb2"]
    assert [c[0] for c in ledger.containers()] == ["sb2-c"]
    assert ledger.held() == {"sb2": Claim.of(cpus=(2,), pages=[(0, P2M, 4)])}
    claim(ledger, "sb3", Claim.of(pages=[(0, P2M, 4)]))  # sb1's pages went with it


# -- durability and versioning -----------------------------------------------------------------
def test_reopen_keeps_data(tmp_path: Path) -> None:
    first = Ledger(tmp_path / "state.db")
    first.put_sandbox("sb1", "ready", 5, {"k": "v"})
    first.put_container("c1", "sb1", "app", 0, "created", 6, {})
    claim(first, "sb1", cpus(0))
    first.close()
    again = Ledger(tmp_path / "state.db")
    try:
        assert again.schema_version == SCHEMA_VERSION
        assert again.get_sandbox("sb1") == ("ready", 5, {"k": "v"})
        assert [c[0] for c in again.containers()] == ["c1"]
        assert held_cpus(again) == {0}
    finally:
        again.close()


def test_committed_rows_survive_a_crash(tmp_path: Path) -> None:
    """A process that dies without closing (no checkpoint, WAL left behind) loses nothing it committed."""
    path = tmp_path / "state.db"
    script = textwrap.dedent(
        f"""
        import os
        from vmsandbox.adapters.ledger import Ledger
        from vmsandbox.claims import Claim
        db = Ledger({str(path)!r})
        db.put_sandbox("sb1", "ready", 1, {{"pod": "a"}})
        db.claim("sb1", Claim(cpus=(0, 1)), page_limits={{}}, memory_limits={{}})
        db._db.execute("BEGIN IMMEDIATE")
        db._db.execute("INSERT INTO claims(key, sandbox_id) VALUES ('cpu:9', 'uncommitted')")
        os._exit(0)
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=Path(__file__).parents[3], timeout=30)
    assert (tmp_path / "state.db-wal").exists()
    db = Ledger(path)
    try:
        assert db.get_sandbox("sb1") == ("ready", 1, {"pod": "a"})
        assert held_cpus(db) == {0, 1}
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
        f"state database {path} has schema 4, newer than this vmsandbox (3); refusing to touch it"
    )
    assert _open_fds(path) == []  # the refused connection was closed
    raw = sqlite3.connect(path)
    try:
        assert raw.execute("SELECT count(*) FROM sqlite_master").fetchone() == (0,)  # untouched
        assert raw.execute("PRAGMA user_version").fetchone() == (SCHEMA_VERSION + 1,)
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
