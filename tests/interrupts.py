"""SIGTERM and SIGINT for the benchmarks and test helpers that start guests, shims, registries and
containerd: the one place that says what such a process does when it is told to stop.

Python's default for SIGTERM is to die on the spot: no ``finally``, no ``with`` block's exit, no
``atexit``, so every guest, shim and registry the process started outlived it (a guest at full CPU
slowing every later measurement). ``install()`` makes the first SIGTERM or SIGINT an ``Interrupted``
exception in the main thread (a ``KeyboardInterrupt``, so pytest treats it as Ctrl-C and ``except
Exception`` never swallows it): the stack unwinds through the clean-up the code already has, then
``atexit`` runs. Later signals are noted and ignored, so a second Ctrl-C does not cut the clean-up
short (SIGKILL still ends the process). ``run_main(main)`` is how a benchmark's ``__main__`` runs.

``remove_guests(state_dir)`` is the clean-up after a shim: what it was still starting when it
stopped is removed from libvirt by the domains' metadata (``cli.teardown``).
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType

_installed = False
_interrupted: list[int] = []


class Interrupted(KeyboardInterrupt):
    """The process was told to stop (SIGTERM or SIGINT); its clean-up runs as the stack unwinds."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


def _handle(signum: int, _frame: FrameType | None) -> None:
    if _interrupted:
        print(f"{signal.Signals(signum).name}: still cleaning up (SIGKILL to abandon it)", file=sys.stderr, flush=True)
        return
    _interrupted.append(signum)
    raise Interrupted(signum)


def install() -> None:
    """SIGTERM and SIGINT raise ``Interrupted`` in the main thread (once). Idempotent; a no-op
    outside the main thread (only it may set handlers)."""
    global _installed
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGTERM, _handle)
    signal.signal(signal.SIGINT, _handle)
    _installed = True


def run_main(main: Callable[[], int | None]) -> int:
    """Run a benchmark's ``main`` with ``install()``ed handlers: its exit status, or 128 + the
    signal's number (a shell's convention) once its clean-up has run after SIGTERM or SIGINT."""
    install()
    try:
        return main() or 0
    except Interrupted as exc:
        print(f"{exc}: what this run started is removed", file=sys.stderr, flush=True)
        return 128 + exc.signum


def remove_guests(state_dir: str | Path) -> list[str]:
    """Destroy every domain libvirt still has of the (stopped) shim whose state is ``state_dir``,
    and delete the pod networks' macvtaps and namespaces it records; the problems, each also printed
    on stderr."""
    from cli.teardown import remove_state_domains, remove_state_networks

    outcome = remove_state_domains(state_dir) + remove_state_networks(state_dir)
    for line in (*outcome.done, *outcome.problems):
        print(f"clean-up: {line}", file=sys.stderr, flush=True)
    return list(outcome.problems)
