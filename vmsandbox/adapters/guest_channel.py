"""Host side of the guest agent channel: a unix socket that QEMU joins to the guest's
virtio-serial port ``io.vmsandbox.agent.0`` (protocol in ``vmsandbox.agent_protocol``).

``wait_for_hello`` is all a sandbox start needs; ``GuestChannel`` keeps the connection for
later requests. Both are safe to use from several threads (one request at a time per channel).
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
    VERSION,
    Ack,
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

MAX_LINE_BYTES = 1 << 20
_GREETING_DRAIN_S = 2.0
_RETRY_CONNECT_S = 0.01
_GREETING_ID = "0"
"""Id of the report request that opens every connection (request ids count up from 1)."""


class GuestChannelTimeout(InfrastructureError):
    """The guest did not answer (or the socket did not appear) in time."""


class GuestChannelClosed(InfrastructureError):
    """The connection to the guest closed (QEMU exited or the guest went away)."""


class GuestRequestFailed(InfrastructureError):
    """The guest answered a request with ``ok: false``."""


class _Connection:
    """Lines over one connected socket; callers serialise access."""

    def __init__(self, sock: socket.socket, path: str) -> None:
        self.sock = sock
        self.path = path
        self._buf = b""
        self.version = 1
        """Protocol version of what we send: 1 (every agent reads it) until the guest has said
        which it speaks, then the highest both sides speak."""

    def speak(self, report: GuestReport) -> None:
        self.version = max(1, min(VERSION, report.protocol))

    def send(self, msg: Ack | Request) -> None:
        try:
            self.sock.sendall(encode(msg, self.version))
        except OSError as e:
            raise GuestChannelClosed(f"guest channel {self.path} closed while sending: {e}") from e

    def read(self, deadline: float, what: str) -> Message:
        """The next message; ``what`` says what was awaited, for the timeout error."""
        while (end := self._buf.find(b"\n")) < 0:
            if len(self._buf) > MAX_LINE_BYTES:
                raise ProtocolError(f"guest channel {self.path}: line longer than {MAX_LINE_BYTES} bytes")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise GuestChannelTimeout(f"{what} on {self.path}")
            self.sock.settimeout(remaining)
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                raise GuestChannelTimeout(f"{what} on {self.path}") from None
            except OSError as e:
                raise GuestChannelClosed(f"guest channel {self.path} failed: {e}") from e
            if not chunk:
                raise GuestChannelClosed(f"guest channel {self.path} closed by the other end")
            self._buf += chunk
        line, self._buf = self._buf[: end + 1], self._buf[end + 1 :]
        try:
            return decode(line)
        except ProtocolError as e:
            raise ProtocolError(f"guest channel {self.path}: {e}") from None

    def close(self) -> None:
        # shutdown first: it wakes a recv() blocked in another thread, close() alone does not.
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def _connect(path: str, deadline: float, timeout_s: float, last_error: str) -> socket.socket:
    """A socket connected to ``path``, retrying while it is missing or refuses (QEMU not up yet)."""
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            return sock
        except OSError as e:
            sock.close()
            if e.errno not in (errno.ENOENT, errno.ECONNREFUSED, errno.EAGAIN):
                raise InfrastructureError(f"cannot connect to guest channel {path}: {e}") from e
            last_error = f"connect: {e.strerror}"
        if time.monotonic() + _RETRY_CONNECT_S >= deadline:
            raise GuestChannelTimeout(f"no hello from the guest on {path} within {timeout_s:g} s ({last_error})")
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
    def open(cls, socket_path: str | os.PathLike[str], timeout_s: float) -> GuestChannel:
        """Connects (retrying while the socket is missing or refuses) and returns once the guest
        has described itself. Raises GuestChannelTimeout when ``timeout_s`` runs out.

        A booting guest greets each host with hello until acked. A guest acked by an earlier
        host greets again only if it saw that host leave, which it misses when the next host
        connects at once (QEMU then tells it "closed" and "open" back to back). So the host also
        asks for a ``report`` right away and takes whichever answer comes first; the request
        waits in the socket until the guest opens its port.
        """
        path = os.fspath(socket_path)
        deadline = time.monotonic() + timeout_s
        last_error = "the socket never accepted a connection"
        awaited = f"no hello from the guest within {timeout_s:g} s"
        while True:
            conn = _Connection(_connect(path, deadline, timeout_s, last_error), path)
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
                            raise GuestRequestFailed(f"guest on {path} refused a report: {msg.error}")
                        report = report_from_body(msg.body, f"report response on {path}")
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

    def request(self, op: str, timeout_s: float) -> Mapping[str, object]:
        """Sends request ``op`` and returns the body of its response. Raises GuestRequestFailed
        when the guest refuses, GuestChannelTimeout / GuestChannelClosed when it does not answer."""
        path = self._conn.path
        with self._lock:
            deadline = time.monotonic() + timeout_s
            rid = str(next(self._ids))
            self._conn.send(Request(id=rid, op=op))
            while True:
                msg = self._conn.read(deadline, f"no response to {op!r} within {timeout_s:g} s")
                if not isinstance(msg, Response):
                    continue  # a hello the guest sent before it saw our ack
                if msg.id == rid:
                    if not msg.ok:
                        raise GuestRequestFailed(f"guest refused {op!r} on {path}: {msg.error}")
                    return msg.body
                if msg.id is None and not msg.ok:
                    raise GuestRequestFailed(f"guest could not read {op!r} on {path}: {msg.error}")
                # else: the late answer to an earlier request that timed out

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


def wait_for_hello(socket_path: str | os.PathLike[str], timeout_s: float) -> GuestReport:
    """Connects to the guest channel, waits for the guest's hello (acked) or report, and
    disconnects. Raises GuestChannelTimeout on timeout."""
    with GuestChannel.open(socket_path, timeout_s) as channel:
        return channel.report
