"""SPDY/3 framing as Kubernetes streams use it (``SPDY/3.1`` upgrade, ``moby/spdystream`` clients).

Frames in and out, no IO: ``FrameParser`` turns received bytes into frames with every length
checked against limits; ``encode_*`` build the frames a server sends. Header blocks are
zlib-compressed with the SPDY/3 dictionary, one compression context per direction per
connection, so a ``HeaderCodec`` belongs to one connection. Flow control (WINDOW_UPDATE) is
parsed and ignored: Kubernetes' client neither sends nor honours windows, so the shim bounds
memory by reading a connection only as fast as it can deliver what it read (TCP back-pressure).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

VERSION = 3

SYN_STREAM = 1
SYN_REPLY = 2
RST_STREAM = 3
SETTINGS = 4
PING = 6
GOAWAY = 7
HEADERS = 8
WINDOW_UPDATE = 9

FLAG_FIN = 0x01
FLAG_UNIDIRECTIONAL = 0x02

# RST_STREAM status codes
PROTOCOL_ERROR = 1
INVALID_STREAM = 2
REFUSED_STREAM = 3
CANCEL = 5
INTERNAL_ERROR = 6
STREAM_IN_USE = 8
STREAM_ALREADY_CLOSED = 9

MAX_FRAME_PAYLOAD = (1 << 24) - 1
"""What a 24-bit length can say."""

_WORDS = [
    "options",
    "head",
    "post",
    "put",
    "delete",
    "trace",
    "accept",
    "accept-charset",
    "accept-encoding",
    "accept-language",
    "accept-ranges",
    "age",
    "allow",
    "authorization",
    "cache-control",
    "connection",
    "content-base",
    "content-encoding",
    "content-language",
    "content-length",
    "content-location",
    "content-md5",
    "content-range",
    "content-type",
    "date",
    "etag",
    "expect",
    "expires",
    "from",
    "host",
    "if-match",
    "if-modified-since",
    "if-none-match",
    "if-range",
    "if-unmodified-since",
    "last-modified",
    "location",
    "max-forwards",
    "pragma",
    "proxy-authenticate",
    "proxy-authorization",
    "range",
    "referer",
    "retry-after",
    "server",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "user-agent",
    "vary",
    "via",
    "warning",
    "www-authenticate",
    "method",
    "get",
    "status",
    "200 OK",
    "version",
    "HTTP/1.1",
    "url",
    "public",
    "set-cookie",
    "keep-alive",
    "origin",
]
_TAIL = (
    "100101201202205206300302303304305306307402405406407408409410411412413414415416417502504505"
    "203 Non-Authoritative Information204 No Content301 Moved Permanently400 Bad Request"
    "401 Unauthorized403 Forbidden404 Not Found500 Internal Server Error501 Not Implemented"
    "503 Service UnavailableJan Feb Mar Apr May Jun Jul Aug Sept Oct Nov Dec 00:00:00 "
    "Mon, Tue, Wed, Thu, Fri, Sat, Sun, GMTchunked,text/html,image/png,image/jpg,image/gif,"
    "application/xml,application/xhtml+xml,text/plain,text/javascript,publicprivatemax-age="
    "gzip,deflate,sdchcharset=utf-8charset=iso-8859-1,utf-,*,enq=0."
)
DICTIONARY = b"".join(struct.pack(">I", len(w)) + w.encode() for w in _WORDS) + _TAIL.encode()
"""The SPDY/3 header compression dictionary (draft-mbelshe-httpbis-spdy-00, 2.6.10.1)."""


class SpdyError(Exception):
    """The peer broke the protocol; the connection should end (GOAWAY) or the stream be reset."""

    def __init__(self, message: str, stream_id: int = 0, status: int = PROTOCOL_ERROR) -> None:
        super().__init__(message)
        self.stream_id = stream_id
        self.status = status


@dataclass(frozen=True)
class Limits:
    max_frame: int = 1 << 20
    """Largest frame payload accepted (data or control)."""
    max_header_bytes: int = 16 << 10
    """Largest header block, decompressed."""
    max_headers: int = 64
    """Most name/value pairs in one header block."""


@dataclass(frozen=True)
class Data:
    stream_id: int
    data: bytes
    fin: bool


@dataclass(frozen=True)
class SynStream:
    stream_id: int
    associated_id: int
    priority: int
    headers: Mapping[str, str]
    fin: bool
    unidirectional: bool


@dataclass(frozen=True)
class SynReply:
    stream_id: int
    headers: Mapping[str, str]
    fin: bool


@dataclass(frozen=True)
class Headers:
    stream_id: int
    headers: Mapping[str, str]
    fin: bool


@dataclass(frozen=True)
class RstStream:
    stream_id: int
    status: int


@dataclass(frozen=True)
class Settings:
    entries: tuple[tuple[int, int, int], ...]  # (flags, id, value)


@dataclass(frozen=True)
class Ping:
    ping_id: int


@dataclass(frozen=True)
class GoAway:
    last_stream_id: int
    status: int


@dataclass(frozen=True)
class WindowUpdate:
    stream_id: int
    delta: int


@dataclass(frozen=True)
class Unknown:
    frame_type: int


Frame = Data | SynStream | SynReply | Headers | RstStream | Settings | Ping | GoAway | WindowUpdate | Unknown


def encode_header_block(headers: Mapping[str, str]) -> bytes:
    """The uncompressed name/value block: names lower-cased, one value each."""
    out = [struct.pack(">I", len(headers))]
    for name, value in headers.items():
        n, v = name.lower().encode(), value.encode()
        out += [struct.pack(">I", len(n)), n, struct.pack(">I", len(v)), v]
    return b"".join(out)


def decode_header_block(block: bytes, limits: Limits = Limits()) -> dict[str, str]:
    """Parses an uncompressed name/value block; several values of one name (NUL-separated)
    keep the first, as Kubernetes reads headers with ``Get``."""
    if len(block) < 4:
        raise SpdyError("header block shorter than its count")
    (count,) = struct.unpack_from(">I", block)
    if count > limits.max_headers:
        raise SpdyError(f"header block with {count} pairs (at most {limits.max_headers})")
    pos = 4
    out: dict[str, str] = {}
    for _ in range(count):
        parts = []
        for what in ("name", "value"):
            if pos + 4 > len(block):
                raise SpdyError(f"header block ends inside a {what} length")
            (n,) = struct.unpack_from(">I", block, pos)
            pos += 4
            if n > len(block) - pos:
                raise SpdyError(f"header {what} of {n} bytes runs past the block")
            parts.append(block[pos : pos + n])
            pos += n
        name_b, value_b = parts
        if not name_b:
            raise SpdyError("empty header name")
        try:
            name, value = name_b.decode(), value_b.decode()
        except UnicodeDecodeError:
            raise SpdyError("header name or value is not UTF-8") from None
        if name != name.lower():
            raise SpdyError(f"header name {name[:40]!r} is not lower case")
        if name in out:
            raise SpdyError(f"header {name[:40]!r} twice")
        out[name] = value.split("\0", 1)[0]
    if pos != len(block):
        raise SpdyError("bytes after the last header")
    return out


class HeaderCodec:
    """The two zlib contexts of one connection (SPDY compresses headers across frames)."""

    def __init__(self, limits: Limits = Limits()) -> None:
        self.limits = limits
        self._inflate = zlib.decompressobj(zdict=DICTIONARY)
        self._deflate = zlib.compressobj(zdict=DICTIONARY)

    def compress(self, headers: Mapping[str, str]) -> bytes:
        return self._deflate.compress(encode_header_block(headers)) + self._deflate.flush(zlib.Z_SYNC_FLUSH)

    def decompress(self, data: bytes) -> dict[str, str]:
        try:
            block = self._inflate.decompress(data, self.limits.max_header_bytes + 1)
        except zlib.error as e:
            raise SpdyError(f"header block does not decompress: {e}") from None
        if len(block) > self.limits.max_header_bytes or self._inflate.unconsumed_tail:
            raise SpdyError(f"header block over {self.limits.max_header_bytes} bytes")
        return decode_header_block(block, self.limits)


def _control(frame_type: int, flags: int, payload: bytes) -> bytes:
    return struct.pack(">HHI", 0x8000 | VERSION, frame_type, (flags << 24) | len(payload)) + payload


def encode_data(stream_id: int, data: bytes, fin: bool = False) -> bytes:
    if len(data) > MAX_FRAME_PAYLOAD:
        raise ValueError("data frame too long")
    return struct.pack(">II", stream_id & 0x7FFFFFFF, ((FLAG_FIN if fin else 0) << 24) | len(data)) + data


def encode_syn_stream(
    codec: HeaderCodec, stream_id: int, headers: Mapping[str, str], *, fin: bool = False, associated_id: int = 0
) -> bytes:
    payload = struct.pack(">IIH", stream_id, associated_id, 0) + codec.compress(headers)
    return _control(SYN_STREAM, FLAG_FIN if fin else 0, payload)


def encode_syn_reply(codec: HeaderCodec, stream_id: int, headers: Mapping[str, str], fin: bool = False) -> bytes:
    return _control(SYN_REPLY, FLAG_FIN if fin else 0, struct.pack(">I", stream_id) + codec.compress(headers))


def encode_rst_stream(stream_id: int, status: int) -> bytes:
    return _control(RST_STREAM, 0, struct.pack(">II", stream_id, status))


def encode_ping(ping_id: int) -> bytes:
    return _control(PING, 0, struct.pack(">I", ping_id))


def encode_goaway(last_stream_id: int, status: int = 0) -> bytes:
    return _control(GOAWAY, 0, struct.pack(">II", last_stream_id, status))


def encode_window_update(stream_id: int, delta: int) -> bytes:
    return _control(WINDOW_UPDATE, 0, struct.pack(">II", stream_id, delta))


def encode_settings(entries: tuple[tuple[int, int, int], ...]) -> bytes:
    body = struct.pack(">I", len(entries)) + b"".join(
        struct.pack(">I", (flags << 24) | ident) + struct.pack(">I", value) for flags, ident, value in entries
    )
    return _control(SETTINGS, 0, body)


class FrameParser:
    """Bytes in, frames out. Raises SpdyError for anything malformed or over the limits; after
    that the connection is done (SPDY has no resynchronisation)."""

    def __init__(self, codec: HeaderCodec) -> None:
        self.codec = codec
        self._buf = bytearray()

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def feed(self, data: bytes) -> Iterator[Frame]:
        self._buf += data
        while len(self._buf) >= 8:
            word0, word1 = struct.unpack_from(">II", self._buf)
            flags, length = word1 >> 24, word1 & 0xFFFFFF
            if length > self.codec.limits.max_frame:
                raise SpdyError(f"frame of {length} bytes (at most {self.codec.limits.max_frame})")
            if len(self._buf) < 8 + length:
                return
            payload = bytes(self._buf[8 : 8 + length])
            del self._buf[: 8 + length]
            if word0 & 0x80000000:
                version, frame_type = (word0 >> 16) & 0x7FFF, word0 & 0xFFFF
                if version != VERSION:
                    raise SpdyError(f"SPDY version {version} (this server speaks {VERSION})")
                yield self._control(frame_type, flags, payload)
            else:
                yield Data(word0 & 0x7FFFFFFF, payload, bool(flags & FLAG_FIN))

    def _control(self, frame_type: int, flags: int, p: bytes) -> Frame:
        fin = bool(flags & FLAG_FIN)

        def need(n: int, what: str) -> None:
            if len(p) < n:
                raise SpdyError(f"{what} frame of {len(p)} bytes (needs {n})")

        if frame_type == SYN_STREAM:
            need(10, "SYN_STREAM")
            sid, assoc, prio = struct.unpack_from(">IIB", p)
            sid &= 0x7FFFFFFF
            if sid == 0:
                raise SpdyError("SYN_STREAM for stream 0")
            return SynStream(
                sid,
                assoc & 0x7FFFFFFF,
                prio >> 5,
                self.codec.decompress(p[10:]),
                fin,
                bool(flags & FLAG_UNIDIRECTIONAL),
            )
        if frame_type == SYN_REPLY:
            need(4, "SYN_REPLY")
            (sid,) = struct.unpack_from(">I", p)
            return SynReply(sid & 0x7FFFFFFF, self.codec.decompress(p[4:]), fin)
        if frame_type == HEADERS:
            need(4, "HEADERS")
            (sid,) = struct.unpack_from(">I", p)
            return Headers(sid & 0x7FFFFFFF, self.codec.decompress(p[4:]), fin)
        if frame_type == RST_STREAM:
            need(8, "RST_STREAM")
            sid, status = struct.unpack_from(">II", p)
            return RstStream(sid & 0x7FFFFFFF, status)
        if frame_type == SETTINGS:
            need(4, "SETTINGS")
            (count,) = struct.unpack_from(">I", p)
            if len(p) != 4 + 8 * count:
                raise SpdyError(f"SETTINGS frame of {len(p)} bytes for {count} entries")
            entries = []
            for i in range(count):
                fid, value = struct.unpack_from(">II", p, 4 + 8 * i)
                entries.append((fid >> 24, fid & 0xFFFFFF, value))
            return Settings(tuple(entries))
        if frame_type == PING:
            need(4, "PING")
            return Ping(struct.unpack_from(">I", p)[0])
        if frame_type == GOAWAY:
            need(4, "GOAWAY")
            last = struct.unpack_from(">I", p)[0] & 0x7FFFFFFF
            status = struct.unpack_from(">I", p, 4)[0] if len(p) >= 8 else 0
            return GoAway(last, status)
        if frame_type == WINDOW_UPDATE:
            need(8, "WINDOW_UPDATE")
            sid, delta = struct.unpack_from(">II", p)
            return WindowUpdate(sid & 0x7FFFFFFF, delta & 0x7FFFFFFF)
        return Unknown(frame_type)
