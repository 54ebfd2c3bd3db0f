"""libvirt lifecycle events of our domains: tells the shim promptly when a guest stops or crashes.

``DomainEvents`` runs libvirt's default event loop in a daemon thread over a connection of its
own, registers for domain lifecycle events and hands every *stopped* or *crashed* event of a
domain whose name carries our prefix to a callback, on a separate dispatcher thread so that a
slow callback never stalls libvirt's loop. When the connection closes (libvirtd restarted), it
reconnects with a bounded back-off and calls ``on_reconnect`` — events sent while it was away
are lost, so the shim re-checks every guest then.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import libvirt

from vmsandbox.domain import DOMAIN_PREFIX

log = logging.getLogger(__name__)

_loop_started = threading.Lock()
_loop_running = False

# libvirt's VIR_DOMAIN_EVENT_* lifecycle event -> the word the shim reports
_STOPPED_EVENTS = {
    libvirt.VIR_DOMAIN_EVENT_STOPPED: "stopped",
    libvirt.VIR_DOMAIN_EVENT_CRASHED: "crashed",
}
_STOPPED_DETAILS = {
    libvirt.VIR_DOMAIN_EVENT_STOPPED_SHUTDOWN: "the guest shut down",
    libvirt.VIR_DOMAIN_EVENT_STOPPED_DESTROYED: "the guest was destroyed",
    libvirt.VIR_DOMAIN_EVENT_STOPPED_CRASHED: "the guest crashed",
    libvirt.VIR_DOMAIN_EVENT_STOPPED_FAILED: "QEMU failed",
    libvirt.VIR_DOMAIN_EVENT_STOPPED_MIGRATED: "the guest was migrated away",
    libvirt.VIR_DOMAIN_EVENT_STOPPED_SAVED: "the guest was saved",
    libvirt.VIR_DOMAIN_EVENT_STOPPED_FROM_SNAPSHOT: "the guest was reverted to a snapshot",
}


def describe(event: int, detail: int) -> str | None:
    """A sentence for a lifecycle event that ends a guest, or None for events that do not."""
    if event not in _STOPPED_EVENTS:
        return None
    if event == libvirt.VIR_DOMAIN_EVENT_CRASHED:
        return "the guest kernel panicked" if detail == libvirt.VIR_DOMAIN_EVENT_CRASHED_PANICKED else "guest crashed"
    return _STOPPED_DETAILS.get(detail, "the guest stopped")


def _ensure_event_loop() -> None:
    """Start libvirt's default event loop once per process (it must precede the event connection)."""
    global _loop_running
    with _loop_started:
        if _loop_running:
            return
        libvirt.virEventRegisterDefaultImpl()

        def run() -> None:
            while True:
                libvirt.virEventRunDefaultImpl()

        threading.Thread(target=run, name="libvirt-events", daemon=True).start()
        _loop_running = True


class DomainEvents:
    """Watch our domains; ``on_stop(domain_name, why)`` runs on the dispatcher thread."""

    def __init__(
        self,
        uri: str,
        on_stop: Callable[[str, str], object],
        on_reconnect: Callable[[], object] = lambda: None,
        *,
        max_backoff_s: float = 10.0,
    ) -> None:
        self.uri = uri
        self._on_stop = on_stop
        self._on_reconnect = on_reconnect
        self._max_backoff_s = max_backoff_s
        self._queue: queue.Queue[tuple[str, str] | None] = queue.Queue()
        self._closed = threading.Event()
        self._conn: Any = None
        self._lost = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        _ensure_event_loop()
        self._connect()
        for target, name in ((self._dispatch, "domain-events"), (self._watch, "domain-events-reconnect")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def close(self) -> None:
        self._closed.set()
        self._lost.set()
        self._queue.put(None)
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(libvirt.libvirtError):
                conn.close()
        for t in self._threads:
            t.join(timeout=5)

    # -- libvirt callbacks (on libvirt's loop thread: never block there) -------------------------
    def _lifecycle(self, _conn: Any, dom: Any, event: int, detail: int, _opaque: Any) -> None:
        why = describe(event, detail)
        if why is None:
            return
        name = dom.name()
        if name.startswith(DOMAIN_PREFIX):
            self._queue.put((name, why))

    def _connection_closed(self, _conn: Any, reason: int, _opaque: Any) -> None:
        if not self._closed.is_set():
            log.warning("libvirt event connection to %s closed (reason %d); reconnecting", self.uri, reason)
            self._lost.set()

    # -- threads -----------------------------------------------------------------------------------
    def _connect(self) -> None:
        conn = libvirt.open(self.uri)
        conn.registerCloseCallback(self._connection_closed, None)
        conn.domainEventRegisterAny(None, libvirt.VIR_DOMAIN_EVENT_ID_LIFECYCLE, self._lifecycle, None)
        with contextlib.suppress(libvirt.libvirtError):  # local drivers (test:///, embed) have no keep-alive
            conn.setKeepAlive(5, 3)
        self._conn = conn

    def _dispatch(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            name, why = item
            try:
                if name:
                    self._on_stop(name, why)
                else:
                    self._on_reconnect()
            except Exception:  # a failing callback must not end the watch
                log.exception("handling the event %r of domain %s failed", why, name or "(all)")

    def _watch(self) -> None:
        backoff = 0.5
        while not self._closed.is_set():
            self._lost.wait()
            if self._closed.is_set():
                return
            try:
                self._connect()
            except libvirt.libvirtError as exc:
                log.warning("cannot reconnect to libvirt at %s for events: %s", self.uri, exc)
                self._closed.wait(backoff)
                backoff = min(backoff * 2, self._max_backoff_s)
                continue
            backoff = 0.5
            self._lost.clear()
            log.info("libvirt event connection to %s restored; re-checking every guest", self.uri)
            self._queue.put(("", "reconnected"))  # the dispatcher runs on_reconnect in order with stops
