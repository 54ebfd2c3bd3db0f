"""A background task run every N seconds until stopped; a failure is logged and retried next time.

The shim uses it to reconcile the ledger with libvirt while it serves, so that what a lost
libvirt call or a crashed RPC left behind (an orphaned domain, claims of a half-made sandbox) is
cleaned up without waiting for the next restart.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class Periodic:
    def __init__(self, interval_s: float, task: Callable[[], object], name: str) -> None:
        self.interval_s = interval_s
        self._task = task
        self._name = name
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.runs = 0

    def start(self) -> None:
        if self.interval_s <= 0:
            return
        self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._task()
            except Exception:  # a failure must not end the loop: the next run may succeed
                log.exception("%s failed; trying again in %.0f s", self._name, self.interval_s)
            self.runs += 1
