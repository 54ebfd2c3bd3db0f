"""ttrpc framing and NRI's multiplexer (vmsandbox.ttrpc): tables, golden frames from a real Go
plugin (tests/fixtures/nri/plugin-conversation.json, recorded by tests/nri_plugin/capture_frames.py
from containerd/nri's stub), and hypothesis properties (``VMSANDBOX_FUZZ_LONG=1``: 2,000 examples
per property instead of 200)."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gen.nri import api_pb2 as api
from gen.nri import ttrpc_pb2
from shim.nri import wire
from vmsandbox import ttrpc

EXAMPLES = 2000 if os.environ.get("VMSANDBOX_FUZZ_LONG") else 200
GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "nri" / "plugin-conversation.json"

# (frame, its bytes): the header is length, stream id (u32 BE), type, flags (u8)
FRAMES = [
    (ttrpc.Frame(1, ttrpc.TYPE_REQUEST, ttrpc.FLAG_REMOTE_CLOSED, b"ab"), "000000020000000101016162"),
    (ttrpc.Frame(3, ttrpc.TYPE_RESPONSE, 0, b""), "00000000000000030200"),
    (ttrpc.Frame(0xFFFFFFFF, ttrpc.TYPE_DATA, ttrpc.FLAG_NO_DATA, b"\x00"), "00000001ffffffff030400"),
]


@pytest.mark.parametrize(("frame", "hexed"), FRAMES)
def test_frame_encoding(frame: ttrpc.Frame, hexed: str) -> None:
    assert ttrpc.encode_frame(frame).hex() == hexed
    assert ttrpc.decode_frames(bytes.fromhex(hexed)) == ([frame], b"")


@pytest.mark.parametrize(
    ("data", "frames", "rest"),
    [
        (b"", 0, b""),
        (bytes.fromhex("0000000200000001"), 0, bytes.fromhex("0000000200000001")),  # half a header
        (bytes.fromhex("0000000200000001010161"), 0, bytes.fromhex("0000000200000001010161")),  # half a payload
        (bytes.fromhex("000000000000000102000000000000000003020000"), 2, b"\x00"),
    ],
)
def test_decode_keeps_partial_frames(data: bytes, frames: int, rest: bytes) -> None:
    got, left = ttrpc.decode_frames(data)
    assert len(got) == frames
    assert left == rest


def test_oversized_message_is_refused_from_its_header() -> None:
    header = (ttrpc.MAX_MESSAGE + 1).to_bytes(4, "big") + bytes.fromhex("000000010100")
    with pytest.raises(ttrpc.ProtocolError, match="exceeds the maximum"):
        ttrpc.decode_frames(header)
    assert ttrpc.decode_frames((ttrpc.MAX_MESSAGE).to_bytes(4, "big") + bytes.fromhex("000000010100"))[0] == []
    with pytest.raises(ttrpc.ProtocolError):
        ttrpc.encode_frame(ttrpc.Frame(1, 1, 0, b"x" * (ttrpc.MAX_MESSAGE + 1)))


def test_max_message_is_ttrpcs() -> None:
    # channel.go: messageLengthMax = 4 << 20; nri multiplex: maxPayloadSize = 10 + 4 MiB
    assert ttrpc.MAX_MESSAGE == 4 * 1024 * 1024
    assert ttrpc.MUX_MAX_PAYLOAD == 10 + 4 * 1024 * 1024


@pytest.mark.parametrize(
    ("conn", "data", "hexed"),
    [
        (1, b"", ""),
        (2, b"xy", "00000002000000027879"),
        (1, b"z" * 4097, "0000000100001000" + "7a" * 4096 + "00000001000000017a"),
    ],
)
def test_mux_encoding(conn: int, data: bytes, hexed: str) -> None:
    assert ttrpc.encode_mux(conn, data).hex() == hexed
    chunks, rest = ttrpc.decode_mux(bytes.fromhex(hexed))
    assert b"".join(c for _, c in chunks) == data
    assert all(cid == conn for cid, _ in chunks)
    assert rest == b""


def test_mux_refuses_reserved_connection_and_oversized_chunks() -> None:
    with pytest.raises(ttrpc.ProtocolError, match="reserved"):
        ttrpc.encode_mux(0, b"x")
    with pytest.raises(ttrpc.ProtocolError, match="exceeds"):
        ttrpc.decode_mux((1).to_bytes(4, "big") + (ttrpc.MUX_MAX_PAYLOAD + 1).to_bytes(4, "big"))


def test_request_and_response_use_ttrpcs_messages() -> None:
    frame = wire.request_frame(7, wire.Request("svc", "M", b"\x01", 5))
    assert (frame.stream_id, frame.type, frame.flags) == (7, ttrpc.TYPE_REQUEST, 0)
    msg = ttrpc_pb2.Request.FromString(frame.payload)
    assert (msg.service, msg.method, msg.payload, msg.timeout_nano) == ("svc", "M", b"\x01", 5)
    assert wire.parse_request(frame) == wire.Request("svc", "M", b"\x01", 5)
    err = wire.response_frame(7, wire.Response(ttrpc.NOT_FOUND, "gone", b""))
    assert ttrpc_pb2.Response.FromString(err.payload).status.code == ttrpc.NOT_FOUND
    assert wire.parse_response(err) == wire.Response(ttrpc.NOT_FOUND, "gone", b"")
    ok = wire.response_frame(9, wire.Response(ttrpc.OK, "", b"\x02"))
    assert not ttrpc_pb2.Response.FromString(ok.payload).HasField("status")


@pytest.mark.parametrize(
    ("call", "frame"),
    [
        (wire.parse_request, ttrpc.Frame(1, ttrpc.TYPE_RESPONSE, 0, b"")),
        (wire.parse_response, ttrpc.Frame(1, ttrpc.TYPE_REQUEST, 0, b"")),
        (wire.parse_request, ttrpc.Frame(1, ttrpc.TYPE_REQUEST, 0, b"\x0a\xff")),
        (wire.parse_response, ttrpc.Frame(1, ttrpc.TYPE_RESPONSE, 0, b"\x12\x05ab")),
    ],
)
def test_malformed_messages_are_protocol_errors(call: object, frame: ttrpc.Frame) -> None:
    with pytest.raises(ttrpc.ProtocolError):
        call(frame)  # type: ignore[operator]


# -- golden: a real plugin built from containerd/nri's stub ------------------------------------------
def _conversation() -> tuple[dict[int, list[ttrpc.Frame]], list[bytes]]:
    doc = json.loads(GOLDEN.read_text())
    trunk, streams = b"", {1: b"", 2: b""}
    from_plugin: dict[int, list[ttrpc.Frame]] = {1: [], 2: []}
    ours = []
    for entry in doc["trunk"]:
        data = bytes.fromhex(entry["hex"])
        if entry["from"] == "runtime":
            ours.append(data)
            continue
        chunks, trunk = ttrpc.decode_mux(trunk + data)
        for cid, chunk in chunks:
            frames, streams[cid] = ttrpc.decode_frames(streams[cid] + chunk)
            from_plugin[cid] += frames
    assert trunk == b"" and streams == {1: b"", 2: b""}
    return from_plugin, ours


def test_golden_registration_from_a_go_plugin() -> None:
    from_plugin, _ = _conversation()
    [register] = from_plugin[ttrpc.RUNTIME_SERVICE_CONN]
    assert (register.stream_id, register.type, register.flags) == (1, ttrpc.TYPE_REQUEST, 0)
    req = wire.parse_request(register)
    assert (req.service, req.method) == ("nri.pkg.api.v1alpha1.Runtime", "RegisterPlugin")
    reg = api.RegisterPluginRequest.FromString(req.payload)
    assert (reg.plugin_name, reg.plugin_idx, reg.NRI_version) == ("test", "10", "v0.12.2")


def test_golden_answers_from_a_go_plugin() -> None:
    from_plugin, _ = _conversation()
    configure, sync, create = (wire.parse_response(f) for f in from_plugin[ttrpc.PLUGIN_SERVICE_CONN])
    assert [f.stream_id for f in from_plugin[ttrpc.PLUGIN_SERVICE_CONN]] == [1, 3, 5]
    assert configure.code == ttrpc.OK
    # every event the plugin handles: 1-11 and ValidateContainerAdjustment (14)
    assert api.ConfigureResponse.FromString(configure.payload).events == 0x7FF | 1 << (14 - 1)
    assert sync.code == ttrpc.OK
    adjust = api.CreateContainerResponse.FromString(create.payload).adjust
    assert dict(adjust.annotations) == {"example.com/golden": "yes"}
    assert [(kv.key, kv.value) for kv in adjust.env] == [("GOLDEN", "1")]
    assert adjust.linux.resources.memory.limit.value == 134217728
    assert [(r.type, r.soft, r.hard) for r in adjust.rlimits] == [("RLIMIT_NOFILE", 1024, 2048)]


def test_golden_our_frames_decode_as_sent() -> None:
    _, ours = _conversation()
    chunks, rest = ttrpc.decode_mux(b"".join(ours))
    assert rest == b""
    assert [cid for cid, _ in chunks] == [2, 1, 1, 1]
    assert all(len(c) <= ttrpc.MUX_CHUNK for _, c in chunks)


# -- properties -------------------------------------------------------------------------------------
_frames = st.builds(
    ttrpc.Frame,
    st.integers(0, 0xFFFFFFFF),
    st.integers(0, 255),
    st.integers(0, 255),
    st.binary(max_size=300),
)


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.lists(_frames, max_size=6), st.data())
def test_frames_survive_any_split(frames: list[ttrpc.Frame], data: st.DataObject) -> None:
    wire = b"".join(ttrpc.encode_frame(f) for f in frames)
    cut = data.draw(st.integers(0, len(wire)))
    first, rest = ttrpc.decode_frames(wire[:cut])
    second, left = ttrpc.decode_frames(rest + wire[cut:])
    assert first + second == frames
    assert left == b""


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.integers(1, 0xFFFFFFFF), st.binary(max_size=10000), st.data())
def test_mux_survives_any_split(conn: int, payload: bytes, data: st.DataObject) -> None:
    wire = ttrpc.encode_mux(conn, payload)
    cut = data.draw(st.integers(0, len(wire)))
    first, rest = ttrpc.decode_mux(wire[:cut])
    second, left = ttrpc.decode_mux(rest + wire[cut:])
    assert b"".join(c for _, c in first + second) == payload
    assert {cid for cid, _ in first + second} <= {conn}
    assert all(len(c) <= ttrpc.MUX_CHUNK for _, c in first + second)
    assert left == b""


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.binary(max_size=2000))
def test_garbage_is_a_protocol_error_or_frames(data: bytes) -> None:
    for decode in (ttrpc.decode_frames, ttrpc.decode_mux):
        try:
            _items, rest = decode(data)
        except ttrpc.ProtocolError:
            continue
        assert len(rest) <= len(data)
    try:
        frames, _ = ttrpc.decode_frames(data)
    except ttrpc.ProtocolError:
        return
    for f in frames:
        for parse in (wire.parse_request, wire.parse_response):
            with contextlib.suppress(ttrpc.ProtocolError):
                parse(f)


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.text(max_size=50), st.text(max_size=50), st.binary(max_size=200), st.integers(0, 2**63 - 1))
def test_requests_round_trip(service: str, method: str, payload: bytes, timeout: int) -> None:
    req = wire.Request(service, method, payload, timeout)
    assert wire.parse_request(ttrpc.decode_frames(ttrpc.encode_frame(wire.request_frame(5, req)))[0][0]) == req
