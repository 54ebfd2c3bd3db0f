"""PortForward over SPDY (also tunnelled in a WebSocket): per forwarded connection the client opens
an ``error`` and a ``data`` stream with the same ``requestID`` and a ``port``; the data stream is
joined to a TCP connection to that port of the pod (``Backends.dial``). A failure to connect is
written on the error stream. Client bytes are written to the pod's socket from the reader thread
(back-pressure on the client); the pod's replies come back from one thread per connection.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shim.streaming.spdy_session import SpdyConnection, SpdyStream
from vmsandbox import spdy, streaming
from vmsandbox.errors import InvalidArgument, VmSandboxError

if TYPE_CHECKING:
    from shim.streaming.server import Backends

log = logging.getLogger(__name__)

MAX_PAIRS = 64
"""Forwarded connections at once on one streaming connection."""
CHUNK = 64 << 10


@dataclass
class _Pair:
    port: int
    error: SpdyStream | None = None
    data: SpdyStream | None = None
    sock: socket.socket | None = None
    ready: threading.Event = field(default_factory=threading.Event)
    failed: bool = False


class SpdyPortForward:
    def __init__(self, conn: SpdyConnection, backends: Backends, sandbox_id: str, ports: tuple[int, ...] = ()) -> None:
        self.conn, self.backends, self.sandbox_id = conn, backends, sandbox_id
        self.ports = frozenset(ports)
        """The ports the PortForward request named; none named: any port."""
        self.pairs: dict[str, _Pair] = {}
        self.lock = threading.Lock()

    def run(self) -> None:
        try:
            self.conn.serve(self)
        finally:
            with self.lock:
                pairs = list(self.pairs.values())
                self.pairs.clear()
            for p in pairs:
                self._close_sock(p)

    @staticmethod
    def _close_sock(p: _Pair) -> None:
        p.failed = True
        p.ready.set()
        if p.sock is not None:
            with contextlib.suppress(OSError):
                p.sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                p.sock.close()

    def on_stream(self, stream: SpdyStream) -> None:
        kind = stream.headers.get("streamtype", "")
        request_id = stream.headers.get("requestid", "")[:64]
        try:
            port = streaming.parse_port(stream.headers.get("port", ""))
            if self.ports and port not in self.ports:
                raise InvalidArgument(f"port-forward: port {port} was not named in the PortForward request")
        except InvalidArgument as e:
            if kind == streaming.ERROR:
                stream.write(str(e).encode())
                stream.close()
            else:
                stream.reset(spdy.PROTOCOL_ERROR)
            return
        if kind not in (streaming.ERROR, streaming.DATA):
            stream.reset(spdy.PROTOCOL_ERROR)
            return
        with self.lock:
            pair = self.pairs.get(request_id)
            if pair is None:
                if len(self.pairs) >= MAX_PAIRS:
                    stream.reset(spdy.REFUSED_STREAM)
                    return
                pair = self.pairs[request_id] = _Pair(port)
        if pair.port != port or getattr(pair, kind) is not None:
            stream.reset(spdy.PROTOCOL_ERROR)
            return
        setattr(pair, kind, stream)
        if kind == streaming.DATA:
            threading.Thread(target=self._connect, args=(request_id, pair), name="streaming-pf", daemon=True).start()

    def _fail(self, request_id: str, pair: _Pair, message: str) -> None:
        log.info("streaming: port-forward to port %d of sandbox %s: %s", pair.port, self.sandbox_id[:12], message)
        with contextlib.suppress(Exception):
            if pair.error is not None:
                pair.error.write(message.encode()[:1024])
                pair.error.close()
            if pair.data is not None:
                pair.data.close()
        self._end(request_id, pair)

    def _end(self, request_id: str, pair: _Pair) -> None:
        self._close_sock(pair)
        with self.lock:
            if self.pairs.get(request_id) is pair:
                del self.pairs[request_id]
        for s in (pair.error, pair.data):
            if s is not None:
                self.conn.forget(s)

    def _connect(self, request_id: str, pair: _Pair) -> None:
        try:
            pair.sock = self.backends.dial(self.sandbox_id, pair.port)
        except (VmSandboxError, OSError) as e:
            pair.failed = True
            pair.ready.set()
            self._fail(request_id, pair, f"error forwarding port {pair.port} to the pod: {str(e)[:300]}")
            return
        pair.ready.set()
        data = pair.data
        assert data is not None
        try:
            while True:
                chunk = pair.sock.recv(CHUNK)
                if not chunk:
                    break
                data.write(chunk)
            data.close()
            if pair.error is not None:
                pair.error.close()
        except Exception as e:  # the pod's socket or the client's connection ended
            log.debug("streaming: port-forward copy ended: %s", e)
        finally:
            self._end(request_id, pair)

    def on_data(self, stream: SpdyStream, data: bytes, fin: bool) -> None:
        if stream.headers.get("streamtype") != streaming.DATA:
            return  # the client writes nothing useful on the error stream
        pair = self.pairs.get(stream.headers.get("requestid", "")[:64])
        if pair is None or pair.data is not stream:
            return
        pair.ready.wait(30)
        if pair.failed or pair.sock is None:
            return
        try:
            if data:
                pair.sock.sendall(data)
            if fin:
                pair.sock.shutdown(socket.SHUT_WR)
        except OSError as e:
            log.debug("streaming: port-forward write ended: %s", e)

    def on_reset(self, stream: SpdyStream) -> None:
        pair = self.pairs.get(stream.headers.get("requestid", "")[:64])
        if pair is not None:
            self._close_sock(pair)
