"""``MountFollower``: the host's mounts below the source of a ``HostToContainer`` or
``Bidirectional`` volume, made after its container's bind, reach the pod's QEMU idmapped.

A volume's bind in QEMU's mount namespace is idmapped (``vmsandbox.adapters.binds``): host root's
files are QEMU's uid's. A mount the kernel propagated into that namespace would arrive without
the mapping (a mount's idmapping can be set only while it is detached), so QEMU's uid could not
enter it where it is root's and 0700. So such a volume is bound private, and this owner copies
each later host mount below its source itself: it waits on ``/proc/self/mountinfo`` (``poll``:
the kernel marks it whenever the mount table changes), and for each new mount below a watched
source attaches an idmapped, private, nosuid and nodev copy of that mount alone at the same place
inside the bind, read-only when the volume is;
a mount the host takes away is detached there again. Before an exec into a container, the
caller catches up at once (``catch_up``), so a mount made before the exec is seen by it.

It owns the watches (which volume of which container follows which host path) and the host
mounts already copied into each; nothing is written to disk: after a shim restart, volumes
bound before it stop following (their containers keep what they had).
"""

from __future__ import annotations

import logging
import os
import select
import threading
from dataclasses import dataclass, field
from pathlib import Path

from vmsandbox.adapters import binds
from vmsandbox.errors import InfrastructureError
from vmsandbox.mountinfo import mount_changes, mounts_below, options_at

log = logging.getLogger(__name__)

MOUNTINFO = "/proc/self/mountinfo"
_POLL_MS = 1000
"""The watch thread wakes at least this often to see whether it is to stop."""


@dataclass
class _Watch:
    qemu_pid: int
    source: str  # the host path the volume's bind cloned (symlinks resolved)
    bound: Path  # the bind's mount point in QEMU's namespace
    beneath: Path  # the 9p export the bind is below
    root_as: int  # QEMU's uid: host root's files are its own through the copies
    readonly: bool  # the volume is read-only: so is every copy
    known: dict[int, str] = field(default_factory=dict)  # host mount id -> point, in QEMU's namespace already
    # of those, the ones with no mount of their own there: the source's own mount (which the bind
    # is) and those whose copy failed; taking them away detaches nothing
    unplaced: set[int] = field(default_factory=set)


def _mounted_read_only(qemu_pid: int, bound: Path) -> bool:
    """Whether the bind at ``bound`` in QEMU's namespace is read-only (so when unknown)."""
    try:
        options = options_at(Path(f"/proc/{qemu_pid}/mountinfo").read_text(), str(bound))
    except OSError:
        return True
    return options is None or "ro" in options


class MountFollower:
    def __init__(self, mountinfo: str = MOUNTINFO) -> None:
        self._mountinfo = mountinfo
        self._lock = threading.Lock()  # one pass over the watches at a time
        self._watches: dict[tuple[str, str, int], _Watch] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read(self) -> str:
        return Path(self._mountinfo).read_text()

    def snapshot(self, source: str) -> dict[int, str]:
        """The host's mounts at or below ``source`` now: taken before the bind clones them, so a
        mount made in between is copied again rather than missed."""
        return mounts_below(self._read(), source)

    def watch(
        self,
        sandbox_id: str,
        container_id: str,
        index: int,
        *,
        qemu_pid: int,
        source: str,
        bound: Path,
        beneath: Path,
        root_as: int,
        known: dict[int, str],
        readonly: bool | None = None,
    ) -> None:
        """Follow ``source`` into the bind of the container's volume ``index`` at ``bound``;
        ``known``: ``snapshot(source)`` from before the bind; ``readonly``: whether the volume is
        (None: as the bind at ``bound`` is mounted in QEMU's namespace, read-only when that
        cannot be read)."""
        if readonly is None:
            readonly = _mounted_read_only(qemu_pid, bound)
        own = {i for i, p in known.items() if p == source}
        w = _Watch(qemu_pid, source, bound, beneath, root_as, readonly, dict(known), own)
        with self._lock:
            self._watches[(sandbox_id, container_id, index)] = w
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mount-follow", daemon=True)
                self._thread.start()
        self.catch_up(sandbox_id)

    def forget(self, sandbox_id: str, container_id: str = "") -> None:
        """Stop following the volumes of a container (all of the sandbox's without one)."""
        with self._lock:
            for key in [k for k in self._watches if k[0] == sandbox_id and container_id in ("", k[1])]:
                del self._watches[key]

    def watched(self, sandbox_id: str) -> int:
        with self._lock:
            return sum(1 for k in self._watches if k[0] == sandbox_id)

    def catch_up(self, sandbox_id: str = "") -> None:
        """Copy into QEMU's namespace every host mount below a watched source made since the last
        pass, and detach those the host took away (only the sandbox's watches with one)."""
        with self._lock:
            watches = [w for k, w in self._watches.items() if sandbox_id in ("", k[0])]
            if not watches:
                return
            try:
                text = self._read()
            except OSError as exc:
                log.warning("volume mounts not followed: %s: %s", self._mountinfo, exc.strerror)
                return
            for w in watches:
                self._follow(w, mounts_below(text, w.source))

    def _follow(self, w: _Watch, now: dict[int, str]) -> None:
        added, gone = mount_changes(w.known, now)
        for mount_id, point in gone:
            del w.known[mount_id]
            if mount_id in w.unplaced:
                w.unplaced.discard(mount_id)
                continue
            rel = os.path.relpath(point, w.source)
            try:
                binds.unbind_below(w.qemu_pid, w.bound, rel, beneath=w.beneath)
            except InfrastructureError as exc:
                log.warning("host mount %s taken away stays in the guest's volume: %s", point[:256], exc)
        for mount_id, point in added:
            w.known[mount_id] = point  # tried once: a mount that cannot be copied is not tried again
            try:
                binds.bind_below(
                    w.qemu_pid,
                    point,
                    w.bound,
                    os.path.relpath(point, w.source),
                    beneath=w.beneath,
                    root_as=w.root_as,
                    readonly=w.readonly,
                )
            except InfrastructureError as exc:
                w.unplaced.add(mount_id)
                log.warning("host mount %s does not reach the guest's volume: %s", point[:256], exc)

    def _run(self) -> None:
        try:
            fd = os.open(self._mountinfo, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            log.warning("volume mounts not followed: %s: %s", self._mountinfo, exc.strerror)
            return
        try:
            poller = select.poll()
            poller.register(fd, select.POLLPRI | select.POLLERR)
            while not self._stop.is_set():
                if poller.poll(_POLL_MS):  # the mount table changed
                    try:
                        self.catch_up()
                    except Exception:  # never let the watch thread die silently
                        log.exception("following volume mounts")
        finally:
            os.close(fd)

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(timeout=_POLL_MS / 1000 + 5)
