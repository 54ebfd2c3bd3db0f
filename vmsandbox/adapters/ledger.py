"""The state database: claims on host resources and the records of sandboxes and containers.

sqlite3 in WAL mode under the state directory. It is the write-ahead record of the
ResourceManager (``shim.host_resources``), which keeps the free state in memory; this module alone
knows how a ``vmsandbox.claims.Claim`` is stored:

* exclusive things, one row each in ``claims`` keyed by ``cpu:<id>`` or ``pci:<address>`` under a
  PRIMARY KEY, so a CPU or PCI function can be held by one sandbox only;
* counted amounts (schema 3), one row per (sandbox, resource, node) in ``amounts``: hugepages of
  one size (``hugepages-2048kB``, in pages) and ordinary guest memory (``memory``, in bytes), with
  the running sum per (resource, node) in ``totals``. A claim raises ``totals.held`` only while it
  stays within the limit the caller passes (the manager's budget), inside the same ``BEGIN
  IMMEDIATE`` transaction, so no amount is handed out twice either, even across processes.

A claim or a release is one small transaction: a few rows, never a rewrite of the host's state.
Records are JSON documents owned by the caller.

The schema is versioned with ``PRAGMA user_version``; ``MIGRATIONS[i]`` takes version i to i+1,
in one transaction with the version bump (sqlite's DDL is transactional), so a failing migration
leaves the file at the version it had. A file newer than this code is refused, never touched.

Version 2 adds ``meta``, which holds ``instance_id``: a random id minted once per state
database. The shim writes it into the metadata of every domain it defines, and reconciliation
touches only domains carrying its own id, so two shims (or test runs) sharing one libvirt never
tear down each other's guests. Version 3 replaces the one row per hugepage of versions 1-2
(``hugepages-2048kB:node0:17``) by counted amounts, migrating the rows in place.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from vmsandbox.claims import Claim
from vmsandbox.errors import AlreadyExists, InfrastructureError, NotFound

_CPU, _PCI = "cpu:", "pci:"
_MEMORY = "memory"
_PAGES_PREFIX, _PAGES_SUFFIX = "hugepages-", "kB"

#: the hugepage rows of schema 1-2 (``hugepages-<kib>kB:node<n>:<index>``) counted per sandbox and node
_V2_PAGE_COUNTS = """
    SELECT sandbox_id, resource, node, COUNT(*) AS amount FROM (
        SELECT sandbox_id,
               substr(key, 1, instr(key, ':node') - 1) AS resource,
               CAST(substr(key, instr(key, ':node') + 5,
                           instr(substr(key, instr(key, ':node') + 5), ':') - 1) AS INTEGER) AS node
        FROM claims WHERE key LIKE 'hugepages-%:node%:%')
    GROUP BY sandbox_id, resource, node"""

MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        """CREATE TABLE claims (
               key TEXT PRIMARY KEY,
               sandbox_id TEXT NOT NULL
           ) WITHOUT ROWID""",
        "CREATE INDEX claims_by_sandbox ON claims(sandbox_id)",
        """CREATE TABLE sandboxes (
               id TEXT PRIMARY KEY,
               state TEXT NOT NULL,
               created_ns INTEGER NOT NULL,
               record TEXT NOT NULL
           )""",
        """CREATE TABLE containers (
               id TEXT PRIMARY KEY,
               sandbox_id TEXT NOT NULL REFERENCES sandboxes(id) ON DELETE CASCADE,
               name TEXT NOT NULL,
               attempt INTEGER NOT NULL,
               state TEXT NOT NULL,
               created_ns INTEGER NOT NULL,
               record TEXT NOT NULL,
               UNIQUE (sandbox_id, name, attempt)
           )""",
    ),
    (
        "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID",
        "INSERT INTO meta(key, value) VALUES ('instance_id', lower(hex(randomblob(16))))",
    ),
    (
        """CREATE TABLE amounts (
               sandbox_id TEXT NOT NULL,
               resource TEXT NOT NULL,
               node INTEGER NOT NULL,
               amount INTEGER NOT NULL CHECK (amount > 0),
               PRIMARY KEY (sandbox_id, resource, node)
           ) WITHOUT ROWID""",
        """CREATE TABLE totals (
               resource TEXT NOT NULL,
               node INTEGER NOT NULL,
               held INTEGER NOT NULL CHECK (held >= 0),
               PRIMARY KEY (resource, node)
           ) WITHOUT ROWID""",
        "INSERT INTO amounts(sandbox_id, resource, node, amount) " + _V2_PAGE_COUNTS,
        "DELETE FROM claims WHERE key LIKE 'hugepages-%'",
        "INSERT INTO totals(resource, node, held) SELECT resource, node, SUM(amount) FROM amounts GROUP BY 1, 2",
    ),
)
SCHEMA_VERSION = len(MIGRATIONS)
CHECKPOINT_S = 0.5


class ClaimConflict(Exception):
    """Some of a claim is held already (or beyond its limit); nothing of the claim was written."""

    def __init__(self, what: list[str]) -> None:
        super().__init__(f"already held: {', '.join(what[:5])}")
        self.what = what


class _Beyond(Exception):
    """Inside a claim's transaction: an amount would go beyond its limit (rolls the claim back)."""


def _page_resource(size: int) -> str:
    return f"{_PAGES_PREFIX}{size // 1024}{_PAGES_SUFFIX}"


def _amount_rows(claim: Claim) -> list[tuple[str, int, int]]:
    """(resource, node, amount) rows of a claim's counted amounts."""
    rows = [(_page_resource(size), node, count) for node, size, count in claim.pages]
    rows += [(_MEMORY, node, amount) for node, amount in claim.memory]
    return rows


class _Parts:
    """A claim being read back from rows."""

    def __init__(self) -> None:
        self.cpus: list[int] = []
        self.pci: list[str] = []
        self.pages: list[tuple[int, int, int]] = []
        self.memory: list[tuple[int, int]] = []

    def add_key(self, key: str) -> None:
        if key.startswith(_CPU) and key[len(_CPU) :].isdigit():
            self.cpus.append(int(key[len(_CPU) :]))
        elif key.startswith(_PCI):
            self.pci.append(key[len(_PCI) :])

    def add_amount(self, resource: str, node: int, amount: int) -> None:
        if resource == _MEMORY:
            self.memory.append((node, amount))
        elif resource.startswith(_PAGES_PREFIX) and resource.endswith(_PAGES_SUFFIX):
            kib = resource[len(_PAGES_PREFIX) : -len(_PAGES_SUFFIX)]
            if kib.isdigit():
                self.pages.append((node, int(kib) * 1024, amount))

    def claim(self) -> Claim:
        return Claim.of(sorted(self.cpus), sorted(self.pci), self.pages, self.memory)


def read_claims(db: sqlite3.Connection, sandbox_id: str | None = None) -> dict[str, Claim]:
    """Every sandbox's claim (or one sandbox's) on an open connection, read-only; schema 1-2 files
    (one row per page) are read too, so the admin tools work beside a shim not yet upgraded."""
    version = int(db.execute("PRAGMA user_version").fetchone()[0])
    where, args = ("WHERE sandbox_id = ?", (sandbox_id,)) if sandbox_id is not None else ("", ())
    parts: dict[str, _Parts] = {}
    if version >= 3:
        keys = db.execute(f"SELECT sandbox_id, key FROM claims {where}", args).fetchall()
        amounts = db.execute(f"SELECT sandbox_id, resource, node, amount FROM amounts {where}", args).fetchall()
    else:
        keys = db.execute(
            f"SELECT sandbox_id, key FROM claims {where} {'AND' if where else 'WHERE'} key NOT LIKE 'hugepages-%'",
            args,
        ).fetchall()
        amounts = db.execute(f"SELECT * FROM ({_V2_PAGE_COUNTS}) {where}", args).fetchall()
    for owner, key in keys:
        parts.setdefault(owner, _Parts()).add_key(key)
    for owner, resource, node, amount in amounts:
        parts.setdefault(owner, _Parts()).add_amount(resource, int(node), int(amount))
    return {owner: p.claim() for owner, p in sorted(parts.items())}


class Ledger:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.RLock()
        try:
            self._db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False, timeout=30)
            self._db.execute("PRAGMA journal_mode=WAL")
            # WAL + NORMAL: a commit survives the shim's own crash (kill -9 included); only a power loss
            # can drop the last commits, and then every guest is gone too, which reconcile handles
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA foreign_keys=ON")
            # checkpoints (copying the WAL back into the file, with an fsync) run on a thread of their own,
            # not inside whichever commit crosses sqlite's 1000-page mark: a claim stays a small write
            self._db.execute("PRAGMA wal_autocheckpoint=0")
        except sqlite3.Error as exc:
            raise InfrastructureError(f"state database {self.path}: {exc}") from exc
        try:
            self._migrate()
        except BaseException as exc:
            self._db.close()  # a refused (or failed) migration must not leave the file open
            if isinstance(exc, sqlite3.Error):
                raise InfrastructureError(f"state database {self.path}: {exc}") from exc
            raise
        self._stop = threading.Event()
        self._checkpointer = threading.Thread(target=self._checkpoints, name="ledger-checkpoint", daemon=True)
        self._checkpointer.start()

    def _checkpoints(self) -> None:
        """Every CHECKPOINT_S, a PASSIVE checkpoint on a connection of its own (it never blocks a writer)."""
        try:
            db = sqlite3.connect(str(self.path), isolation_level=None, timeout=30)
        except sqlite3.Error:
            return
        try:
            while not self._stop.wait(CHECKPOINT_S):
                try:
                    db.execute("PRAGMA wal_checkpoint(PASSIVE)")
                except sqlite3.Error:
                    continue  # busy or gone: the next round (or the last connection's close) does it
        finally:
            db.close()

    def close(self) -> None:
        self._stop.set()
        self._checkpointer.join(timeout=5)
        with self._lock:
            self._db.close()

    @property
    def schema_version(self) -> int:
        return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    def _migrate(self) -> None:
        with self._lock:
            version = self.schema_version
            if version > SCHEMA_VERSION:
                raise InfrastructureError(
                    f"state database {self.path} has schema {version}, newer than this vmsandbox "
                    f"({SCHEMA_VERSION}); refusing to touch it"
                )
            for target in range(version, SCHEMA_VERSION):
                with self._tx():
                    if self.schema_version > target:  # another process migrated it meanwhile
                        continue
                    for stmt in MIGRATIONS[target]:
                        self._db.execute(stmt)
                    self._db.execute(f"PRAGMA user_version = {target + 1}")

    @property
    def instance_id(self) -> str:
        """This state database's random id, stamped on the domains it owns (schema 2)."""
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE key = 'instance_id'").fetchone()
        if row is None:
            raise InfrastructureError(f"state database {self.path} has no instance_id")
        return str(row[0])

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            else:
                self._db.execute("COMMIT")

    # -- claims ---------------------------------------------------------------------------------
    def claim(
        self,
        sandbox_id: str,
        claim: Claim,
        *,
        page_limits: Mapping[tuple[int, int], int],
        memory_limits: Mapping[int, int],
    ) -> None:
        """Hold all of ``claim`` for ``sandbox_id`` in one transaction, or none of it: ClaimConflict
        when a CPU or PCI function is held already, or an amount would take its (node, page size)
        or node beyond ``page_limits`` / ``memory_limits`` (a missing limit is zero)."""
        keys = [(f"{_CPU}{c}", sandbox_id) for c in claim.cpus] + [(f"{_PCI}{a}", sandbox_id) for a in claim.pci]
        # (resource, node, amount, limit) per counted amount
        counted = [(_page_resource(s), n, c, page_limits.get((n, s), 0)) for n, s, c in claim.pages]
        counted += [(_MEMORY, n, b, memory_limits.get(n, 0)) for n, b in claim.memory]
        if all(amount <= limit for _, _, amount, limit in counted):
            try:
                with self._tx() as db:
                    if keys:
                        db.executemany("INSERT INTO claims(key, sandbox_id) VALUES (?, ?)", keys)
                    if counted:
                        # raise each running total only while it stays within its limit: a row left
                        # as it was (the count falls short) means an amount would go beyond it
                        raised = db.executemany(
                            "INSERT INTO totals(resource, node, held) VALUES (?, ?, ?) "
                            "ON CONFLICT(resource, node) DO UPDATE SET held = held + excluded.held "
                            "WHERE held + excluded.held <= ?",
                            counted,
                        ).rowcount
                        if raised != len(counted):
                            raise _Beyond
                        db.executemany(
                            "INSERT INTO amounts(sandbox_id, resource, node, amount) VALUES (?, ?, ?, ?) "
                            "ON CONFLICT(sandbox_id, resource, node) DO UPDATE SET amount = amount + excluded.amount",
                            [(sandbox_id, r, n, a) for r, n, a, _ in counted],
                        )
                return
            except sqlite3.IntegrityError:
                wanted = [k for k, _ in keys]
                with self._lock:
                    marks = ",".join("?" * len(wanted))
                    held = {r[0] for r in self._db.execute(f"SELECT key FROM claims WHERE key IN ({marks})", wanted)}
                raise ClaimConflict([k for k in wanted if k in held]) from None
            except _Beyond:
                pass
        with self._lock:
            totals = {(r, n): int(h) for r, n, h in self._db.execute("SELECT resource, node, held FROM totals")}
        raise ClaimConflict(
            [
                f"{r} on node {n}: {a} more would exceed {lim} ({totals.get((r, n), 0)} held)"
                for r, n, a, lim in counted
                if totals.get((r, n), 0) + a > lim
            ]
        )

    @staticmethod
    def _release(db: sqlite3.Connection, sandbox_id: str) -> int:
        rows = db.execute(
            "DELETE FROM amounts WHERE sandbox_id = ? RETURNING resource, node, amount", (sandbox_id,)
        ).fetchall()
        if rows:
            db.executemany(
                "UPDATE totals SET held = held - ? WHERE resource = ? AND node = ?", [(a, r, n) for r, n, a in rows]
            )
        return int(db.execute("DELETE FROM claims WHERE sandbox_id = ?", (sandbox_id,)).rowcount) + len(rows)

    def release(self, sandbox_id: str) -> int:
        """Drop everything ``sandbox_id`` holds; the number of rows (CPUs, PCI functions, amounts) freed."""
        with self._tx() as db:
            return self._release(db, sandbox_id)

    def held(self) -> dict[str, Claim]:
        """What every sandbox holds, by sandbox id."""
        with self._lock:
            return read_claims(self._db)

    def claims_of(self, sandbox_id: str) -> Claim:
        with self._lock:
            return read_claims(self._db, sandbox_id).get(sandbox_id, Claim())

    def claim_owners(self) -> frozenset[str]:
        with self._lock:
            rows = self._db.execute("SELECT sandbox_id FROM claims UNION SELECT sandbox_id FROM amounts")
            return frozenset(r[0] for r in rows)

    # -- sandboxes ------------------------------------------------------------------------------
    def put_sandbox(self, sandbox_id: str, state: str, created_ns: int, record: dict[str, Any]) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT INTO sandboxes(id, state, created_ns, record) VALUES (?, ?, ?, ?) "
                "ON CONFLICT(id) DO UPDATE SET state = excluded.state, record = excluded.record",
                (sandbox_id, state, created_ns, json.dumps(record, sort_keys=True)),
            )

    def get_sandbox(self, sandbox_id: str) -> tuple[str, int, dict[str, Any]] | None:
        with self._lock:
            row = self._db.execute(
                "SELECT state, created_ns, record FROM sandboxes WHERE id = ?", (sandbox_id,)
            ).fetchone()
        return (row[0], row[1], json.loads(row[2])) if row else None

    def sandboxes(self) -> list[tuple[str, str, int, dict[str, Any]]]:
        with self._lock:
            rows = self._db.execute(
                "SELECT id, state, created_ns, record FROM sandboxes ORDER BY created_ns"
            ).fetchall()
        return [(r[0], r[1], r[2], json.loads(r[3])) for r in rows]

    def delete_sandbox(self, sandbox_id: str) -> None:
        """Forget the sandbox, its containers and its claims, in one transaction."""
        with self._tx() as db:
            self._release(db, sandbox_id)
            db.execute("DELETE FROM containers WHERE sandbox_id = ?", (sandbox_id,))
            db.execute("DELETE FROM sandboxes WHERE id = ?", (sandbox_id,))

    # -- containers -----------------------------------------------------------------------------
    def put_container(
        self,
        container_id: str,
        sandbox_id: str,
        name: str,
        attempt: int,
        state: str,
        created_ns: int,
        record: dict[str, Any],
    ) -> None:
        try:
            with self._tx() as db:
                db.execute(
                    "INSERT INTO containers(id, sandbox_id, name, attempt, state, created_ns, record) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?) "
                    "ON CONFLICT(id) DO UPDATE SET state = excluded.state, record = excluded.record",
                    (container_id, sandbox_id, name, attempt, state, created_ns, json.dumps(record, sort_keys=True)),
                )
        except sqlite3.IntegrityError as exc:
            if "UNIQUE" in str(exc):
                raise AlreadyExists(
                    f'container "{name}" (attempt {attempt}) already exists in sandbox {sandbox_id}'
                ) from None
            raise NotFound(f"sandbox {sandbox_id} is not in the state database") from None

    def containers(self, sandbox_id: str | None = None) -> list[tuple[str, str, str, int, dict[str, Any]]]:
        """(id, sandbox id, state, created_ns, record) rows, oldest first."""
        query = "SELECT id, sandbox_id, state, created_ns, record FROM containers"
        args: tuple[str, ...] = ()
        if sandbox_id is not None:
            query += " WHERE sandbox_id = ?"
            args = (sandbox_id,)
        with self._lock:
            rows = self._db.execute(query + " ORDER BY created_ns", args).fetchall()
        return [(r[0], r[1], r[2], r[3], json.loads(r[4])) for r in rows]

    def delete_container(self, container_id: str) -> bool:
        with self._tx() as db:
            return db.execute("DELETE FROM containers WHERE id = ?", (container_id,)).rowcount > 0
