"""``LogCopies``: copies each running container's CRI log from its guest agent (``log_read``
over the agent channel) into the kubelet's ``log_directory/log_path``, and owns how far each copy
got: one small file per container under ``<state_dir>/logs/`` (host-only, never shared with a
guest), so that a shim that restarts carries on where the last one stopped.

Nothing here opens a path a guest can write. What the guest sends is bounded: one chunk of at
most ``CHUNK_BYTES`` in hand per container, whole lines only written (``vmsandbox.log_copy_rules``), at
``log_rate_bytes`` per second on average per container. The guest writes the CRI records, so each
is checked before it is written (``check_records``: a line that is no record is dropped, a time far
from the host's clock is replaced by it, a terminal's output is stdout, a chain of partial records
ends at 1 MiB); what was fixed is counted (``vmsandbox_log_records_fixed``) and logged. An answer
that lies (an offset going back, more than asked, bad base64) stops that container's copy with a
warning; nothing a guest sends raises out of a copy thread.

At least once: a chunk is appended to the kubelet's file, then its end recorded, then asked past
(which lets the guest drop it); a shim killed in between copies that chunk again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, Protocol

from shim import metrics
from vmsandbox import validation
from vmsandbox.adapters.agent_client import AgentLost
from vmsandbox.adapters.guest_channel import GuestRequestFailed
from vmsandbox.agent_ops import LogChunk
from vmsandbox.agent_protocol import ProtocolError
from vmsandbox.errors import VmSandboxError
from vmsandbox.log_copy_rules import RecordState, TokenBucket, check_records, whole_lines

log = logging.getLogger(__name__)

CHUNK_BYTES = 256 * 1024
"""At most this much is asked of the guest at once (and so held by the shim per container)."""
_WAIT_S = 20.0
"""How long one request waits in the guest for output (long poll). The guest answers as soon as
output comes or the log ends, so this only sets how often an idle container's guest wakes to say
there is nothing: asked every 2 s, an idle VM pod took 0.55 % of a host CPU under TCG, every 20 s
0.30-0.35 % (bench/density.py). A copy being stopped does not wait for it (``_Copy.stop``)."""
_PARTIAL_WAIT_S = 0.2
"""Pause before asking again for a line the guest has not finished (a well-behaved agent sends
whole lines only)."""
_RETRY_S = 1.0
"""Pause after the channel failed (the guest reboots, the shim reconnects)."""
_DRAIN_S = 60.0
"""After its container exited, a copy goes on until the guest says the log ends, at most this long."""
_STOP_JOIN_S = 1.0
"""How long stopping a copy waits for its thread (one not waiting on the guest ends at once)."""
_PROGRESS_MAX_BYTES = 96

Reader = Callable[[int, int, float], LogChunk]
"""``read(offset, max_bytes, wait_s)``: the container's log from ``offset`` (agent ``log_read``)."""


class Sink(Protocol):
    """Where a copy writes the checked CRI records of one container."""

    def write(self, records: bytes) -> None: ...

    def reopen(self) -> None: ...

    def close(self) -> None: ...


class CriLogFile:
    """The kubelet's log file of the container (``ContainerConfig.log_path``), appended to."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._out: BinaryIO = path.open("ab")

    def __str__(self) -> str:
        return str(self.path)

    def write(self, records: bytes) -> None:
        self._out.write(records)
        self._out.flush()

    def reopen(self) -> None:
        if not self._out.closed:
            self._out.close()
            self._out = self.path.open("ab")

    def close(self) -> None:
        self._out.close()


class _Copy:
    def __init__(self, cid: str, sink: Sink | None, read: Reader, progress: LogCopies, tty: bool) -> None:
        self.cid = cid
        self.tty = tty
        self._read = read
        self._progress = progress
        self._stop = threading.Event()
        self._finish_by: float | None = None
        self._lock = threading.Lock()
        self._offset, self._records = progress.progress(cid)
        self._out: Sink | None = sink
        now = time.monotonic()
        self._bucket = TokenBucket.full(progress.rate, progress.burst, now)
        self.ended = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"log-{cid[:12]}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._loop()
        except OSError as exc:  # the kubelet's file or our state directory
            log.warning("container %s: log copy to %s stopped: %s", self.cid[:12], self._out, exc)
        except Exception:  # never let a copy thread die silently
            log.exception("container %s: log copy stopped", self.cid[:12])
        finally:
            with self._lock:
                if self._out is not None:
                    self._out.close()
            self.ended.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            finishing = self._finish_by is not None
            if finishing and time.monotonic() > (self._finish_by or 0):
                log.warning("container %s: its log did not end within %g s of its exit", self.cid[:12], _DRAIN_S)
                return
            try:
                chunk = self._read(self._offset, CHUNK_BYTES, 0.2 if finishing else _WAIT_S)
            except ProtocolError as exc:
                log.warning("container %s: log copy stopped, the guest answered wrongly: %s", self.cid[:12], exc)
                return
            except GuestRequestFailed as exc:
                log.info("container %s: log copy ends: %s", self.cid[:12], validation.quote(str(exc)[:300]))
                return
            except AgentLost as exc:  # its sandbox is NOTREADY now: no agent to ask any more
                log.info("container %s: log copy ends, the guest agent was lost: %s", self.cid[:12], exc)
                return
            except VmSandboxError as exc:
                log.debug("container %s: log read failed, retrying: %s", self.cid[:12], exc)
                self._stop.wait(_RETRY_S)
                continue
            if chunk.offset > self._offset:
                log.warning(
                    "container %s: the guest no longer holds log bytes %d to %d",
                    self.cid[:12],
                    self._offset,
                    chunk.offset,
                )
                self._offset = chunk.offset
            cut = whole_lines(chunk.data, chunk.eof, CHUNK_BYTES)
            with self._lock:  # a copy stopped meanwhile writes and records nothing more
                if self._stop.is_set():
                    return
                if cut.text:
                    checked = check_records(cut.text, self._records, time.time_ns(), tty=self.tty)
                    self._records = checked.state
                    self._report(checked.fixes)
                    if checked.text and self._out is not None:
                        self._out.write(checked.text)
                if cut.consumed:
                    self._offset += cut.consumed
                    self._progress.record(self.cid, self._offset, self._records)
            if chunk.eof and cut.consumed == len(chunk.data):
                return
            delay = 0.0
            if cut.text:
                self._bucket, delay = self._bucket.take(len(cut.text), time.monotonic())
            elif chunk.data:
                delay = _PARTIAL_WAIT_S
            if delay:
                self._stop.wait(delay)

    def _report(self, fixes: dict[str, int]) -> None:
        fixed = {k: n for k, n in fixes.items() if n}
        if fixed:
            for fix, n in fixed.items():
                metrics.log_records_fixed(fix, n)
            log.warning("container %s: log records from its guest fixed: %s", self.cid[:12],
                        ", ".join(f"{n} {fix}" for fix, n in sorted(fixed.items())))  # fmt: skip

    def reopen(self) -> None:
        with self._lock:
            if self._out is not None:
                self._out.reopen()

    def finish(self, wait_s: float) -> None:
        """The container exited: copy what is left until the log ends (waiting ``wait_s`` here)."""
        if self._finish_by is None:
            self._finish_by = time.monotonic() + _DRAIN_S
        self._thread.join(timeout=wait_s)

    def stop(self) -> None:
        """From now on the copy writes and records nothing and its sink is closed. A copy waiting
        in the guest for output ends when the answer comes (within ``_WAIT_S``), unawaited: it
        drops the answer."""
        with self._lock:
            self._stop.set()
            if self._out is not None:
                self._out.close()
                self._out = None
        self._thread.join(timeout=_STOP_JOIN_S)


class LogCopies:
    """The log copies of running containers, one thread each, and their recorded progress."""

    def __init__(self, state_dir: str | os.PathLike[str], rate: int, burst: int) -> None:
        self.root = Path(state_dir) / "logs"
        self.rate = float(rate)
        self.burst = float(max(burst, CHUNK_BYTES))
        self._lock = threading.Lock()
        self._copies: dict[str, _Copy] = {}

    # -- progress (host-only state) ---------------------------------------------------------------
    def _mark(self, cid: str) -> Path:
        if not validation.is_full_id(cid):
            raise ValueError(f"not a container id: {cid[:80]!r}")
        return self.root / cid

    def progress(self, cid: str) -> tuple[int, RecordState]:
        """Where the copy of ``cid`` stands, and its record checks (offset 0 and a check state
        starting now when it never started; an offset alone is what an earlier version wrote)."""
        now = time.time_ns()
        try:
            with self._mark(cid).open("rb") as f:
                fields = [int(x) for x in f.read(_PROGRESS_MAX_BYTES).split()]
        except (FileNotFoundError, ValueError):
            return 0, RecordState(now)
        if len(fields) == 4 and all(x >= 0 for x in fields):
            return fields[0], RecordState(fields[1], fields[2], fields[3])
        return (max(0, fields[0]) if fields else 0), RecordState(now)

    def offset(self, cid: str) -> int:
        """Where the copy of ``cid`` stands (0 when it never started)."""
        return self.progress(cid)[0]

    def record(self, cid: str, offset: int, records: RecordState) -> None:
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        mark = self._mark(cid)
        tmp = mark.with_name(f".{cid}.tmp")
        tmp.write_text(f"{offset} {records.first_ns} {records.last_ns} {records.chain}")
        os.replace(tmp, mark)

    def forget(self, cid: str) -> None:
        """The container is removed: its copy stops and its progress goes."""
        self.stop(cid)
        with contextlib.suppress(FileNotFoundError):
            self._mark(cid).unlink()

    def sweep(self, keep: set[str]) -> None:
        """Drop the progress of containers nobody remembers (a crash between removal and forget)."""
        try:
            names = [p.name for p in self.root.iterdir()]
        except OSError:
            return
        for name in names:
            if name not in keep:
                with contextlib.suppress(OSError):
                    (self.root / name).unlink()

    # -- copies ---------------------------------------------------------------------------------
    def start(self, cid: str, sink: Sink | None, read: Reader, *, tty: bool = False) -> None:
        """Copies ``cid``'s log to ``sink`` (the kubelet's file, or containerd's fifos in shim
        mode); with None (a container without a log path), reads and drops it, so that the
        container's writes do not block on a log nobody takes. ``tty``: the container has a
        terminal, so all its records are stdout's. The copy closes the sink when it ends."""
        with self._lock:
            if cid in self._copies and not self._copies[cid].ended.is_set():
                if sink is not None:
                    sink.close()
                return
            self._copies[cid] = _Copy(cid, sink, read, self, tty)

    def finish(self, cid: str, wait_s: float = 5.0) -> None:
        """``cid`` exited: its copy runs on until its log ends; returns after at most ``wait_s``."""
        with self._lock:
            copy = self._copies.get(cid)
        if copy is not None:
            copy.finish(wait_s)

    def stop(self, *cids: str) -> None:
        """Stop the copies of ``cids`` (all told first, then each awaited)."""
        with self._lock:
            copies = [c for c in (self._copies.pop(cid, None) for cid in cids) if c is not None]
        for c in copies:
            c._stop.set()
        for c in copies:
            c.stop()

    def copying(self) -> set[str]:
        """The containers whose log is being copied (started, neither stopped nor at its end)."""
        with self._lock:
            return {cid for cid, c in self._copies.items() if not c.ended.is_set()}

    def reopen(self, cid: str) -> None:
        with self._lock:
            copy = self._copies.get(cid)
        if copy is not None:
            copy.reopen()

    def close(self) -> None:
        with self._lock:
            cids = list(self._copies)
        self.stop(*cids)
