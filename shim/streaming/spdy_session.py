"""A server-side SPDY/3 connection over a byte transport (the upgraded socket, or a WebSocket
tunnel): it answers each client stream with SYN_REPLY, echoes PINGs, and hands streams and their
data to a handler, in the reader's thread, so a handler that blocks (stdin into a guest, bytes
into a pod's port) stops the reading of the connection: back-pressure instead of buffers.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Protocol

from vmsandbox import spdy

log = logging.getLogger(__name__)


class ByteTransport(Protocol):
    def recv(self) -> bytes: ...

    def send(self, data: bytes) -> None: ...

    def close(self) -> None: ...


class SpdyStream:
    def __init__(self, conn: SpdyConnection, stream_id: int, headers: Mapping[str, str]) -> None:
        self.conn = conn
        self.id = stream_id
        self.headers = headers
        self.local_closed = False
        self.remote_closed = False

    def write(self, data: bytes) -> None:
        step = spdy.Limits().max_frame // 2
        for i in range(0, len(data), step):
            self.conn.send_frame(spdy.encode_data(self.id, data[i : i + step]))

    def close(self) -> None:
        """Half-closes our side (an empty DATA frame with FIN)."""
        if not self.local_closed:
            self.local_closed = True
            self.conn.send_frame(spdy.encode_data(self.id, b"", fin=True))

    def reset(self, status: int = spdy.CANCEL) -> None:
        self.local_closed = self.remote_closed = True
        self.conn.send_frame(spdy.encode_rst_stream(self.id, status))


class StreamHandler(Protocol):
    def on_stream(self, stream: SpdyStream) -> None: ...

    def on_data(self, stream: SpdyStream, data: bytes, fin: bool) -> None: ...

    def on_reset(self, stream: SpdyStream) -> None: ...


class SpdyConnection:
    def __init__(
        self,
        transport: ByteTransport,
        limits: spdy.Limits | None = None,
        max_streams: int = 256,
    ) -> None:
        self.transport = transport
        self.codec = spdy.HeaderCodec(limits or spdy.Limits())
        self.parser = spdy.FrameParser(self.codec)
        self.streams: dict[int, SpdyStream] = {}
        self.max_streams = max_streams
        self._wlock = threading.Lock()  # header compression state and frame order
        self._last_id = 0
        self.closed = False
        self.error: str | None = None

    def send_frame(self, frame: bytes) -> None:
        with self._wlock:
            self.transport.send(frame)

    def _reply(self, stream_id: int) -> None:
        with self._wlock:
            self.transport.send(spdy.encode_syn_reply(self.codec, stream_id, {}))

    def serve(self, handler: StreamHandler) -> None:
        """Reads until the client closes or breaks the protocol (then GOAWAY)."""
        try:
            while not self.closed:
                data = self.transport.recv()
                if not data:
                    return
                for frame in self.parser.feed(data):
                    self._dispatch(frame, handler)
        except spdy.SpdyError as e:
            self.error = str(e)
            log.info("streaming: closing a SPDY connection: %s", e)
            try:
                self.send_frame(spdy.encode_goaway(self._last_id, spdy.PROTOCOL_ERROR))
            except Exception:  # the peer may be gone already
                log.debug("streaming: GOAWAY not sent", exc_info=True)
        except Exception as e:  # transport gone
            self.error = str(e)
        finally:
            self.closed = True

    def _dispatch(self, frame: spdy.Frame, handler: StreamHandler) -> None:
        if isinstance(frame, spdy.SynStream):
            if frame.stream_id in self.streams or frame.stream_id <= self._last_id or frame.stream_id % 2 == 0:
                raise spdy.SpdyError(f"stream id {frame.stream_id} out of order or reused")
            self._last_id = frame.stream_id
            if len(self.streams) >= self.max_streams:
                self.send_frame(spdy.encode_rst_stream(frame.stream_id, spdy.REFUSED_STREAM))
                return
            stream = SpdyStream(self, frame.stream_id, frame.headers)
            self.streams[frame.stream_id] = stream
            self._reply(frame.stream_id)
            handler.on_stream(stream)
            if frame.fin:
                stream.remote_closed = True
                handler.on_data(stream, b"", True)
        elif isinstance(frame, spdy.Data):
            s = self.streams.get(frame.stream_id)
            if s is None or s.remote_closed:
                self.send_frame(spdy.encode_rst_stream(frame.stream_id, spdy.INVALID_STREAM))
                return
            if frame.fin:
                s.remote_closed = True
            handler.on_data(s, frame.data, frame.fin)
        elif isinstance(frame, spdy.RstStream):
            s = self.streams.pop(frame.stream_id, None)
            if s is not None:
                s.remote_closed = s.local_closed = True
                handler.on_reset(s)
        elif isinstance(frame, spdy.Ping):
            if frame.ping_id % 2 == 1:  # the client's; ours would be even
                self.send_frame(spdy.encode_ping(frame.ping_id))
        elif isinstance(frame, spdy.GoAway):
            self.closed = True
        # SETTINGS, WINDOW_UPDATE, HEADERS, SYN_REPLY, unknown types: nothing to do

    def forget(self, stream: SpdyStream) -> None:
        self.streams.pop(stream.id, None)

    def goaway(self) -> None:
        try:
            self.send_frame(spdy.encode_goaway(self._last_id))
        except Exception:
            log.debug("streaming: GOAWAY not sent", exc_info=True)
