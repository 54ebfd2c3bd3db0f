"""Host side of the guest agent channel: a unix socket that QEMU joins to the guest's
virtio-serial port ``io.vmsandbox.agent.0`` (protocol in ``vmsandbox.agent_protocol``).

``wait_for_hello`` is all a sandbox start needs; ``GuestChannel`` keeps the connection for
later requests. Both are safe to use from several threads (one request at a time per channel).

Lines are read in chunks of at most ``CHUNK_BYTES`` into a buffer that never holds more than
``MAX_FRAME_BYTES`` (the protocol's longest line): a guest that writes a line without end is
disconnected at the limit (``FrameTooLong``), whatever it writes. Errors name the sandbox (the
``label`` a caller gives) rather than the socket.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import socket
import threading
import time
from collections.abc import Mapping

from vmsandbox.agent_protocol import (
    MAX_FRAME_BYTES,
    VERSION,
    Ack,
    FrameTooLong,
    GuestReport,
    Hello,
    Message,
    ProtocolError,
    Request,
    Response,
    decode,
    encode,
    report_from_body,
)
from vmsandbox.errors import InfrastructureError

CHUNK_BYTES = 1 << 20
"""Most bytes one read from the socket takes."""
_GREETING_DRAIN_S = 2.0
_RETRY_CONNECT_S = 0.01
_GREETING_ID = "0"
"""Id of the report request that opens every connection (request ids count up from 1)."""
_FIRST_ID = "1"
"""Id of the request ``open_with_request`` opens a connection with (no greeting then)."""


class GuestChannelTimeout(InfrastructureError):
    """The guest did not answer (or the socket did not appear) in time."""


class GuestChannelClosed(InfrastructureError):
    """The connection to the guest closed (QEMU exited or the guest went away)."""


class GuestRequestFailed(InfrastructureError):
    """The guest answered a request with ``ok: false``; ``code`` is the response's (``""`` if none)."""

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code


class _Connection:
    """Lines over one connected socket; callers serialise access. ``label`` names the guest in errors."""

    def __init__(self, sock: socket.socket, path: str, label: str = "") -> None:
        self.sock = sock
        self.path = path
        self.label = label or f"guest channel {path}"
        self._buf = bytearray()
        self._scanned = 0  # bytes of _buf known to hold no line end
        self.version = 1
        """Protocol version of what we send: 1 (every agent reads it) until the guest has said
        which it speaks, then the highest both sides speak."""

    @property
    def buffered(self) -> int:
        """Bytes read and not yet handed out as a message (at most MAX_FRAME_BYTES)."""
        return len(self._buf)

    def speak(self, report: GuestReport) -> None:
        self.version = max(1, min(VERSION, report.protocol))

    def send(self, msg: Ack | Request) -> None:
        try:
            self.sock.sendall(encode(msg, self.version))
        except OSError as e:
            raise GuestChannelClosed(f"{self.label}: the guest channel closed while sending: {e}") from e

    def read(self, deadline: float, what: str) -> Message:
        """The next message; ``what`` says what was awaited, for the timeout error. FrameTooLong when
        the guest's line passes MAX_FRAME_BYTES (the connection is then of no further use)."""
        while (end := self._buf.find(b"\n", self._scanned)) < 0:
            self._scanned = len(self._buf)
            room = MAX_FRAME_BYTES + 1 - len(self._buf)
            if room <= 0:
                raise FrameTooLong(
                    f"{self.label}: the guest agent sent a line longer than {MAX_FRAME_BYTES} bytes; disconnected"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise GuestChannelTimeout(f"{what} on {self.label}")
            self.sock.settimeout(remaining)
            try:
                chunk = self.sock.recv(min(CHUNK_BYTES, room))
            except TimeoutError:
                raise GuestChannelTimeout(f"{what} on {self.label}") from None
            except OSError as e:
                raise GuestChannelClosed(f"{self.label}: the guest channel failed: {e}") from e
            if not chunk:
                raise GuestChannelClosed(f"{self.label}: the guest channel closed by the other end")
            self._buf += chunk
        line = bytes(self._buf[: end + 1])
        del self._buf[: end + 1]
        self._scanned = 0
        try:
            return decode(line)
        except ProtocolError as e:
            raise type(e)(f"{self.label}: the guest agent sent a bad message: {e}") from None

    def close(self) -> None:
        # shutdown first: it wakes a recv() blocked in another thread, close() alone does not.
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def _connect(path: str, deadline: float, timeout_s: float, last_error: str, label: str) -> socket.socket:
    """A socket connected to ``path``, retrying while it is missing or refuses (QEMU not up yet)."""
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            return sock
        except OSError as e:
            sock.close()
            if e.errno not in (errno.ENOENT, errno.ECONNREFUSED, errno.EAGAIN):
                raise InfrastructureError(f"{label}: cannot connect to the guest channel {path}: {e}") from e
            last_error = f"connect: {e.strerror}"
        if time.monotonic() + _RETRY_CONNECT_S >= deadline:
            raise GuestChannelTimeout(f"no hello from the guest on {label} within {timeout_s:g} s ({last_error})")
        time.sleep(_RETRY_CONNECT_S)


def _drain_greeting(conn: _Connection, deadline: float) -> None:
    """After a hello, consume the answer to our greeting request, so that it never reaches the
    next host to connect as a stray response. A guest that does not answer in time, or a
    connection that closes, ends the wait: the hello is what we came for."""
    with contextlib.suppress(GuestChannelTimeout, GuestChannelClosed):
        while True:
            msg = conn.read(deadline, "greeting response")
            if isinstance(msg, Response) and msg.id in (_GREETING_ID, None):
                return


class GuestChannel:
    """A connection to a guest agent that has described itself (hello or report)."""

    def __init__(self, conn: _Connection, report: GuestReport) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self.report = report
        """What the guest reported when the channel opened."""

    @classmethod
    def open(cls, socket_path: str | os.PathLike[str], timeout_s: float, label: str = "") -> GuestChannel:
        """Connects (retrying while the socket is missing or refuses) and returns once the guest
        has described itself. Raises GuestChannelTimeout when ``timeout_s`` runs out.

        A booting guest greets each host with hello until acked. A guest acked by an earlier
        host greets again only if it saw that host leave, which it misses when the next host
        connects at once (QEMU then tells it "closed" and "open" back to back). So the host also
        asks for a ``report`` right away and takes whichever answer comes first; the request
        waits in the socket until the guest opens its port.
        """
        path = os.fspath(socket_path)
        label = label or path
        deadline = time.monotonic() + timeout_s
        last_error = "the socket never accepted a connection"
        awaited = f"no hello from the guest within {timeout_s:g} s"
        while True:
            conn = _Connection(_connect(path, deadline, timeout_s, last_error, label), path, label)
            try:
                conn.send(Request(id=_GREETING_ID, op="report"))
                while True:
                    msg = conn.read(deadline, awaited)
                    if isinstance(msg, Hello):
                        conn.speak(msg.report)
                        conn.send(Ack())
                        _drain_greeting(conn, min(deadline, time.monotonic() + _GREETING_DRAIN_S))
                        return cls(conn, msg.report)
                    if isinstance(msg, Response) and msg.id in (_GREETING_ID, None):
                        if not msg.ok:
                            raise GuestRequestFailed(f"guest on {label} refused a report: {msg.error}", msg.code)
                        report = report_from_body(msg.body, f"{label}: report response")
                        conn.speak(report)
                        return cls(conn, report)
            except GuestChannelClosed as e:
                # QEMU exited or dropped us; a QEMU may (again) listen on the path before the deadline.
                conn.close()
                last_error = str(e)
                time.sleep(_RETRY_CONNECT_S)
            except BaseException:
                conn.close()
                raise

    @classmethod
    def open_with_request(
        cls,
        socket_path: str | os.PathLike[str],
        op: str,
        args: Mapping[str, object],
        *,
        version: int,
        timeout_s: float,
        label: str = "",
    ) -> GuestChannel:
        """Connects and sends ``op``, whose answer is the agent's report, as the first request, for
        a guest whose agent is known already to speak ``version`` (a restored snapshot's): one round
        trip instead of ``open``'s greeting and then the request. The channel's ``report`` is that
        answer. Connecting is retried while the socket is missing or refuses; once sent, the request
        is never sent again (a connection that closes before the answer raises GuestChannelClosed).
        A hello the guest sends before it reads the request is skipped (a request acks it)."""
        path = os.fspath(socket_path)
        label = label or path
        deadline = time.monotonic() + timeout_s
        sock = _connect(path, deadline, timeout_s, "the socket never accepted a connection", label)
        conn = _Connection(sock, path, label)
        try:
            conn.version = max(1, min(VERSION, version))
            body = _ask(conn, _FIRST_ID, op, args, deadline, f"no response to {op!r} within {timeout_s:g} s")
            channel = cls(conn, report_from_body(body, f"{label}: {op} response"))
            next(channel._ids)  # request ids go on after the first one's
            return channel
        except BaseException:
            conn.close()
            raise

    def request(self, op: str, timeout_s: float, args: Mapping[str, object] | None = None) -> Mapping[str, object]:
        """Sends request ``op`` and returns the body of its response. Raises GuestRequestFailed
        when the guest refuses, GuestChannelTimeout / GuestChannelClosed when it does not answer."""
        with self._lock:
            deadline = time.monotonic() + timeout_s
            rid = str(next(self._ids))
            return _ask(self._conn, rid, op, args, deadline, f"no response to {op!r} within {timeout_s:g} s")

    def report_now(self, timeout_s: float) -> GuestReport:
        """A fresh report (the ``report`` request)."""
        return report_from_body(self.request("report", timeout_s), "report response body")

    def close(self) -> None:
        self._conn.close()

    def take_connection(self) -> _Connection:
        """Hands the connection over (to a client that reads it from its own thread); this
        channel must not be used afterwards."""
        return self._conn

    def __enter__(self) -> GuestChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _ask(
    conn: _Connection, rid: str, op: str, args: Mapping[str, object] | None, deadline: float, awaited: str
) -> Mapping[str, object]:
    """Send request ``op`` as ``rid`` and return the body of its response."""
    conn.send(Request(id=rid, op=op, args=dict(args or {})))
    while True:
        msg = conn.read(deadline, awaited)
        if not isinstance(msg, Response):
            continue  # a hello the guest sent before it saw our ack (or our request)
        if msg.id == rid:
            if not msg.ok:
                raise GuestRequestFailed(f"guest refused {op!r} on {conn.label}: {msg.error}", msg.code)
            return msg.body
        if msg.id is None and not msg.ok:
            raise GuestRequestFailed(f"guest could not read {op!r} on {conn.label}: {msg.error}", msg.code)
        # else: the late answer to an earlier request that timed out


def wait_for_hello(socket_path: str | os.PathLike[str], timeout_s: float, label: str = "") -> GuestReport:
    """Connects to the guest channel, waits for the guest's hello (acked) or report, and
    disconnects. Raises GuestChannelTimeout on timeout."""
    with GuestChannel.open(socket_path, timeout_s, label) as channel:
        return channel.report
