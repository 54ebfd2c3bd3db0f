"""SPDY/3 framing (``vmsandbox.spdy``): frames and header blocks, checked against the bytes Go's
``moby/spdystream`` client (in crictl) sends, a table of malformed input, and hypothesis fuzzing
(``VMSANDBOX_FUZZ_LONG=1``: 2,000 examples per property instead of 200)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
import zlib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vmsandbox import spdy

EXAMPLES = 2000 if os.environ.get("VMSANDBOX_FUZZ_LONG") == "1" else 200
FIXTURE = Path(__file__).parent.parent / "fixtures" / "spdy" / "crictl-exec-client.bin"


def test_dictionary_is_the_spdy3_one() -> None:
    # length and sha256 of the 1423-byte dictionary of the SPDY/3 draft (as Go's spdy package has it)
    assert len(spdy.DICTIONARY) == 1423
    assert hashlib.sha256(spdy.DICTIONARY).hexdigest() == (
        "51d27341373f923f3cd88e1eb7162aeaa3723d7585ff2399201dc06498407f02"
    )


def _frames(data: bytes) -> list[spdy.Frame]:
    return list(spdy.FrameParser(spdy.HeaderCodec()).feed(data))


def test_frames_from_crictl_exec() -> None:
    """What crictl (cri-tools' Go client) sent after the upgrade, for ``exec -i CID cat`` with
    stdin "hi\\n": SYN_STREAMs for error, stdin, stdout, stderr, then stdin's data and its FIN."""
    frames = _frames(FIXTURE.read_bytes())
    syns = [f for f in frames if isinstance(f, spdy.SynStream)]
    assert [s.headers["streamtype"] for s in syns] == ["error", "stdin", "stdout", "stderr"]
    assert [s.stream_id for s in syns] == [1, 3, 5, 7]
    stdin = [f for f in frames if isinstance(f, spdy.Data) and f.stream_id == 3]
    assert b"".join(f.data for f in stdin) == b"hi\n"
    assert stdin[-1].fin


@pytest.mark.parametrize(
    "frame,expected",
    [
        (spdy.encode_ping(7), spdy.Ping(7)),
        (spdy.encode_goaway(5, 1), spdy.GoAway(5, 1)),
        (spdy.encode_rst_stream(3, spdy.CANCEL), spdy.RstStream(3, spdy.CANCEL)),
        (spdy.encode_window_update(3, 1000), spdy.WindowUpdate(3, 1000)),
        (spdy.encode_data(3, b"abc", fin=True), spdy.Data(3, b"abc", True)),
        (spdy.encode_data(9, b""), spdy.Data(9, b"", False)),
        (spdy.encode_settings(((0, 7, 65536),)), spdy.Settings(((0, 7, 65536),))),
    ],
)
def test_frames_round_trip(frame: bytes, expected: spdy.Frame) -> None:
    assert _frames(frame) == [expected]


def test_headers_round_trip_across_frames_of_one_connection() -> None:
    out, back = spdy.HeaderCodec(), spdy.HeaderCodec()
    parser = spdy.FrameParser(back)
    for sid, h in ((1, {"streamtype": "error"}), (3, {"streamtype": "data", "port": "80", "requestid": "0"})):
        (frame,) = parser.feed(spdy.encode_syn_stream(out, sid, h))
        assert isinstance(frame, spdy.SynStream)
        assert (frame.stream_id, dict(frame.headers)) == (sid, h)


def test_parser_waits_for_whole_frames() -> None:
    parser = spdy.FrameParser(spdy.HeaderCodec())
    data = spdy.encode_data(1, b"x" * 100) + spdy.encode_ping(1)
    got: list[spdy.Frame] = []
    for i in range(len(data)):
        got += parser.feed(data[i : i + 1])
    assert got == [spdy.Data(1, b"x" * 100, False), spdy.Ping(1)]


def _control(frame_type: int, payload: bytes, version: int = 3, flags: int = 0) -> bytes:
    return struct.pack(">HHI", 0x8000 | version, frame_type, (flags << 24) | len(payload)) + payload


def _block(pairs: list[tuple[bytes, bytes]], count: int | None = None) -> bytes:
    out = struct.pack(">I", len(pairs) if count is None else count)
    for n, v in pairs:
        out += struct.pack(">I", len(n)) + n + struct.pack(">I", len(v)) + v
    return out


def _compressed(block: bytes) -> bytes:
    c = zlib.compressobj(zdict=spdy.DICTIONARY)
    return c.compress(block) + c.flush(zlib.Z_SYNC_FLUSH)


def _syn(block: bytes, sid: int = 1) -> bytes:
    return _control(spdy.SYN_STREAM, struct.pack(">IIH", sid, 0, 0) + _compressed(block))


@pytest.mark.parametrize(
    "data,message",
    [
        (_control(spdy.PING, b"", version=2), "SPDY version 2"),
        (_control(spdy.PING, b"\0\0"), "PING frame of 2 bytes"),
        (_control(spdy.RST_STREAM, b"\0\0\0\1"), "RST_STREAM frame of 4 bytes"),
        (_control(spdy.SYN_STREAM, b"\0" * 4), "SYN_STREAM frame of 4 bytes"),
        (_syn(_block([(b"a", b"b")]), sid=0), "stream 0"),
        (_control(spdy.SYN_STREAM, struct.pack(">IIH", 1, 0, 0) + b"not zlib"), "does not decompress"),
        (_syn(_block([(b"A", b"b")])), "not lower case"),
        (_syn(_block([(b"a", b"b"), (b"a", b"c")])), "twice"),
        (_syn(_block([], count=1000)), "1000 pairs"),
        (_syn(_block([(b"", b"x")])), "empty header name"),
        (_syn(_block([(b"a", b"\xff")])), "not UTF-8"),
        (_syn(_block([(b"a", b"b")]) + b"junk"), "bytes after"),
        (_syn(struct.pack(">I", 1) + struct.pack(">I", 50) + b"ab"), "runs past"),
        (_syn(_block([(b"a", b"x" * 20000)])), "over 16384 bytes"),
        (_control(spdy.SETTINGS, struct.pack(">I", 2) + b"\0" * 8), "SETTINGS frame of 12 bytes"),
        (struct.pack(">II", 1, (1 << 20) + 1), "frame of 1048577 bytes"),
    ],
)
def test_malformed_input_is_refused(data: bytes, message: str) -> None:
    with pytest.raises(spdy.SpdyError, match=message):
        _frames(data)


def test_an_unknown_control_type_is_passed_over() -> None:
    assert _frames(_control(42, b"whatever") + spdy.encode_ping(3)) == [spdy.Unknown(42), spdy.Ping(3)]


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=4096))
def test_fuzz_any_bytes_give_frames_or_a_spdy_error(data: bytes) -> None:
    parser = spdy.FrameParser(spdy.HeaderCodec(spdy.Limits(max_frame=4096)))
    try:
        for _ in parser.feed(data):
            pass
    except spdy.SpdyError:
        return
    assert parser.buffered < 8 + 4096


_headers = st.dictionaries(
    st.from_regex(r"[a-z][a-z0-9-]{0,20}", fullmatch=True),
    st.text(max_size=100).filter(lambda v: "\0" not in v),
    max_size=10,
)


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.lists(st.tuples(_headers, st.binary(max_size=300), st.booleans()), max_size=8), st.integers(1, 64))
def test_fuzz_frames_round_trip_however_the_bytes_are_cut(
    streams: list[tuple[dict[str, str], bytes, bool]], cut: int
) -> None:
    out = spdy.HeaderCodec()
    wire = b""
    expected: list[spdy.Frame] = []
    for i, (headers, data, fin) in enumerate(streams):
        sid = 2 * i + 1
        wire += spdy.encode_syn_stream(out, sid, headers) + spdy.encode_data(sid, data, fin)
        expected += [spdy.SynStream(sid, 0, 0, headers, False, False), spdy.Data(sid, data, fin)]
    parser = spdy.FrameParser(spdy.HeaderCodec())
    got: list[spdy.Frame] = []
    for i in range(0, len(wire), cut):
        got += parser.feed(wire[i : i + cut])
    assert got == expected


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.binary(min_size=8, max_size=64), st.integers(0, 63), st.integers(0, 255))
def test_fuzz_a_corrupted_byte_never_escapes_as_another_exception(frame_seed: bytes, pos: int, value: int) -> None:
    codec = spdy.HeaderCodec()
    wire = bytearray(spdy.encode_syn_stream(codec, 1, {"streamtype": "stdin"}) + spdy.encode_data(1, frame_seed))
    wire[pos % len(wire)] = value
    with contextlib.suppress(spdy.SpdyError):
        list(spdy.FrameParser(spdy.HeaderCodec()).feed(bytes(wire)))
