"""One home per RPC that changes state: each module here holds one RPC's steps, in order.

Each RPC runs its steps inside ``steps(rpc, ...)``. A step that changed something pushes its undo
as soon as it succeeded (``Steps.done``); a failure later on unwinds exactly what was done, newest
first, as Go's ``defer`` does. When the RPC returns, the undos are dropped: what it made stays,
and one log line says how long each step took (``CreateContainer done in 312 ms: admit 2, ...``;
``bench/cluster_start.py`` reads it).

Every ``done`` is also a fault point, ``<rpc>:<step>`` (``shim.faults``): a test can fail the RPC
right after any step and check that nothing the RPC made is left behind. The points of an RPC are
declared with it (``steps``'s ``names``), so a test can walk all of them (``rpc_points``).

An undo that fails stops the unwinding: what it and the steps before it made stays, and the error
says so; the reconcile (``shim.reconcile``) finishes it, as it does after a crash at that point.
The owners (``shim.records``, ``shim.host_resources``, ``shim.pod_networks``, ...) keep the state;
the RPC modules only order their calls.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from shim import faults
from vmsandbox.errors import VmSandboxError

log = logging.getLogger(__name__)

_POINTS: dict[str, tuple[str, ...]] = {}  # rpc -> its steps, in order
NOTHING_UNDONE = "nothing to roll back"  # the outcome of a failure before any step with an undo


def declare(rpc: str, *names: str) -> None:
    """The steps of ``rpc`` (each one a fault point ``<rpc>:<step>``), in the order it runs them."""
    _POINTS[rpc] = names
    faults.declare(*(f"{rpc}:{n}" for n in names))


def rpc_points(rpc: str) -> tuple[str, ...]:
    """The fault points of ``rpc``'s steps, in order."""
    return tuple(f"{rpc}:{n}" for n in _POINTS[rpc])


@dataclass
class Steps:
    """The undo stack of one RPC call."""

    rpc: str
    _undo: list[tuple[str, Callable[[], object]]] = field(default_factory=list)
    _clock: Callable[[], float] = time.monotonic
    # (step, when it was done, its own ms when it ran inside another step, see ``timed``)
    _marks: list[tuple[str, float, float | None]] = field(default_factory=list)
    _started: float = 0.0

    def __post_init__(self) -> None:
        self._started = self._clock()

    def done(self, step: str, undo: Callable[[], object] | None = None) -> None:
        """``step`` succeeded; ``undo`` (if any) reverses it should a later step fail."""
        self._mark(step, undo, None)

    def timed(self, step: str, work: Callable[[], Callable[[], object] | None]) -> None:
        """``step`` is ``work``, run in the middle of the step around it (e.g. from a callback of
        the guest's start): done with the undo ``work`` returns, and its time its own, which the
        timings take out of the surrounding step's instead of giving it all that went before."""
        began = self._clock()
        undo = work()
        self._mark(step, undo, self._clock() - began)

    def _mark(self, step: str, undo: Callable[[], object] | None, own: float | None) -> None:
        if step not in _POINTS.get(self.rpc, ()):
            raise AssertionError(f"{self.rpc}: step {step!r} is not declared")
        if undo is not None:
            self._undo.append((step, undo))
        self._marks.append((step, self._clock(), own))
        faults.checkpoint(f"{self.rpc}:{step}")

    def unwind(self) -> str:
        """Undo what was done, newest first; says what it did (for the error message)."""
        undone: list[str] = []
        while self._undo:
            step, undo = self._undo.pop()
            try:
                undo()
            except VmSandboxError as exc:
                left = [step, *(s for s, _ in reversed(self._undo))]
                self._undo.clear()
                log.error(
                    "%s: undoing %s failed, left for the reconcile: %s (%s)", self.rpc, step, ", ".join(left), exc
                )
                return f"rollback incomplete: undoing {step} failed ({exc}); left for the reconcile: {', '.join(left)}"
            undone.append(step)
        return f"rolled back: {', '.join(undone)} undone" if undone else NOTHING_UNDONE

    def timings(self) -> str:
        """How long the call took and each step done (since the one before it, less the steps
        ``timed`` inside it), in ms: the log line of a call that succeeded, e.g. ``312 ms: admit 2,
        hold-image 1, guest-create 290``."""
        now = self._clock()
        parts, last, inside = [], self._started, 0.0
        for step, when, own in self._marks:
            if own is not None:
                parts.append(f"{step} {round(own * 1000)}")
                inside += own
                continue
            parts.append(f"{step} {round((when - last - inside) * 1000)}")
            last, inside = when, 0.0
        return f"{round((now - self._started) * 1000)} ms: {', '.join(parts)}"


@contextmanager
def steps(rpc: str, on_failure: Callable[[BaseException, str], BaseException | None] | None = None) -> Iterator[Steps]:
    """Run an RPC's steps: on any exception, unwind what was done, then re-raise. ``on_failure``
    may give the error to raise instead (e.g. one naming the pod and what the rollback did)."""
    s = Steps(rpc)
    try:
        yield s
    except BaseException as exc:
        outcome = s.unwind()
        better = on_failure(exc, outcome) if on_failure is not None else None
        if better is not None:
            raise better from exc
        raise
    log.info("%s done in %s", rpc, s.timings())
