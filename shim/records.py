"""``Records``: the record store, the one owner of the pods' records and their rows in the ledger.

Each kind of state has a lock of its own, as containerd's CRI plugin keeps one store per kind:
- sandbox records (``SandboxRecord``), creating ones too: decoded once from the ledger's rows at
  start-up and written through to it on every change (ledger first, then memory), so a lookup
  never reads or decodes a row; the map changes by one assignment at a time and is read from
  copies;
- container records, in ``shim.container_index`` (which locks its map), written under one lock
  of their own so that two writers of different fields never put back each other's old values;
- the pod-name registry: pod metadata -> the sandbox holding it, from RunPodSandbox until
  RemovePodSandbox (as containerd keeps it), under its own lock;
- the generation, bumped after each change, so that an answer made from the records at
  generation G stays true while it is still G (the CRI front keeps lists by it), and the watchers
  that hear it, under their own lock.

``SandboxLocks`` keeps what RPCs are working on: the lock under which each sandbox's record is
read, checked and changed, and the ids of the sandboxes (and snapshots) being made, which the
periodic reconcile leaves alone.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from shim import logs
from shim.container_index import ContainerIndex
from shim.model import CONTAINER_EXITED, ContainerRecord, PodMeta, SandboxRecord
from vmsandbox import validation
from vmsandbox.adapters.ledger import Ledger
from vmsandbox.errors import AlreadyExists, NotFound, VmSandboxError
from vmsandbox.lifecycle import STATE_CREATING

log = logging.getLogger(__name__)


def new_id() -> str:
    """A new sandbox or container id (64 hex digits)."""
    return secrets.token_hex(32)


class SandboxLocks:
    """What RPCs are working on: one lock per sandbox, held while its record is read, checked and
    changed, and the ids whose RunPodSandbox (or snapshot) is being made."""

    def __init__(self) -> None:
        self._sandbox_locks: dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()
        self.in_flight: set[str] = set()  # sandboxes whose RunPodSandbox is running (periodic reconcile skips them)

    @contextmanager
    def running(self, sandbox_id: str) -> Iterator[None]:
        """``sandbox_id`` is being made while the ``with`` block runs (its RunPodSandbox, its
        rollback included): the periodic reconcile leaves it alone."""
        self.in_flight.add(sandbox_id)
        try:
            yield
        finally:
            self.in_flight.discard(sandbox_id)

    def lock_for(self, sandbox_id: str) -> threading.Lock:
        with self._locks_lock:
            return self._sandbox_locks.setdefault(sandbox_id, threading.Lock())

    def forget(self, sandbox_id: str) -> None:
        """A removed sandbox's lock goes with it."""
        with self._locks_lock:
            self._sandbox_locks.pop(sandbox_id, None)


class Records:
    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        # pod metadata -> the sandbox holding it, from RunPodSandbox until RemovePodSandbox (as containerd does)
        self._names_lock = threading.Lock()
        self._container_write_lock = threading.Lock()
        # every container record, decoded once; the ledger is its write-ahead record
        self._index = ContainerIndex(ContainerRecord.from_doc(doc) for *_, doc in self.ledger.containers())
        # every sandbox record, decoded once (creating ones too); the ledger is its write-ahead record
        self._records: dict[str, SandboxRecord] = self._load_records()
        # counts changes to the records above: bumped after each, so that an answer made from the
        # records at generation G stays true while it is still G (the CRI front keeps lists by it)
        self._generation = 1
        self._generation_lock = threading.Lock()
        self._generation_watchers: list[Callable[[int], None]] = []
        self._names: dict[PodMeta, str] = {r.meta: sid for sid, r in self._records.items()}

    # -- sandboxes ------------------------------------------------------------------------------
    def _sandbox_id(self, given: str) -> str:
        """The full id that a client's id or unique id prefix names (containerd's rule): INVALID_ARGUMENT
        when it is no id at all or an ambiguous prefix, NOT_FOUND when a prefix matches nothing."""
        validation.id_prefix(given, "pod_sandbox_id")
        if validation.is_id(given):
            return given
        known = [sid for sid, r in list(self._records.items()) if r.state != STATE_CREATING]
        return validation.resolve_prefix(given, known, "pod sandbox")

    def get(self, sandbox_id: str) -> SandboxRecord:
        sandbox_id = self._sandbox_id(sandbox_id)
        record = self._records.get(sandbox_id)
        if record is None or record.state == STATE_CREATING:
            raise NotFound(f"pod sandbox {sandbox_id!r} not found")
        logs.bind(sandbox_id=record.id, pod=f"{record.meta.namespace}/{record.meta.name}")
        return record

    def find(self, sandbox_id: str) -> SandboxRecord | None:
        try:
            return self.get(sandbox_id)
        except NotFound:
            return None

    def ids_with_prefix(self, prefix: str) -> list[str]:
        """Every sandbox id starting with ``prefix``, sandboxes still being created included (an id
        the caller may not know yet is still ours)."""
        if validation.is_id(prefix):
            return [prefix] if self.ledger.get_sandbox(prefix) is not None else []
        return [sid for sid, *_ in self.ledger.sandboxes() if sid.startswith(prefix)]

    def list_sandboxes(self) -> list[SandboxRecord]:
        return sorted(
            (r for r in list(self._records.values()) if r.state != STATE_CREATING), key=lambda r: (r.created_ns, r.id)
        )

    def every_sandbox(self) -> list[SandboxRecord]:
        """Every sandbox record, creating ones too."""
        return list(self._records.values())

    def put_sandbox(self, record: SandboxRecord) -> None:
        self.ledger.put_sandbox(record.id, record.state, record.created_ns, record.to_doc())
        self._records[record.id] = record  # after the ledger took it
        self._changed()

    def delete_sandbox(self, sandbox_id: str) -> None:
        """Forget a sandbox, its containers and its claims in the ledger, and its containers here."""
        self.ledger.delete_sandbox(sandbox_id)
        self._records.pop(sandbox_id, None)
        self._index.drop_sandbox(sandbox_id)
        self._changed()

    def reload(self) -> None:
        """Decode the ledger's sandbox rows again (start-up: rows an earlier process wrote)."""
        self._records = self._load_records()
        self._changed()

    def _load_records(self) -> dict[str, SandboxRecord]:
        """The ledger's sandbox rows, decoded; a row that does not decode is left to reconcile (which
        tears down what it names) and logged."""
        records: dict[str, SandboxRecord] = {}
        for sid, state, _, doc in self.ledger.sandboxes():
            try:
                records[sid] = replace(SandboxRecord.from_doc(doc), state=state)
            except (KeyError, TypeError, ValueError, VmSandboxError) as exc:
                log.error("sandbox %s: its record does not decode (%s); reconcile will tear it down", sid[:12], exc)
        return records

    # -- pod names ------------------------------------------------------------------------------
    def reserve_name(self, meta: PodMeta, sandbox_id: str) -> None:
        with self._names_lock:
            holder = self._names.setdefault(meta, sandbox_id)
        if holder != sandbox_id:
            raise AlreadyExists(
                f"pod {meta.namespace}/{meta.name} (uid {meta.uid}, attempt {meta.attempt}) already has sandbox "
                f"{holder}; remove it first or use a new attempt"
            )

    def release_name(self, meta: PodMeta, sandbox_id: str) -> None:
        with self._names_lock:
            if self._names.get(meta) == sandbox_id:
                del self._names[meta]

    def keep_names(self, keep: Callable[[str], bool]) -> None:
        """Drop the names of the sandboxes ``keep`` (asked under the registry's lock) turns away."""
        with self._names_lock:
            self._names = {m: sid for m, sid in self._names.items() if keep(sid)}

    def names_from_records(self) -> None:
        """Name again exactly the sandboxes recorded (start-up, after ``reload``)."""
        with self._names_lock:
            self._names = {r.meta: sid for sid, r in self._records.items()}

    # -- containers -----------------------------------------------------------------------------
    def containers(self, sandbox_id: str | None = None) -> list[ContainerRecord]:
        """The containers (of one sandbox), oldest first, from the in-memory index."""
        return self._index.all(sandbox_id)

    def container(self, container_id: str) -> ContainerRecord:
        """The container a client's id or unique id prefix names (as ``_sandbox_id``)."""
        validation.id_prefix(container_id, "container_id")
        return self._index.resolve(container_id)

    def resolve_container(self, container_id: str) -> ContainerRecord:
        """The container an id or unique id prefix names, checked already (``shim.translate``):
        NOT_FOUND for none, INVALID_ARGUMENT for an ambiguous prefix."""
        return self._index.resolve(container_id)

    def find_container(self, container_id: str) -> ContainerRecord | None:
        """As ``resolve_container``, None when it names none (stopping or removing it succeeds)."""
        try:
            return self._index.resolve(container_id)
        except NotFound:
            return None

    def container_ids_with_prefix(self, prefix: str) -> list[str]:
        return self._index.ids_with_prefix(prefix)

    def save_container(self, c: ContainerRecord) -> None:
        """Records a container's new state (shim.containers runs it in the guest)."""
        with self._container_write_lock:
            self.put_container(c)

    def change_container(self, container_id: str, expect_state: str = "", **changes: Any) -> ContainerRecord | None:
        """Changes some fields of a container's record as it stands now (read and written under one
        lock), so that two writers of different fields (a start's state, an update's limits) never
        put back each other's old values; with ``expect_state``, only while the container is in that
        state. Returns the record written, or None when there was none to change."""
        with self._container_write_lock:
            current = self._index.get(container_id)
            if current is None or (expect_state and current.state != expect_state):
                return None
            changed = replace(current, **changes)
            self.put_container(changed)
            return changed

    def exit_containers(self, sandbox_id: str, **changes: Any) -> None:
        """Record every container of the sandbox not yet EXITED as EXITED with ``changes``, each as
        it stands at the write (under the lock ``change_container`` takes), so that an exit the
        owner of containers records meanwhile, with its code and times, is kept."""
        with self._container_write_lock:
            for c in self._index.all(sandbox_id):
                if c.state != CONTAINER_EXITED:
                    self.put_container(replace(c, state=CONTAINER_EXITED, **changes))

    def put_container(self, c: ContainerRecord) -> None:
        """Write a container's record as it is given, without the writers' lock (a new record, or
        the callers above, which hold it)."""
        self.ledger.put_container(c.id, c.sandbox_id, c.name, c.attempt, c.state, c.created_ns, c.to_doc())
        self._index.put(c)  # after the ledger took it: a refused write (a duplicate name) changes nothing
        self._changed()

    def remove_container(self, container_id: str) -> None:
        """Forget the container of full id ``container_id``; one forgotten already is fine."""
        if self._index.get(container_id) is None:
            return
        self.ledger.delete_container(container_id)
        self._index.drop(container_id)
        self._changed()

    # -- the generation -------------------------------------------------------------------------
    @property
    def generation(self) -> int:
        """The records' generation: read it before reading them."""
        with self._generation_lock:
            return self._generation

    def watch_generation(self, watcher: Callable[[int], None]) -> None:
        """``watcher`` hears each new generation (from the thread that made the change; it must not block)."""
        with self._generation_lock:
            self._generation_watchers.append(watcher)

    def _changed(self) -> None:
        with self._generation_lock:
            self._generation += 1
            generation, watchers = self._generation, list(self._generation_watchers)
        for watcher in watchers:
            watcher(generation)
