"""Byte and message transports of one upgraded streaming connection: the raw socket (SPDY) and a
WebSocket (wsproto, sans-IO, driven on the same socket). Sends are serialised per connection;
every read and write marks the connection active, for the server's idle timeout.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Event,
    Ping,
    RejectConnection,
    Request,
    TextMessage,
)

RECV_CHUNK = 64 << 10
MAX_WS_MESSAGE = 1 << 20
"""A client message over this (assembled from its frames) closes the connection."""


class TransportClosed(Exception):
    pass


class SocketTransport:
    """Bytes over the upgraded socket."""

    def __init__(self, sock: socket.socket, initial: bytes = b"") -> None:
        self.sock = sock
        self._pending = initial
        self._wlock = threading.Lock()
        self.last_activity = time.monotonic()
        self.closed = False

    def recv(self) -> bytes:
        """Next bytes; b"" at EOF."""
        if self._pending:
            data, self._pending = self._pending, b""
            return data
        try:
            data = self.sock.recv(RECV_CHUNK)
        except OSError:
            return b""
        self.last_activity = time.monotonic()
        return data

    def send(self, data: bytes) -> None:
        with self._wlock:
            if self.closed:
                raise TransportClosed("connection closed")
            try:
                self.sock.sendall(data)
            except OSError as e:
                raise TransportClosed(str(e)) from None
            self.last_activity = time.monotonic()

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()


class WebSocketTransport:
    """A server-side WebSocket on an accepted socket, after its HTTP head was read."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.ws = WSConnection(ConnectionType.SERVER)
        self._lock = threading.Lock()  # the wsproto state and socket writes
        self._events: list[Event] = []
        self.last_activity = time.monotonic()
        self.closed = False
        self.subprotocol: str | None = None
        self._partial: list[bytes | str] = []
        self._partial_size = 0

    def handshake(self, head: bytes, choose: object) -> str | None:
        """Feeds the request head; ``choose(list of offered subprotocols) -> str | None`` picks one.
        Returns the chosen subprotocol, or None after answering 400 (nothing offered we speak)."""
        assert callable(choose)
        with self._lock:
            self.ws.receive_data(head)
            events = list(self.ws.events())
        request = next((e for e in events if isinstance(e, Request)), None)
        if request is None:
            self._reject(400, b"not a WebSocket upgrade request\n")
            return None
        chosen = choose(list(request.subprotocols))
        if chosen is None:
            offered = ", ".join(request.subprotocols)[:200] or "none"
            self._reject(400, f"no subprotocol in common (offered: {offered})\n".encode())
            return None
        self.subprotocol = chosen
        self._send_event(AcceptConnection(subprotocol=chosen or None))
        return str(chosen)

    def _reject(self, status: int, body: bytes) -> None:
        with contextlib.suppress(Exception):
            self._send_event(
                RejectConnection(
                    status_code=status,
                    headers=[(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())],
                    has_body=True,
                )
            )
            from wsproto.events import RejectData

            self._send_event(RejectData(data=body))

    def _send_event(self, event: Event) -> None:
        with self._lock:
            if self.closed:
                raise TransportClosed("connection closed")
            data = self.ws.send(event)
            try:
                self.sock.sendall(data)
            except OSError as e:
                raise TransportClosed(str(e)) from None
            self.last_activity = time.monotonic()

    def send_message(self, data: bytes | str) -> None:
        self._send_event(BytesMessage(data=data) if isinstance(data, bytes) else TextMessage(data=data))

    def recv_message(self) -> bytes | str | None:
        """The next whole message from the client; None when the connection ends."""
        while True:
            while self._events:
                event = self._events.pop(0)
                if isinstance(event, BytesMessage | TextMessage):
                    self._partial.append(bytes(event.data) if isinstance(event.data, bytearray) else event.data)
                    self._partial_size += len(event.data)
                    if self._partial_size > MAX_WS_MESSAGE:
                        self.close(1009, "message too big")
                        return None
                    if event.message_finished:
                        parts, self._partial, self._partial_size = self._partial, [], 0
                        if isinstance(parts[0], str):
                            return "".join(str(p) for p in parts)
                        return b"".join(p for p in parts if isinstance(p, bytes))
                elif isinstance(event, Ping):
                    with contextlib.suppress(TransportClosed):
                        self._send_event(event.response())
                elif isinstance(event, CloseConnection):
                    with contextlib.suppress(Exception):
                        self._send_event(event.response())
                    return None
            try:
                data = self.sock.recv(RECV_CHUNK)
            except OSError:
                data = b""
            self.last_activity = time.monotonic()
            with self._lock:
                try:
                    self.ws.receive_data(data or None)
                    self._events.extend(self.ws.events())
                except Exception:  # wsproto raises on protocol errors (RemoteProtocolError)
                    return None
            if not data and not self._events:
                return None

    # byte-stream view (SPDY tunnelled in binary messages)
    def recv(self) -> bytes:
        while True:
            msg = self.recv_message()
            if msg is None:
                return b""
            if isinstance(msg, bytes) and msg:
                return msg

    def send(self, data: bytes) -> None:
        self.send_message(data)

    def close(self, code: int = 1000, reason: str = "") -> None:
        with contextlib.suppress(Exception):
            self._send_event(CloseConnection(code=code, reason=reason))
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()
