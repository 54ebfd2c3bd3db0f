"""The streaming server: owns the Exec/PortForward tokens and the live streaming connections.

The CRI RPC stores what it validated under a single-use token and answers
``<base>/{exec|portforward}/<token>``; the client (the kubelet, crictl) connects here and upgrades to
SPDY/3.1 or WebSocket. Threads, as the rest of the shim: one thread per connection (the reader),
plus one per output direction (a guest process's output, a forwarded port's replies); a connection
gets its thread only while fewer than ``max_pending`` connections are still before their token
check (beyond that, it is answered 503 and closed at once), and has ``head_deadline_s`` in all,
from its accept, to send its request head (and, with TLS, finish its handshake) and be admitted
with a valid token: the watchdog closes it then, however slowly its bytes trickle in. Every
blocking step applies back-pressure (a slow client stops the poll of the guest; a guest that does
not read stdin stops the reading of the client), so memory per connection is bounded by the
frame and chunk limits, and admitted connections are capped in total and per pod. One watchdog
thread closes connections idle for ``streaming_idle_timeout_s``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import logging
import socket
import ssl
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Protocol

from shim.config import ShimConfig
from shim.streaming.exec_session import Process, SpdyExec, WebSocketExec
from shim.streaming.portforward import SpdyPortForward, WebSocketPortForward
from shim.streaming.spdy_session import SpdyConnection
from shim.streaming.tokens import TokenCache
from shim.streaming.transport import SocketTransport, WebSocketTransport
from vmsandbox import stream_rules
from vmsandbox.errors import InvalidArgument
from vmsandbox.stream_rules import StreamRequest

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 16 << 10
HEAD_DEADLINE_S = 10.0
"""From a connection's accept to its admission with a valid token, at most (not per read)."""
MAX_PENDING = 64
"""Connections not yet admitted with a valid token, all together; more are refused at once."""
_WATCH_S = 0.25


@dataclass(frozen=True)
class Target:
    """What a token stands for."""

    kind: str  # exec | portforward
    sandbox_id: str
    request: StreamRequest | None = None
    ports: tuple[int, ...] = ()


@dataclass
class _Live:
    sandbox_id: str
    transport: SocketTransport | WebSocketTransport
    started: float = field(default_factory=time.monotonic)


class Backends(Protocol):
    """What sessions need from the rest of the shim (``shim.streaming.backends``)."""

    def start_process(self, req: StreamRequest) -> Process: ...

    def dial(self, sandbox_id: str, port: int) -> socket.socket: ...


def parse_address(address: str) -> tuple[str, int]:
    """``host:port``, ``[v6]:port`` or ``:port`` (loopback)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise InvalidArgument(f"streaming_address {address!r}: expected host:port")
    host = host.strip("[]") or "127.0.0.1"
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise InvalidArgument(f"streaming_address {address!r}: the host must be an IP address") from None
    return host, int(port)


@dataclass(frozen=True)
class Head:
    method: str
    path: str
    query: str
    headers: dict[str, list[str]]
    raw: bytes


class BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


_REASONS = {400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 408: "Request Timeout",
            429: "Too Many Requests", 431: "Request Header Fields Too Large", 500: "Internal Server Error",
            503: "Service Unavailable"}  # fmt: skip


def read_head(sock: socket.socket, deadline: float) -> Head:
    """The request line and headers, at most MAX_HEAD_BYTES, by ``deadline`` (monotonic)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        if len(buf) > MAX_HEAD_BYTES:
            raise BadRequest(431, f"request head over {MAX_HEAD_BYTES} bytes")
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            sock.settimeout(left)
            chunk = sock.recv(4096)
        except TimeoutError:
            raise BadRequest(408, "request head not received in time") from None
        if not chunk:
            raise BadRequest(400, "connection closed before the request head ended")
        buf += chunk
    end = buf.index(b"\r\n\r\n") + 4
    if end > MAX_HEAD_BYTES:
        raise BadRequest(431, f"request head over {MAX_HEAD_BYTES} bytes")
    try:
        lines = buf[:end].decode("latin-1").split("\r\n")
        method, target, version = lines[0].split(" ")
    except ValueError:
        raise BadRequest(400, "malformed request line") from None
    if not version.startswith("HTTP/1."):
        raise BadRequest(400, "not HTTP/1.x")
    headers: dict[str, list[str]] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise BadRequest(400, "malformed header line")
        headers.setdefault(name.lower(), []).append(value.strip())
    if end != len(buf):
        raise BadRequest(400, "data after the request head before the upgrade")
    url = urllib.parse.urlsplit(target)
    return Head(method, url.path, url.query, headers, buf)


def _refuse(sock: socket.socket, message: str) -> None:
    """Answer 503 without waiting on the client (what does not fit its socket buffer is dropped)."""
    with contextlib.suppress(OSError):
        sock.setblocking(False)
        body = message.encode() + b"\n"
        sock.send(
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
            + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
    sock.close()


def send_error(sock: socket.socket, status: int, message: str) -> None:
    body = (message[:500].replace("\r", " ").replace("\n", " ") + "\n").encode("utf-8", "replace")
    head = (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    with contextlib.suppress(OSError):
        sock.sendall(head + body)


class StreamingServer:
    def __init__(self, config: ShimConfig, backends: Backends) -> None:
        self.backends = backends
        self.tokens: TokenCache[Target] = TokenCache(config.streaming_token_ttl_s)
        self.idle_timeout_s = config.streaming_idle_timeout_s
        self.max_total = config.streaming_max_streams
        self.max_per_pod = config.streaming_max_streams_per_pod
        self.max_pending = MAX_PENDING
        self.head_deadline_s = HEAD_DEADLINE_S
        host, port = parse_address(config.streaming_address)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, port))
        self._listener.listen(64)
        self._tls: ssl.SSLContext | None = None
        if config.streaming_tls_cert:
            self._tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            self._tls.load_cert_chain(config.streaming_tls_cert, config.streaming_tls_key)
        bound = self._listener.getsockname()
        shown = f"[{bound[0]}]" if family == socket.AF_INET6 else bound[0]
        self.base_url = f"{'https' if self._tls else 'http'}://{shown}:{bound[1]}"
        self._lock = threading.Lock()
        self._live: dict[int, _Live] = {}
        self._pending: dict[int, tuple[socket.socket, float]] = {}  # not yet admitted: socket, deadline
        self._ids = itertools.count(1)
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    # ---- the RPC side ---------------------------------------------------------------------------

    def url(self, target: Target) -> str:
        return f"{self.base_url}/{target.kind}/{self.tokens.put(target)}"

    # ---- serving --------------------------------------------------------------------------------

    def start(self) -> None:
        for fn, name in ((self._accept_loop, "streaming-accept"), (self._watchdog, "streaming-watchdog")):
            t = threading.Thread(target=fn, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        log.info("streaming server on %s", self.base_url)

    def stop(self) -> None:
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            live = list(self._live.values())
        for item in live:
            item.transport.close()
        for t in self._threads:
            t.join(timeout=5)

    def live_count(self) -> int:
        with self._lock:
            return len(self._live)

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:
                if self._stopping.is_set():
                    return
                time.sleep(0.05)
                continue
            deadline = time.monotonic() + self.head_deadline_s
            with self._lock:
                key = None if len(self._pending) >= self.max_pending else next(self._ids)
                if key is not None:
                    self._pending[key] = (sock, deadline)
            if key is None:
                _refuse(sock, f"too many connections waiting for their request ({self.max_pending}); retry")
                continue
            threading.Thread(
                target=self._connection, args=(sock, key, deadline), name="streaming-conn", daemon=True
            ).start()

    def _watchdog(self) -> None:
        while not self._stopping.wait(_WATCH_S):
            now = time.monotonic()
            with self._lock:
                late = [sock for sock, deadline in self._pending.values() if now > deadline]
                idle = [i for i in self._live.values() if now - i.transport.last_activity > self.idle_timeout_s]
            for sock in late:  # its thread sees the connection end and lets it go
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            for item in idle:
                log.info("streaming: closing a connection of sandbox %s idle for %d s", item.sandbox_id[:12],
                         self.idle_timeout_s)  # fmt: skip
                item.transport.close()

    def _admit(self, pending: int, sandbox_id: str, transport: SocketTransport | WebSocketTransport) -> bool:
        """Connection ``pending`` becomes live (its deadline no longer applies) if there is room."""
        with self._lock:
            if len(self._live) >= self.max_total:
                return False
            if sum(1 for i in self._live.values() if i.sandbox_id == sandbox_id) >= self.max_per_pod:
                return False
            del self._pending[pending]
            self._live[pending] = _Live(sandbox_id, transport)
            return True

    def _connection(self, raw: socket.socket, key: int, deadline: float) -> None:
        sock: socket.socket = raw
        try:
            if self._tls is not None:
                raw.settimeout(max(deadline - time.monotonic(), 0.001))  # the watchdog bounds the whole
                sock = self._tls.wrap_socket(raw, server_side=True)
            self._serve(sock, key, deadline)
        except BadRequest as e:
            send_error(sock, e.status, e.args[0])
        except (OSError, ssl.SSLError) as e:
            log.debug("streaming: connection ended: %s", e)
        except Exception:
            log.exception("streaming: connection failed")
            send_error(sock, 500, "internal error of the streaming server")
        finally:
            with self._lock:
                self._pending.pop(key, None)
            with contextlib.suppress(OSError):
                sock.close()

    def _serve(self, sock: socket.socket, key: int, deadline: float) -> None:
        head = read_head(sock, deadline)
        parts = head.path.strip("/").split("/")
        if len(parts) != 2 or parts[0] not in ("exec", "portforward", "attach"):
            raise BadRequest(404, f"no such streaming endpoint {head.path[:100]!r}")
        if head.method not in ("GET", "POST"):
            raise BadRequest(405, f"method {head.method[:20]} not allowed")
        target = self.tokens.take(parts[1])
        if target is None or target.kind != parts[0]:
            raise BadRequest(404, "unknown, used or expired streaming token: ask the runtime for a new URL")
        upgrade = ",".join(head.headers.get("upgrade", [])).lower()
        transport: SocketTransport | WebSocketTransport
        if "websocket" in upgrade:
            transport = WebSocketTransport(sock)
        elif "spdy/3.1" in upgrade:
            transport = SocketTransport(sock)
        else:
            raise BadRequest(400, "expected an upgrade to SPDY/3.1 or websocket")
        if not self._admit(key, target.sandbox_id, transport):
            raise BadRequest(429, f"too many streaming connections (at most {self.max_total} in all, "
                                  f"{self.max_per_pod} per pod); close one and retry")  # fmt: skip
        sock.settimeout(None)
        try:
            if isinstance(transport, WebSocketTransport):
                self._serve_websocket(transport, head, target)
            else:
                self._serve_spdy(transport, head, target)
        finally:
            with self._lock:
                self._live.pop(key, None)
            transport.close()

    def _serve_spdy(self, transport: SocketTransport, head: Head, target: Target) -> None:
        offered = stream_rules.split_header_list(head.headers.get("x-stream-protocol-version", []))
        if target.kind == "portforward":
            supported: tuple[str, ...] = (stream_rules.PORTFORWARD_PROTOCOL,)
        else:
            supported = stream_rules.REMOTECOMMAND_PROTOCOLS
        protocol = stream_rules.negotiate(offered, supported)
        if protocol is None:
            raise BadRequest(400, f"no stream protocol in common: offered {', '.join(offered)[:200] or 'none'}, "
                                  f"this server speaks {', '.join(supported)}")  # fmt: skip
        transport.send(
            (
                "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: SPDY/3.1\r\n"
                f"X-Stream-Protocol-Version: {protocol}\r\n\r\n"
            ).encode()
        )
        conn = SpdyConnection(transport)
        if target.kind == "portforward":
            SpdyPortForward(conn, self.backends, target.sandbox_id, target.ports).run()
        else:
            assert target.request is not None
            SpdyExec(conn, self.backends, target.request, protocol).run()

    def _serve_websocket(self, transport: WebSocketTransport, head: Head, target: Target) -> None:
        tunnel = stream_rules.SPDY_OVER_WEBSOCKET_PREFIX + stream_rules.PORTFORWARD_PROTOCOL
        if target.kind == "portforward":
            supported: tuple[str, ...] = (tunnel, *stream_rules.WS_PORTFORWARD_PROTOCOLS)
        else:
            supported = stream_rules.WS_REMOTECOMMAND_PROTOCOLS

        def choose(offered: list[str]) -> str | None:
            if not offered and target.kind == "portforward":
                return ""  # no subprotocol: plain port-forward channels, as the kubelet allows
            return stream_rules.negotiate(offered, supported)

        protocol = transport.handshake(head.raw, choose)
        if protocol is None:
            return
        if protocol == tunnel:
            SpdyPortForward(SpdyConnection(transport), self.backends, target.sandbox_id, target.ports).run()
        elif target.kind == "portforward":
            try:
                query = urllib.parse.parse_qs(head.query)
                ports = tuple(stream_rules.query_ports(query)) or target.ports
                if target.ports and set(ports) - set(target.ports):
                    raise InvalidArgument("port-forward: a port in the URL was not named in the PortForward request")
            except InvalidArgument as e:
                transport.close(1008, str(e)[:100])
                return
            WebSocketPortForward(transport, self.backends, target.sandbox_id, ports, protocol).run()
        else:
            assert target.request is not None
            WebSocketExec(transport, self.backends, target.request, protocol).run()
