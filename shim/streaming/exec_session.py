"""A streaming Exec over SPDY or WebSocket: the client's stdin and resizes go to a process in the
guest (``Containers.proc_start``), its output comes back from a long poll of the agent; when it
has finished, the error stream carries its exit status (``vmsandbox.stream_rules``) and the
connection closes. Whichever side ends first, the guest process is released (SIGHUP / EOF, then
SIGKILL) so nothing is left running for a client that went away.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from shim.streaming.spdy_session import SpdyConnection, SpdyStream
from vmsandbox import spdy, stream_rules
from vmsandbox.agent_ops import STREAM_READ_MAX, StreamOutput
from vmsandbox.errors import InvalidArgument, VmSandboxError
from vmsandbox.stream_rules import StreamRequest

if TYPE_CHECKING:
    from shim.streaming.server import Backends
    from shim.streaming.transport import WebSocketTransport

log = logging.getLogger(__name__)

POLL_S = 5.0
STREAMS_TIMEOUT_S = 30.0
"""How long a SPDY client may take to open the streams its request asked for."""


class Process(Protocol):
    """A process (Exec) or a container's own stdio (Attach): ``vmsandbox.adapters.agent_streams.AgentStream``."""

    def read(self, max_bytes: int, timeout_s: float) -> StreamOutput: ...

    def write(self, data: bytes) -> bool: ...

    def close_input(self) -> None: ...

    def resize(self, rows: int, cols: int) -> None: ...

    def release(self) -> None: ...


def _describe(e: Exception) -> str:
    return str(e)[:500] or type(e).__name__


class _Output:
    """Pumps a process's output to the client until it finishes or the client is gone."""

    def __init__(
        self,
        proc: Process,
        stdout: Callable[[bytes], None] | None,
        stderr: Callable[[bytes], None] | None,
        finish: Callable[[int, str], None],
    ) -> None:
        self.proc, self.stdout, self.stderr, self.finish = proc, stdout, stderr, finish
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="streaming-exec-out", daemon=True)

    def _run(self) -> None:
        try:
            while not self.stopped.is_set():
                out = self.proc.read(STREAM_READ_MAX, POLL_S)
                if out.stdout and self.stdout is not None:
                    self.stdout(out.stdout)
                if out.stderr and self.stderr is not None:
                    self.stderr(out.stderr)
                if out.done:
                    self.finish(out.exit_code or 0, "")
                    return
        except VmSandboxError as e:
            if not self.stopped.is_set():
                with contextlib.suppress(Exception):
                    self.finish(0, f"exec in the guest failed: {_describe(e)}")
        except Exception as e:  # the client went away (transport closed)
            log.debug("streaming: exec output ended: %s", e)
        finally:
            self.stopped.set()


class SpdyExec:
    """The remotecommand protocols over SPDY: the client opens one stream per ``streamType``."""

    def __init__(self, conn: SpdyConnection, backends: Backends, req: StreamRequest, protocol: str) -> None:
        self.conn, self.backends, self.req, self.protocol = conn, backends, req, protocol
        self.expected = stream_rules.expected_streams(req, protocol)
        self.streams: dict[str, SpdyStream] = {}
        self.proc: Process | None = None
        self.output: _Output | None = None
        self.resizes = stream_rules.ResizeSplitter()
        self.stdin_open = True
        self._timer = threading.Timer(STREAMS_TIMEOUT_S, self._streams_timeout)
        self._timer.daemon = True

    def _streams_timeout(self) -> None:
        if self.proc is None:
            log.info("streaming: exec client did not open its streams in %d s", STREAMS_TIMEOUT_S)
            self.conn.transport.close()

    def run(self) -> None:
        self._timer.start()
        try:
            self.conn.serve(self)
        finally:
            self._timer.cancel()
            if self.output is not None:
                self.output.stopped.set()
            if self.proc is not None:
                with contextlib.suppress(Exception):
                    self.proc.release()
            if self.output is not None:
                self.output.thread.join(timeout=POLL_S + 15)

    # StreamHandler
    def on_stream(self, stream: SpdyStream) -> None:
        kind = stream.headers.get("streamtype", "")
        if kind not in (
            stream_rules.STDIN,
            stream_rules.STDOUT,
            stream_rules.STDERR,
            stream_rules.ERROR,
            stream_rules.RESIZE,
        ):
            stream.reset(spdy.PROTOCOL_ERROR)
            return
        if kind in self.streams:
            stream.reset(spdy.STREAM_IN_USE)
            return
        self.streams[kind] = stream
        if self.proc is None and self.expected <= set(self.streams):
            self._start()

    def _start(self) -> None:
        self._timer.cancel()
        try:
            self.proc = self.backends.start_process(self.req)
        except VmSandboxError as e:
            self._finish(0, _describe(e))
            return
        out, err = self.streams.get(stream_rules.STDOUT), self.streams.get(stream_rules.STDERR)
        self.output = _Output(
            self.proc, out.write if out is not None else None, err.write if err is not None else None, self._finish
        )
        self.output.thread.start()

    def _finish(self, code: int, message: str) -> None:
        for kind in (stream_rules.STDOUT, stream_rules.STDERR):
            s = self.streams.get(kind)
            if s is not None:
                s.close()
        error = self.streams.get(stream_rules.ERROR)
        if error is not None:
            payload = stream_rules.error_stream_payload(self.protocol, code, message)
            if payload:
                error.write(payload)
            error.close()
        self.conn.goaway()
        self.conn.transport.close()

    def on_data(self, stream: SpdyStream, data: bytes, fin: bool) -> None:
        kind = stream.headers.get("streamtype", "")
        if self.proc is None:
            if data:
                log.info("streaming: exec data before its streams were open; ignored")
            return
        try:
            if kind == stream_rules.STDIN:
                if data and self.stdin_open and not self.proc.write(data):
                    self.stdin_open = False
                if fin and self.stdin_open:
                    self.stdin_open = False
                    self.proc.close_input()
            elif kind == stream_rules.RESIZE and data:
                for size in self.resizes.feed(data):
                    self.proc.resize(size.height, size.width)
        except InvalidArgument as e:
            log.info("streaming: %s", e)
            stream.reset(spdy.PROTOCOL_ERROR)
        except VmSandboxError as e:
            log.info("streaming: exec input not delivered: %s", e)

    def on_reset(self, stream: SpdyStream) -> None:
        if stream.headers.get("streamtype") in (stream_rules.STDOUT, stream_rules.ERROR):
            self.conn.transport.close()  # nobody reads the output any more


class WebSocketExec:
    """The remotecommand protocols over WebSocket: one channel byte per message."""

    def __init__(self, ws: WebSocketTransport, backends: Backends, req: StreamRequest, protocol: str) -> None:
        self.ws, self.backends, self.req, self.protocol = ws, backends, req, protocol
        self.resizes = stream_rules.ResizeSplitter()

    def _send(self, channel: int) -> Callable[[bytes], None]:
        def send(data: bytes) -> None:
            self.ws.send_message(stream_rules.ws_encode(self.protocol, channel, data))

        return send

    def _finish(self, code: int, message: str) -> None:
        payload = stream_rules.error_stream_payload(self.protocol, code, message)
        if payload:
            self._send(stream_rules.WS_CHANNELS[stream_rules.ERROR])(payload)
        self.ws.close(1000)

    def run(self) -> None:
        try:
            proc = self.backends.start_process(self.req)
        except VmSandboxError as e:
            self._finish(0, _describe(e))
            return
        ch = stream_rules.WS_CHANNELS
        output = _Output(
            proc,
            self._send(ch[stream_rules.STDOUT]) if self.req.stdout else None,
            self._send(ch[stream_rules.STDERR]) if self.req.stderr else None,
            self._finish,
        )
        output.thread.start()
        stdin_open = self.req.stdin
        try:
            while True:
                msg = self.ws.recv_message()
                if msg is None:
                    return
                try:
                    channel, data = stream_rules.ws_decode(self.protocol, msg)
                    if channel == ch[stream_rules.STDIN] and stdin_open and data:
                        stdin_open = proc.write(data)
                    elif channel == ch[stream_rules.RESIZE] and data:
                        for size in self.resizes.feed(data):
                            proc.resize(size.height, size.width)
                    elif channel == stream_rules.WS_CLOSE_CHANNEL and data[:1] == bytes([0]) and stdin_open:
                        stdin_open = False
                        proc.close_input()
                except InvalidArgument as e:
                    log.info("streaming: %s", e)
                    self.ws.close(1003, str(e)[:100])
                    return
                except VmSandboxError as e:
                    log.info("streaming: exec input not delivered: %s", e)
        finally:
            output.stopped.set()
            with contextlib.suppress(Exception):
                proc.release()
            output.thread.join(timeout=POLL_S + 15)
