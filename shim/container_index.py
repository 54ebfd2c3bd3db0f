"""``ContainerIndex``: the container records of the ledger, decoded once and kept in memory.

``Records`` (``shim.records``) owns the container rows; every write it makes to the ledger is mirrored here after
the ledger accepted it, so the index answers lookups (an id, a unique id prefix, a sandbox's
containers, every container in creation order) without reading or decoding a row. It is built from
the ledger at start-up. Records are frozen dataclasses, shared as they are.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from shim.model import ContainerRecord
from vmsandbox import validation

_ID_LENGTH = 64


class ContainerIndex:
    def __init__(self, records: Iterable[ContainerRecord] = ()) -> None:
        self._lock = threading.Lock()
        self._by_id: dict[str, ContainerRecord] = {c.id: c for c in records}

    def put(self, c: ContainerRecord) -> None:
        with self._lock:
            self._by_id[c.id] = c

    def drop(self, container_id: str) -> None:
        with self._lock:
            self._by_id.pop(container_id, None)

    def drop_sandbox(self, sandbox_id: str) -> None:
        with self._lock:
            for cid in [cid for cid, c in self._by_id.items() if c.sandbox_id == sandbox_id]:
                del self._by_id[cid]

    def all(self, sandbox_id: str | None = None) -> list[ContainerRecord]:
        """The containers (of one sandbox), oldest first, as the ledger lists them."""
        with self._lock:
            found = [c for c in self._by_id.values() if sandbox_id is None or c.sandbox_id == sandbox_id]
        return sorted(found, key=lambda c: (c.created_ns, c.id))

    def ids_with_prefix(self, prefix: str) -> list[str]:
        """Every container id starting with ``prefix`` (an exact id: at most itself)."""
        with self._lock:
            if len(prefix) == _ID_LENGTH:
                return [prefix] if prefix in self._by_id else []
            return [cid for cid in self._by_id if cid.startswith(prefix)]

    def get(self, container_id: str) -> ContainerRecord | None:
        """The record of a full id, or None."""
        with self._lock:
            return self._by_id.get(container_id)

    def resolve(self, prefix: str) -> ContainerRecord:
        """The container an id or unique id prefix names: NOT_FOUND for none, INVALID_ARGUMENT for
        several (``validation.resolve_prefix``)."""
        with self._lock:
            exact = self._by_id.get(prefix) if len(prefix) == _ID_LENGTH else None
            if exact is not None:
                return exact
            ids = list(self._by_id)
        found = validation.resolve_prefix(prefix, ids, "container")
        with self._lock:
            record = self._by_id.get(found)
        if record is None:  # removed between the two looks
            return self.resolve(prefix)
        return record
