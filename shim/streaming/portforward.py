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
from vmsandbox import spdy, stream_rules
from vmsandbox.errors import InvalidArgument, VmSandboxError

if TYPE_CHECKING:
    from shim.streaming.server import Backends
    from shim.streaming.transport import WebSocketTransport

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


class WebSocketPortForward:
    """Port-forward over a plain WebSocket (the ports in the URL's ``port`` query, else the
    request's): per port, channel 2i carries data and 2i+1 errors; the server's first message on
    each starts with the port (two bytes, little-endian). Messages are binary (a channel byte, then
    the data) or, for ``v4.base64.channel.k8s.io``, text (the channel as an ASCII digit, then the
    data in base64), as ``streaming.ws_encode`` frames them. One TCP connection per port for the
    life of the WebSocket; it closes when every connection has ended."""

    def __init__(
        self, ws: WebSocketTransport, backends: Backends, sandbox_id: str, ports: tuple[int, ...], protocol: str = ""
    ) -> None:
        self.ws, self.backends, self.sandbox_id, self.ports = ws, backends, sandbox_id, ports
        self.protocol = protocol
        self.socks: list[socket.socket | None] = []
        self.open = 0
        self.lock = threading.Lock()

    def _pump(self, channel: int, sock: socket.socket) -> None:
        try:
            while chunk := sock.recv(CHUNK):
                self.ws.send_message(self._frame(channel, chunk))
        except Exception as e:  # the pod's side or the client's connection ended
            log.debug("streaming: websocket port-forward copy ended: %s", e)
        finally:
            with self.lock:
                self.open -= 1
                last = self.open == 0
            if last:
                self.ws.close(1000)

    def _frame(self, channel: int, data: bytes) -> bytes | str:
        return stream_rules.ws_encode(self.protocol, channel, data)

    def run(self) -> None:
        if not self.ports:
            self.ws.close(1008, "no port to forward: name one with ?port=N")
            return
        try:
            for i, port in enumerate(self.ports):
                prefix = stream_rules.ws_port_prefix(port)
                self.ws.send_message(self._frame(2 * i, prefix))
                self.ws.send_message(self._frame(2 * i + 1, prefix))
                try:
                    sock = self.backends.dial(self.sandbox_id, port)
                except (VmSandboxError, OSError) as e:
                    self.ws.send_message(self._frame(2 * i + 1, f"error forwarding port {port}: {e}"[:1024].encode()))
                    self.socks.append(None)
                    continue
                self.socks.append(sock)
                with self.lock:
                    self.open += 1
                threading.Thread(target=self._pump, args=(2 * i, sock), name="streaming-pf", daemon=True).start()
            if not any(self.socks):
                self.ws.close(1000)
                return
            while (msg := self.ws.recv_message()) is not None:
                try:
                    channel, data = stream_rules.ws_decode(self.protocol, msg)
                except InvalidArgument:
                    continue  # a message of the other framing, or empty: nothing to forward
                if channel < 0 or channel % 2 or channel // 2 >= len(self.socks):
                    continue  # error-channel or unknown-channel messages carry nothing to forward
                target = self.socks[channel // 2]
                if target is not None and data:
                    target.sendall(data)
        except Exception as e:
            log.debug("streaming: websocket port-forward ended: %s", e)
        finally:
            for s in self.socks:
                if s is not None:
                    with contextlib.suppress(OSError):
                        s.shutdown(socket.SHUT_RDWR)
                    s.close()


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
            port = stream_rules.parse_port(stream.headers.get("port", ""))
            if self.ports and port not in self.ports:
                raise InvalidArgument(f"port-forward: port {port} was not named in the PortForward request")
        except InvalidArgument as e:
            if kind == stream_rules.ERROR:
                stream.write(str(e).encode())
                stream.close()
            else:
                stream.reset(spdy.PROTOCOL_ERROR)
            return
        if kind not in (stream_rules.ERROR, stream_rules.DATA):
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
        if kind == stream_rules.DATA:
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
        if stream.headers.get("streamtype") != stream_rules.DATA:
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
