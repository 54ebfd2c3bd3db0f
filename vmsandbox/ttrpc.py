"""ttrpc framing and NRI's connection multiplexer, as pure encode/decode functions.

ttrpc (github.com/containerd/ttrpc, channel.go) frames every message with a 10-byte header:
length (u32 BE, payload only), stream id (u32 BE), type (u8: 1 request, 2 response, 3 data),
flags (u8); payloads are at most 4 MiB. A request's payload is a ``ttrpc.Request`` protobuf
(service, method, payload, timeout), a response's a ``ttrpc.Response`` (google.rpc.Status,
payload); those are encoded at the edge (``shim.nri.wire``), since the core holds no protobuf.
Clients number their streams with odd ids, each higher than the last.

NRI runs ttrpc both ways over one connection (nri pkg/net/multiplex): each chunk on the trunk
is an 8-byte header (logical connection id u32 BE, length u32 BE) and that many bytes of the
connection's stream. Connection 1 carries the Plugin service (the plugin serves, the runtime
calls), connection 2 the Runtime service (the runtime serves RegisterPlugin and
UpdateContainers). The Go side reads each logical connection through a 4096-byte buffered
reader that refuses a chunk larger than its free buffer, so chunks we send are at most
``MUX_CHUNK`` bytes. Nothing here does IO; the callers own sockets and buffers.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

HEADER_LEN = 10
MAX_MESSAGE = 4 << 20
TYPE_REQUEST = 1
TYPE_RESPONSE = 2
TYPE_DATA = 3
FLAG_REMOTE_CLOSED = 0x1
FLAG_REMOTE_OPEN = 0x2
FLAG_NO_DATA = 0x4

MUX_HEADER_LEN = 8
MUX_MAX_PAYLOAD = HEADER_LEN + MAX_MESSAGE
MUX_CHUNK = 4096
PLUGIN_SERVICE_CONN = 1
RUNTIME_SERVICE_CONN = 2

# gRPC status codes ttrpc carries in google.rpc.Status
OK = 0
CANCELLED = 1
UNKNOWN = 2
INVALID_ARGUMENT = 3
DEADLINE_EXCEEDED = 4
NOT_FOUND = 5
ALREADY_EXISTS = 6
PERMISSION_DENIED = 7
RESOURCE_EXHAUSTED = 8
FAILED_PRECONDITION = 9
UNIMPLEMENTED = 12
INTERNAL = 13
UNAVAILABLE = 14

_HEADER = struct.Struct(">IIBB")
_MUX_HEADER = struct.Struct(">II")


class ProtocolError(Exception):
    """The peer broke ttrpc or the multiplexer's framing; the connection cannot go on."""


@dataclass(frozen=True)
class Frame:
    stream_id: int
    type: int
    flags: int
    payload: bytes


def encode_frame(frame: Frame) -> bytes:
    if len(frame.payload) > MAX_MESSAGE:
        raise ProtocolError(f"ttrpc message of {len(frame.payload)} bytes exceeds the maximum of {MAX_MESSAGE}")
    if not 0 <= frame.stream_id <= 0xFFFFFFFF or not 0 <= frame.type <= 0xFF or not 0 <= frame.flags <= 0xFF:
        raise ProtocolError("ttrpc header field out of range")
    return _HEADER.pack(len(frame.payload), frame.stream_id, frame.type, frame.flags) + frame.payload


def decode_frames(buf: bytes) -> tuple[list[Frame], bytes]:
    """Every whole frame at the start of ``buf``, and the bytes left over (a partial frame).

    A header announcing more than ``MAX_MESSAGE`` is refused at once, before its payload is
    buffered, so a peer cannot make us hold more than one maximal message per connection.
    """
    frames = []
    at = 0
    while len(buf) - at >= HEADER_LEN:
        length, stream_id, kind, flags = _HEADER.unpack_from(buf, at)
        if length > MAX_MESSAGE:
            raise ProtocolError(f"ttrpc message of {length} bytes exceeds the maximum of {MAX_MESSAGE}")
        if len(buf) - at - HEADER_LEN < length:
            break
        start = at + HEADER_LEN
        frames.append(Frame(stream_id, kind, flags, bytes(buf[start : start + length])))
        at = start + length
    return frames, bytes(buf[at:])


def encode_mux(conn_id: int, data: bytes) -> bytes:
    """``data`` on logical connection ``conn_id``, in chunks of at most ``MUX_CHUNK`` bytes."""
    if not 1 <= conn_id <= 0xFFFFFFFF:
        raise ProtocolError(f"multiplexer connection id {conn_id} is reserved or out of range")
    out = bytearray()
    for at in range(0, len(data), MUX_CHUNK):
        chunk = data[at : at + MUX_CHUNK]
        out += _MUX_HEADER.pack(conn_id, len(chunk))
        out += chunk
    return bytes(out)


def decode_mux(buf: bytes) -> tuple[list[tuple[int, bytes]], bytes]:
    """Every whole chunk at the start of ``buf`` as (connection id, bytes), and the rest."""
    chunks = []
    at = 0
    while len(buf) - at >= MUX_HEADER_LEN:
        conn_id, length = _MUX_HEADER.unpack_from(buf, at)
        if length > MUX_MAX_PAYLOAD:
            raise ProtocolError(f"multiplexer chunk of {length} bytes exceeds the maximum of {MUX_MAX_PAYLOAD}")
        if len(buf) - at - MUX_HEADER_LEN < length:
            break
        start = at + MUX_HEADER_LEN
        chunks.append((conn_id, bytes(buf[start : start + length])))
        at = start + length
    return chunks, bytes(buf[at:])
