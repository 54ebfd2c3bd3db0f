"""The stdio of what containerd runs in a VM pod (shim mode): the fifos containerd made for a task
or an exec, fed from the guest.

containerd's CRI plugin opens each task's stdout/stderr fifos for reading before it creates the
task, copies what arrives into the kubelet's log file itself and serves Attach from it; it writes
a task's stdin fifo. So in shim mode a container's output is not written to the kubelet's file by
vmsandbox: the log copy (``shim.log_copy``, bounded and checked as always) hands its CRI records
to a ``FifoSink``, which writes each record's text (a full line's newline restored) to the fifo of
its stream. An exec's output goes straight from its agent stream session to its fifos
(``pump_exec``), and so does the output of a container with a stdin or a terminal, from its own
attach session (``pump_attached``): containerd's Attach shows what reaches the fifos, and the log
copy passes whole lines only, so a shell's answer without a newline (``echo -n``, a prompt) would
wait for the next one. Such a container's output written before its session opens (the moment
between its start in the guest and the session's opening) is in the guest's log only.

A fifo is opened without blocking and written with a bounded wait: a reader that went away (the
write fails: EPIPE, ENXIO) or stopped reading for ``STALL_S`` loses that output, with a warning,
so no guest output and no containerd can hold a copy thread for ever.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import stat
import threading
import time
from collections.abc import Callable

from vmsandbox.adapters.agent_streams import AgentStream
from vmsandbox.agent_ops import STREAM_READ_MAX, STREAM_WRITE_MAX
from vmsandbox.errors import VmSandboxError

log = logging.getLogger(__name__)

STALL_S = 30.0
"""A fifo whose reader takes nothing for this long loses what was to be written."""
OPEN_WAIT_S = 5.0
"""How long a fifo's other end (containerd's) is waited for."""
READ_WAIT_S = 2.0


class Fifo:
    """One end of one of containerd's fifos, opened without blocking (never a regular file or a
    symlink: ``O_NOFOLLOW`` and a check that it is a fifo)."""

    def __init__(self, path: str, *, write: bool) -> None:
        self.path = path
        self.write_end = write
        self._fd: int | None = None

    def _open(self) -> int | None:
        if self._fd is None:
            flags = (os.O_WRONLY if self.write_end else os.O_RDONLY) | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                fd = os.open(self.path, flags)
            except OSError as exc:
                if exc.errno in (errno.ENXIO, errno.ENOENT):  # no reader (any more), or gone
                    return None
                raise
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                os.close(fd)
                raise OSError(errno.EINVAL, f"{self.path} is not a fifo")
            self._fd = fd
        return self._fd

    def open_now(self, wait_s: float = OPEN_WAIT_S) -> bool:
        """Opens it now, waiting up to ``wait_s`` for containerd's end: its reader sees the end of
        the stream when this end closes, whether or not anything was written."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                if self._open() is not None:
                    return True
            except OSError as exc:
                log.warning("fifo %s cannot be opened: %s", self.path, exc)
                return False
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)

    def write_all(self, data: bytes, stop: threading.Event | None = None) -> bool:
        """Writes ``data``; False when the reader is gone or stalled (what is left is dropped)."""
        view = memoryview(data)
        while view:
            fd = self._open()
            if fd is None:
                return False
            try:
                n = os.write(fd, view)
                view = view[n:]
                continue
            except BlockingIOError:
                pass
            except (BrokenPipeError, OSError) as exc:
                if exc.errno in (errno.EPIPE, errno.EBADF):
                    self.close()
                    return False
                raise
            ready = False
            for _ in range(int(STALL_S)):
                if stop is not None and stop.is_set():
                    return False
                _, w, _ = select.select([], [fd], [], 1.0)
                if w:
                    ready = True
                    break
            if not ready:
                log.warning("fifo %s: its reader took nothing for %g s; output dropped", self.path, STALL_S)
                return False
        return True

    def read_some(self, wait_s: float) -> bytes | None:
        """Up to ``STREAM_WRITE_MAX`` bytes; b"" when nothing came within ``wait_s``; None at the end."""
        fd = self._open()
        if fd is None:
            return None
        r, _, _ = select.select([fd], [], [], wait_s)
        if not r:
            return b""
        try:
            data = os.read(fd, STREAM_WRITE_MAX)
        except BlockingIOError:
            return b""
        return data if data else None

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None


def record_texts(records: bytes) -> list[tuple[bytes, bytes]]:
    """(stream, text) of each whole CRI log record ``<time> <stream> <P|F> <text>``; a full
    record's text gets its newline back. The records were checked by the log copy."""
    out = []
    for line in records.split(b"\n"):
        if not line:
            continue
        parts = line.split(b" ", 3)
        if len(parts) < 3:
            continue
        text = parts[3] if len(parts) == 4 else b""
        out.append((parts[1], text + b"\n" if parts[2] == b"F" else text))
    return out


class FifoSink:
    """A container's output to containerd's stdout and stderr fifos (the log copy's sink)."""

    def __init__(self, stdout: str, stderr: str) -> None:
        self._out = Fifo(stdout, write=True) if stdout else None
        self._err = Fifo(stderr, write=True) if stderr else None
        for f in (self._out, self._err):
            if f is not None:
                f.open_now()

    def __str__(self) -> str:
        return f"containerd's fifos {self._out.path if self._out else '-'}"

    def write(self, records: bytes) -> None:
        for stream, text in record_texts(records):
            fifo = self._err if stream == b"stderr" else self._out
            if fifo is not None and text:
                fifo.write_all(text)

    def reopen(self) -> None:
        return None  # a fifo is not rotated

    def close(self) -> None:
        for f in (self._out, self._err):
            if f is not None:
                f.close()


def _drain_output(stream: AgentStream, stdout: str, stderr: str, stop: threading.Event, what: str) -> Callable[[], int]:
    """Opens containerd's stdout and stderr fifos now (their reader sees their end whether or not
    anything is written) and returns the loop that copies the session's output into them until
    the process ends or ``stop`` is set; it then sets ``stop``, closes the fifos, releases the
    session and returns the exit code (255 when the session was lost or none came)."""
    out = Fifo(stdout, write=True) if stdout else None
    err = Fifo(stderr, write=True) if stderr else None
    for f in (out, err):
        if f is not None:
            f.open_now()

    def drain() -> int:
        code = 255
        try:
            while not stop.is_set():
                got = stream.read(STREAM_READ_MAX, READ_WAIT_S)
                if got.stdout and out is not None:
                    out.write_all(got.stdout, stop)
                if got.stderr and err is not None:
                    err.write_all(got.stderr, stop)
                if got.done:
                    code = got.exit_code if got.exit_code is not None else 255
                    break
        except (VmSandboxError, OSError) as exc:
            log.warning("%s session %s ends: %s", what, stream.id, exc)
        finally:
            stop.set()
            for f in (out, err):
                if f is not None:
                    f.close()
            with contextlib.suppress(VmSandboxError):
                stream.release()
        return code

    return drain


def pump_exec(
    stream: AgentStream,
    stdin: str,
    stdout: str,
    stderr: str,
    exited: Callable[[int], None],
) -> StdinFeed | None:
    """Carries an exec's stdio between its agent stream session and containerd's fifos, in two
    threads; calls ``exited`` with its exit code (255 when the session was lost) once its output
    is drained, then releases the session. Its stdin's feed, if it has a stdin."""
    stop = threading.Event()
    drain = _drain_output(stream, stdout, stderr, stop, "exec")
    feed = StdinFeed(stream, stdin, stop) if stdin else None
    threading.Thread(target=lambda: exited(drain()), name=f"exec-out-{stream.id[:8]}", daemon=True).start()
    return feed


FINISH_WAIT_S = 10.0
"""How long CloseIO waits for what containerd wrote to a stdin fifo to reach the guest."""


class StdinFeed:
    """Carries what containerd writes to the stdin fifo ``path`` into the stream session, in a
    thread; the fifo's end (containerd closed it) closes the session's input, and so does
    ``finish`` (CloseIO) once what was written before it has been carried: containerd writes the
    client's stdin to the fifo, then calls CloseIO, so closing at once would drop the end of it."""

    def __init__(self, stream: AgentStream, path: str, stop: threading.Event) -> None:
        self.stream = stream
        self._stop = stop
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._feed, args=(path,), name=f"stdin-{stream.id[:8]}", daemon=True)
        self._thread.start()

    def _feed(self, path: str) -> None:
        fifo = Fifo(path, write=False)
        try:
            while not self._stop.is_set():
                closing = self._closing.is_set()
                data = fifo.read_some(0 if closing else 1.0)
                if data is None or (closing and not data):
                    self.stream.close_input()
                    return
                while data and not self._stop.is_set():
                    n, closed = self.stream.write_some(data[:STREAM_WRITE_MAX])
                    if closed:
                        return
                    data = data[n:]
        except (VmSandboxError, OSError) as exc:
            log.debug("stdin of stream %s ends: %s", self.stream.id, exc)
        finally:
            fifo.close()

    def finish(self, wait_s: float = FINISH_WAIT_S) -> None:
        """CloseIO: the session's input closes after what the fifo holds now reaches it (waiting
        up to ``wait_s``; a guest that takes nothing meanwhile has its input closed anyway)."""
        self._closing.set()
        self._thread.join(wait_s)
        if self._thread.is_alive():
            self.stream.close_input()


def pump_attached(stream: AgentStream, stdout: str, stderr: str, stop: threading.Event) -> threading.Thread:
    """Carries a container's output from its own attach session to containerd's fifos, as it
    comes (a prompt, or ``echo -n``'s text, with no newline after it, included: the log copy
    passes whole lines only, so an attach would not see those until a newline came), in a thread,
    until the container ends and its output is drained or ``stop`` is set; then closes the fifos
    (containerd's end of the container's stdio) and releases the session."""
    drain = _drain_output(stream, stdout, stderr, stop, "attach")
    t = threading.Thread(target=drain, name=f"attached-{stream.id[:8]}", daemon=True)
    t.start()
    return t
