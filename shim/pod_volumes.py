"""``PodVolumes``: the guest copies of each pod's atomic-writer volumes (ConfigMap, Secret,
projected, downward API: ``vmsandbox.kubelet_volumes``).

It owns which host volume each sandbox's guest has a copy of, which containers use each copy and
which version the guest holds. ``attach`` puts a volume into the guest at CreateContainer (and
returns where the container's spec mounts it from); ``refresh``, run every ``REFRESH_S`` by its
own thread, brings a copy up to date when the kubelet writes a new version (a ConfigMap update,
a token rotation), as the kubelet's own sync would reach a runc container; ``release`` removes a
copy from the guest when its last container goes.

Noticing a new version is one ``readlink`` of the host's ``..data`` per copy; sending it is done
by one thread per sandbox (never two for one sandbox), so a guest that answers slowly delays only
its own copies.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from shim.periodic import Periodic
from vmsandbox.adapters import volume_reader
from vmsandbox.errors import VmSandboxError
from vmsandbox.kubelet_volumes import commit_args, guest_path, shifted, volume_id, write_batches
from vmsandbox.userns import UserNamespace

log = logging.getLogger(__name__)

REFRESH_S = 2.0
"""How often each copy's host version is compared with the guest's (the kubelet itself writes a
new version only at its pod sync, every minute or so)."""
_GUEST_TIMEOUT_S = 30.0


@dataclass
class _Copy:
    vid: str
    userns: UserNamespace | None = None  # the pod's own user namespace: owners are stored shifted through it
    version: str = ""  # the version the guest holds; "" not known (adopted after a restart)
    users: set[str] = field(default_factory=set)  # container ids
    lock: threading.Lock = field(default_factory=threading.Lock)  # one sync at a time


AgentCall = Callable[..., object]
"""``AgentPool.call``: (sandbox id, agent op, args...) with the agent connection's retries."""


class PodVolumes:
    def __init__(self, call: AgentCall) -> None:
        self._call = call
        self._lock = threading.Lock()
        self._copies: dict[str, dict[str, _Copy]] = {}  # sandbox id -> host path -> copy
        self._busy: set[str] = set()  # sandboxes whose refresh thread runs
        self._periodic = Periodic(REFRESH_S, self.refresh, name="volume-refresh")

    def start(self) -> None:
        self._periodic.start()

    def close(self) -> None:
        self._periodic.stop()

    def attach(self, sandbox_id: str, container_id: str, host_path: str, userns: UserNamespace | None = None) -> str:
        """Puts the volume at ``host_path`` (symlinks resolved) into the sandbox's guest unless it
        has it, for ``container_id``; returns the guest directory the container mounts. On failure
        nothing is left: the container is not a user, a copy made for it alone is removed. With the
        pod's own user namespace (``userns``), the copy's owners are stored shifted through its
        mappings, so that the container sees the kubelet's (``kubelet_volumes.shifted``)."""
        with self._lock:
            copies = self._copies.setdefault(sandbox_id, {})
            copy = copies.get(host_path)
            if copy is None:
                copy = copies[host_path] = _Copy(volume_id(host_path), userns)
            copy.users.add(container_id)
        try:
            self._sync(sandbox_id, host_path, copy)
        except BaseException:
            self.release(sandbox_id, container_id, only=host_path)
            raise
        return guest_path(copy.vid)

    def used_by(self, sandbox_id: str, container_id: str) -> tuple[str, ...]:
        """The host paths of the copies ``container_id`` uses (what its record keeps)."""
        with self._lock:
            return tuple(sorted(p for p, c in self._copies.get(sandbox_id, {}).items() if container_id in c.users))

    def users(self, sandbox_id: str) -> dict[str, frozenset[str]]:
        """Host path -> the containers using its copy in the sandbox's guest."""
        with self._lock:
            return {p: frozenset(c.users) for p, c in self._copies.get(sandbox_id, {}).items()}

    def adopt(
        self, sandbox_id: str, container_id: str, host_paths: tuple[str, ...], userns: UserNamespace | None = None
    ) -> None:
        """At start-up: a container of a running guest uses these copies, as its record says; the
        next refresh asks the guest which version it holds and sends only a newer one."""
        with self._lock:
            copies = self._copies.setdefault(sandbox_id, {})
            for path in host_paths:
                copies.setdefault(path, _Copy(volume_id(path), userns)).users.add(container_id)

    def release(self, sandbox_id: str, container_id: str, only: str = "") -> None:
        """``container_id`` no longer uses its copies (or the one of host path ``only``); a copy
        nobody uses is removed from the guest (if the guest does not answer, it goes with the guest)."""
        unused = []
        with self._lock:
            copies = self._copies.get(sandbox_id, {})
            for path, copy in list(copies.items()):
                if only and path != only:
                    continue
                copy.users.discard(container_id)
                if not copy.users:
                    del copies[path]
                    unused.append(copy)
            if not copies:
                self._copies.pop(sandbox_id, None)
        for copy in unused:
            try:
                with copy.lock:
                    self._call(sandbox_id, "volume_remove", copy.vid)
            except VmSandboxError as exc:
                log.warning("sandbox %s: the copy of a volume stays in its guest: %s", sandbox_id[:12], exc)

    def forget_sandbox(self, sandbox_id: str) -> None:
        """The sandbox's guest is gone: its copies with it."""
        with self._lock:
            self._copies.pop(sandbox_id, None)

    def _sync(self, sandbox_id: str, host_path: str, copy: _Copy) -> None:
        """Brings the guest's copy to the host's version (nothing to do when it has it)."""
        with copy.lock:
            if copy.version and volume_reader.read_version(host_path) == copy.version:
                return
            tree = shifted(volume_reader.read_tree(host_path), copy.userns)
            if copy.version == tree.version:
                return
            has = self._call(sandbox_id, "volume_begin", copy.vid, tree.version, timeout_s=_GUEST_TIMEOUT_S)
            if not has:
                for batch in write_batches(copy.vid, tree):
                    self._call(sandbox_id, "volume_write", batch, timeout_s=_GUEST_TIMEOUT_S)
                self._call(sandbox_id, "volume_commit", commit_args(copy.vid, tree), timeout_s=_GUEST_TIMEOUT_S)
                log.info(
                    "sandbox %s: volume %s version %s in the guest (%d entries, %d bytes)",
                    sandbox_id[:12],
                    host_path,
                    tree.version,
                    len(tree.entries),
                    tree.size,
                )
            copy.version = tree.version

    def refresh(self) -> None:
        """Starts a sync for every sandbox with a copy older than its host volume (one thread per
        sandbox, none while the last one for that sandbox runs)."""
        with self._lock:
            todo = {sid: list(copies.items()) for sid, copies in self._copies.items() if sid not in self._busy}
        for sandbox_id, items in todo.items():
            stale = []
            for path, copy in items:
                try:
                    if volume_reader.read_version(path) != copy.version:
                        stale.append((path, copy))
                except VmSandboxError:
                    continue  # the pod's volume is being torn down: its containers go next
            if not stale:
                continue
            with self._lock:
                if sandbox_id in self._busy:
                    continue
                self._busy.add(sandbox_id)
            name = f"volume-sync-{sandbox_id[:12]}"
            threading.Thread(target=self._refresh_sandbox, args=(sandbox_id, stale), name=name, daemon=True).start()

    def _refresh_sandbox(self, sandbox_id: str, stale: list[tuple[str, _Copy]]) -> None:
        try:
            for path, copy in stale:
                with self._lock:
                    if self._copies.get(sandbox_id, {}).get(path) is not copy:
                        continue  # released meanwhile
                try:
                    self._sync(sandbox_id, path, copy)
                except VmSandboxError as exc:
                    log.warning("sandbox %s: volume %s not brought up to date: %s", sandbox_id[:12], path, exc)
        finally:
            with contextlib.suppress(KeyError), self._lock:
                self._busy.remove(sandbox_id)
