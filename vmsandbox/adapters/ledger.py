"""The state database: claims on host resources and the records of sandboxes and containers.

sqlite3 in WAL mode under the state directory. A claim is a row keyed by its resource key
(``cpu:3``, ``hugepages-2048kB:node0:17``) with a PRIMARY KEY constraint, so a resource can be
held by one sandbox only: double-booking is impossible, not merely unlikely, even across
processes and crashes. Records are JSON documents owned by the caller.

The schema is versioned with ``PRAGMA user_version``; ``MIGRATIONS[i]`` takes version i to i+1,
in one transaction with the version bump (sqlite's DDL is transactional), so a failing migration
leaves the file at the version it had. A file newer than this code is refused, never touched.

Version 2 adds ``meta``, which holds ``instance_id``: a random id minted once per state
database. The shim writes it into the metadata of every domain it defines, and reconciliation
touches only domains carrying its own id, so two shims (or test runs) sharing one libvirt never
tear down each other's guests.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from vmsandbox.errors import AlreadyExists, InfrastructureError, NotFound

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
)
SCHEMA_VERSION = len(MIGRATIONS)


class ClaimConflict(Exception):
    """Some key of a claim is held already; nothing of the claim was written."""

    def __init__(self, keys: list[str]) -> None:
        super().__init__(f"already held: {', '.join(keys[:5])}")
        self.keys = keys


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
        except sqlite3.Error as exc:
            raise InfrastructureError(f"state database {self.path}: {exc}") from exc
        try:
            self._migrate()
        except BaseException as exc:
            self._db.close()  # a refused (or failed) migration must not leave the file open
            if isinstance(exc, sqlite3.Error):
                raise InfrastructureError(f"state database {self.path}: {exc}") from exc
            raise

    def close(self) -> None:
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
    def claim(self, sandbox_id: str, keys: Iterable[str]) -> None:
        """Hold every key for ``sandbox_id`` in one transaction, or none of them."""
        wanted = list(keys)
        try:
            with self._tx() as db:
                db.executemany("INSERT INTO claims(key, sandbox_id) VALUES (?, ?)", [(k, sandbox_id) for k in wanted])
        except sqlite3.IntegrityError:
            held = self.taken()
            raise ClaimConflict([k for k in wanted if k in held]) from None

    def release(self, sandbox_id: str) -> int:
        with self._tx() as db:
            return db.execute("DELETE FROM claims WHERE sandbox_id = ?", (sandbox_id,)).rowcount

    def taken(self) -> frozenset[str]:
        with self._lock:
            return frozenset(r[0] for r in self._db.execute("SELECT key FROM claims"))

    def claims_of(self, sandbox_id: str) -> tuple[str, ...]:
        with self._lock:
            rows = self._db.execute("SELECT key FROM claims WHERE sandbox_id = ? ORDER BY key", (sandbox_id,))
            return tuple(r[0] for r in rows)

    def claim_owners(self) -> frozenset[str]:
        with self._lock:
            return frozenset(r[0] for r in self._db.execute("SELECT DISTINCT sandbox_id FROM claims"))

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
            db.execute("DELETE FROM claims WHERE sandbox_id = ?", (sandbox_id,))
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
