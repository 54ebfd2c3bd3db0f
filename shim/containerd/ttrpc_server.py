"""``TtrpcServer``: unary ttrpc calls served on a unix socket (shim mode's containerd-facing edge).

Frames are ``vmsandbox.ttrpc``'s, requests and responses ``shim.nri.wire``'s (ttrpc's own
messages). Each connection has one reader thread; each request runs in a thread of its own, since
containerd holds some calls open for a pod's or a process's whole life (``WaitSandbox``,
``Wait``), at most ``max_calls`` at once per server (beyond: RESOURCE_EXHAUSTED at once), and at
most ``max_connections`` connections (containerd holds about one per pod; one beyond is closed at
once, so a peer's half-sent frames hold at most that many 4 MiB buffers). Replies
are written under the connection's lock, with a send timeout: a peer that stops reading loses its
connection, never another's thread.

A typed error (``vmsandbox.errors``) answers with the gRPC code ``shim.status.code_for`` gives it
(the one mapping), any other exception INTERNAL with a bounded message. A frame that is not a
request, a malformed one, or one announcing more than ttrpc's 4 MiB closes that connection only.
Streams (a request with FLAG_REMOTE_OPEN) are not served: UNIMPLEMENTED.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

from shim.nri import wire
from shim.status import code_for
from vmsandbox import ttrpc, validation
from vmsandbox.errors import VmSandboxError

log = logging.getLogger(__name__)

Handler = Callable[[bytes], bytes]
SEND_TIMEOUT_S = 30
READ_CHUNK = 64 * 1024
ACCEPT_BACKOFF_S = 0.1


class _Conn:
    def __init__(self, server: TtrpcServer, sock: socket.socket) -> None:
        self.server = server
        self.sock = sock
        self._send_lock = threading.Lock()
        self._closed = threading.Event()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", SEND_TIMEOUT_S, 0))

    def run(self) -> None:
        buf = b""
        try:
            while not self._closed.is_set():
                data = self.sock.recv(READ_CHUNK)
                if not data:
                    return
                frames, buf = ttrpc.decode_frames(buf + data)
                for frame in frames:
                    self._request(frame)
        except ttrpc.ProtocolError as exc:
            log.warning("%s: a client broke ttrpc, its connection is closed: %s", self.server.name, exc)
        except OSError:
            pass
        finally:
            self.close()
            self.server._gone(self)

    def _request(self, frame: ttrpc.Frame) -> None:
        request = wire.parse_request(frame)  # a frame that is no request: ProtocolError, the connection closes
        if frame.flags & ttrpc.FLAG_REMOTE_OPEN:
            self.reply(frame.stream_id, ttrpc.UNIMPLEMENTED, "ttrpc streams are not served here", b"")
            return
        method = self.server.services.get(request.service, {}).get(request.method)
        if method is None:
            what = validation.quote(f"{request.service[:128]}/{request.method[:64]}")
            self.reply(frame.stream_id, ttrpc.UNIMPLEMENTED, f"{what} is not served by vmsandbox", b"")
            return
        if not self.server._calls.acquire(blocking=False):
            self.reply(frame.stream_id, ttrpc.RESOURCE_EXHAUSTED, "too many calls in progress", b"")
            return
        threading.Thread(
            target=self._call, args=(frame.stream_id, request, method), name=f"{self.server.name}-call", daemon=True
        ).start()

    def _call(self, stream_id: int, request: wire.Request, method: Handler) -> None:
        try:
            try:
                payload = method(request.payload)
            except (VmSandboxError, NotImplementedError) as exc:
                code = code_for(exc).value[0]
                message = validation.bound(str(exc) or request.method)
                # containerd asks for what is not served again and again (Stats every second): not worth a line each
                level = logging.DEBUG if code == ttrpc.UNIMPLEMENTED else logging.INFO
                log.log(level, "%s %s -> %s: %s", self.server.name, request.method, code_for(exc).name, message)
                self.reply(stream_id, code, message, b"")
                return
            except Exception as exc:
                log.exception("%s %s failed", self.server.name, request.method)
                message = validation.bound(f"{request.method}: internal error: {type(exc).__name__}: {exc}")
                self.reply(stream_id, ttrpc.INTERNAL, message, b"")
                return
            self.reply(stream_id, ttrpc.OK, "", payload)
        finally:
            self.server._calls.release()

    def reply(self, stream_id: int, code: int, message: str, payload: bytes) -> None:
        try:
            data = ttrpc.encode_frame(wire.response_frame(stream_id, wire.Response(code, message, payload)))
        except ttrpc.ProtocolError as exc:  # a reply larger than ttrpc carries
            data = ttrpc.encode_frame(
                wire.response_frame(stream_id, wire.Response(ttrpc.INTERNAL, validation.bound(str(exc)), b""))
            )
        with self._send_lock:
            if self._closed.is_set():
                return
            try:
                self.sock.sendall(data)
            except OSError as exc:
                log.warning("%s: a client stopped reading (%s); its connection is closed", self.server.name, exc)
                self._close_locked()

    def _close_locked(self) -> None:
        if not self._closed.is_set():
            self._closed.set()
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
            self.sock.close()

    def close(self) -> None:
        with self._send_lock:
            self._close_locked()


class TtrpcServer:
    def __init__(
        self,
        path: Path,
        services: Mapping[str, Mapping[str, Handler]],
        *,
        name: str,
        max_calls: int = 4096,
        max_connections: int = 1024,
        on_connection_closed: Callable[[], None] | None = None,
    ) -> None:
        self.path = path
        self.services = services
        self.name = name
        self._calls = threading.BoundedSemaphore(max_calls)
        self.max_connections = max_connections
        self._on_closed = on_connection_closed
        self._lock = threading.Lock()
        self._conns: set[_Conn] = set()
        self._sock: socket.socket | None = None
        self._stopping = threading.Event()

    def start(self) -> None:
        """Listen on ``path`` (0600; a stale socket file is replaced) and accept in a thread."""
        self.path.unlink(missing_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(str(self.path))
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        sock.listen(128)
        self._sock = sock
        threading.Thread(target=self._accept, name=f"{self.name}-accept", daemon=True).start()

    def _accept(self) -> None:
        assert self._sock is not None
        while not self._stopping.is_set():
            try:
                client, _ = self._sock.accept()
            except OSError as exc:
                if self._stopping.is_set():
                    return
                # e.g. EMFILE: the next accept fails alike until something is closed; no busy loop
                log.warning("%s: accept failed: %s", self.name, exc.strerror or exc)
                self._stopping.wait(ACCEPT_BACKOFF_S)
                continue
            with self._lock:
                full = len(self._conns) >= self.max_connections
            if full:
                log.warning("%s: %d connections open, one more is closed", self.name, self.max_connections)
                client.close()
                continue
            conn = _Conn(self, client)
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=conn.run, name=f"{self.name}-conn", daemon=True).start()

    def _gone(self, conn: _Conn) -> None:
        with self._lock:
            known = conn in self._conns
            self._conns.discard(conn)
        if known and self._on_closed is not None and not self._stopping.is_set():
            self._on_closed()

    def connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def close(self) -> None:
        """Stop accepting, close every connection, remove the socket file. Idempotent."""
        self._stopping.set()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
        with self._lock:
            conns = list(self._conns)
            self._conns.clear()
        for c in conns:
            c.close()
        self.path.unlink(missing_ok=True)
