"""``PluginConn``: one NRI plugin's connection, ttrpc both ways over NRI's multiplexer.

It owns the socket, one reader thread and the calls in flight. On logical connection 1 we are
the ttrpc client of the plugin's Plugin service (odd stream ids, one answer per request, each
call with a deadline); on connection 2 we serve the Runtime service (RegisterPlugin,
UpdateContainers) through ``handler``, each request on its own thread, at most
``MAX_SERVED`` at once. With ``plugin_side`` the roles turn round, for vmsandbox as a plugin of
another runtime (``shim.dra.nri_plugin``): we serve the Plugin service on connection 1 and call
the Runtime service on connection 2. Any framing error, EOF or missed deadline closes the connection: NRI
drops a plugin that breaks the protocol or hangs, and so do we. Buffers are bounded by the
framing's maximum sizes (``vmsandbox.ttrpc``).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from shim.nri import wire
from vmsandbox import ttrpc

log = logging.getLogger(__name__)

PLUGIN_SERVICE = "nri.pkg.api.v1alpha1.Plugin"
RUNTIME_SERVICE = "nri.pkg.api.v1alpha1.Runtime"
MAX_SERVED = 4
_READ = 65536

M = TypeVar("M", bound=Message)
Handler = Callable[[str, bytes], bytes]  # (method, request payload) -> response payload; raises PluginCallError


class PluginGone(Exception):
    """The plugin's connection is closed, broke the protocol or missed a deadline."""


class PluginCallError(Exception):
    """The plugin (or we, serving it) answered a call with an error status."""

    def __init__(self, code: int, message: str, *, fatal: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.fatal = fatal  # serving: close the connection once the error is sent


def parse_request(cls: type[M], payload: bytes) -> M:
    """A call's request payload as ``cls``; a malformed one is the caller's INVALID_ARGUMENT."""
    msg = cls()
    try:
        msg.ParseFromString(payload)
    except DecodeError:
        raise PluginCallError(ttrpc.INVALID_ARGUMENT, f"malformed {cls.__name__}") from None
    return msg


class _Call:
    __slots__ = ("done", "response")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.response: wire.Response | None = None


class PluginConn:
    def __init__(
        self,
        sock: socket.socket,
        name: str,
        handler: Handler,
        on_close: Callable[[], None],
        *,
        plugin_side: bool = False,
    ) -> None:
        self.name = name  # for log lines until the plugin registers
        self._sock = sock
        self._handler = handler
        self._on_close = on_close
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._calls: dict[int, _Call] = {}
        self._next_stream = 1
        self._served = threading.BoundedSemaphore(MAX_SERVED)
        self._last_served_stream = 0
        self._closed = False
        self.close_reason = ""
        if plugin_side:
            self._call_conn, self._call_service = ttrpc.RUNTIME_SERVICE_CONN, RUNTIME_SERVICE
            self._serve_conn, self._serve_service = ttrpc.PLUGIN_SERVICE_CONN, PLUGIN_SERVICE
        else:
            self._call_conn, self._call_service = ttrpc.PLUGIN_SERVICE_CONN, PLUGIN_SERVICE
            self._serve_conn, self._serve_service = ttrpc.RUNTIME_SERVICE_CONN, RUNTIME_SERVICE
        self._reader = threading.Thread(target=self._read_loop, name=f"nri-{name}", daemon=True)

    def start(self) -> None:
        self._reader.start()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, reason: str) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.close_reason = reason
            calls = list(self._calls.values())
            self._calls.clear()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        for c in calls:
            c.done.set()
        self._on_close()

    # -- sending ------------------------------------------------------------------------------
    def _send(self, conn_id: int, frame: ttrpc.Frame) -> None:
        data = ttrpc.encode_mux(conn_id, ttrpc.encode_frame(frame))
        with self._send_lock:
            if self._closed:
                raise PluginGone(self.close_reason or "connection closed")
            try:
                self._sock.sendall(data)
            except OSError as exc:
                raise PluginGone(f"cannot write to the plugin: {exc.strerror or exc}") from None

    def call(self, method: str, request: Message, reply: type[M], timeout_s: float) -> M:
        """Call ``method`` of the peer's service (the plugin's Plugin service, or with ``plugin_side``
        the runtime's Runtime service); PluginGone closes the connection."""
        with self._lock:
            if self._closed:
                raise PluginGone(self.close_reason or "connection closed")
            stream = self._next_stream
            self._next_stream += 2
            pending = self._calls[stream] = _Call()
        try:
            req = wire.Request(self._call_service, method, request.SerializeToString(), int(timeout_s * 1e9))
            self._send(self._call_conn, wire.request_frame(stream, req))
        except (PluginGone, ttrpc.ProtocolError) as exc:
            self.close(str(exc))
            raise PluginGone(str(exc)) from None
        if not pending.done.wait(timeout_s):
            self.close(f"{method} got no answer within {timeout_s:g}s")
            raise PluginGone(f"{method} got no answer within {timeout_s:g}s")
        with self._lock:
            self._calls.pop(stream, None)
        response = pending.response
        if response is None:
            raise PluginGone(self.close_reason or "connection closed")
        if response.code != ttrpc.OK:
            raise PluginCallError(response.code, response.message)
        out = reply()
        try:
            out.ParseFromString(response.payload)
        except DecodeError as exc:
            self.close(f"malformed {method} answer: {exc}")
            raise PluginGone(f"malformed {method} answer") from None
        return out

    # -- receiving ----------------------------------------------------------------------------
    def _read_loop(self) -> None:
        trunk = b""
        streams = {ttrpc.PLUGIN_SERVICE_CONN: b"", ttrpc.RUNTIME_SERVICE_CONN: b""}
        reason = "the plugin closed its connection"
        try:
            while True:
                data = self._sock.recv(_READ)
                if not data:
                    break
                chunks, trunk = ttrpc.decode_mux(trunk + data)
                for conn_id, chunk in chunks:
                    if conn_id not in streams:
                        continue  # NRI's multiplexer drops data for connections nobody opened
                    frames, streams[conn_id] = ttrpc.decode_frames(streams[conn_id] + chunk)
                    for frame in frames:
                        if conn_id == self._call_conn:
                            self._answered(frame)
                        else:
                            self._serve(frame)
        except ttrpc.ProtocolError as exc:
            reason = f"protocol error: {exc}"
        except OSError as exc:
            reason = f"connection error: {exc.strerror or exc}"
        self.close(reason)

    def _answered(self, frame: ttrpc.Frame) -> None:
        response = wire.parse_response(frame)
        with self._lock:
            pending = self._calls.get(frame.stream_id)
        if pending is None:
            return  # an answer to a call that timed out (the connection is closing) or never was
        pending.response = response
        pending.done.set()

    def _serve(self, frame: ttrpc.Frame) -> None:
        if frame.type != ttrpc.TYPE_REQUEST:
            raise ttrpc.ProtocolError(
                f"unexpected ttrpc message type {frame.type} on the {self._serve_service} service"
            )
        if frame.stream_id % 2 != 1 or frame.stream_id <= self._last_served_stream:
            raise ttrpc.ProtocolError(f"ttrpc stream id {frame.stream_id} is not odd and increasing")
        self._last_served_stream = frame.stream_id
        request = wire.parse_request(frame)
        if not self._served.acquire(blocking=False):
            self._reply(frame.stream_id, ttrpc.RESOURCE_EXHAUSTED, "too many requests at once", b"")
            return
        threading.Thread(
            target=self._handle, args=(frame.stream_id, request), name=f"nri-{self.name}-serve", daemon=True
        ).start()

    def _handle(self, stream: int, request: wire.Request) -> None:
        try:
            if request.service != self._serve_service:
                self._reply(stream, ttrpc.UNIMPLEMENTED, f"service {request.service[:128]} is not served", b"")
                return
            try:
                payload = self._handler(request.method, request.payload)
            except PluginCallError as exc:
                self._reply(stream, exc.code, exc.message, b"")
                if exc.fatal:
                    self.close(exc.message)
                return
            except Exception:
                log.exception("NRI plugin %s: serving %s failed", self.name, request.method[:64])
                self._reply(stream, ttrpc.INTERNAL, "the runtime failed to serve the request", b"")
                return
            self._reply(stream, ttrpc.OK, "", payload)
        finally:
            self._served.release()

    def _reply(self, stream: int, code: int, message: str, payload: bytes) -> None:
        # a failure means the connection is gone; its reader reports why
        with contextlib.suppress(PluginGone, ttrpc.ProtocolError):
            self._send(self._serve_conn, wire.response_frame(stream, wire.Response(code, message, payload)))
