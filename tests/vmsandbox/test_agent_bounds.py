"""Bounds on what the host reads from a guest agent (vmsandbox.agent_protocol, pure) and the real
line reader of vmsandbox.adapters.guest_channel over a socketpair: frame length, nesting depth
(checked before json.loads recurses), numbers that must fit their fields, what a report may hold,
and the budget of unsolicited messages."""

from __future__ import annotations

import base64
import contextlib
import json
import socket
import threading
import time
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fake_guest import report_body
from vmsandbox import agent_protocol as ap
from vmsandbox.adapters.guest_channel import CHUNK_BYTES, GuestChannelClosed, _Connection
from vmsandbox.agent_ops import container_state_from_body, exec_result_from_body
from vmsandbox.agent_protocol import (
    MAX_DEPTH,
    MAX_FRAME_BYTES,
    FrameTooLong,
    GuestReport,
    Hello,
    ProtocolError,
    Response,
    UnsolicitedBudget,
    decode,
    encode,
    nesting_depth,
)

REPORT_BODY = report_body()
STATE_BODY = {
    "id": "c1",
    "state": "running",
    "pid": 12,
    "exit_code": 0,
    "signal": 0,
    "oom_killed": False,
    "created_at_ns": 1,
    "started_at_ns": 2,
    "finished_at_ns": 0,
}


def line(obj: object) -> bytes:
    return json.dumps(obj).encode() + b"\n"


# ---- nesting depth -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "depth"),
    [
        (b"", 0),
        (b"1", 0),
        (b"{}", 1),
        (b'{"a":[1,{"b":[]}]}', 4),
        (b'{"a":"[[[[{{{{"}', 1),
        (b'{"a":"\\"[[[["}', 1),  # an escaped quote does not end the string
        (b'{"a":"\\\\"}[[', 2),  # an escaped backslash does: the brackets after it count
        (b'"[[[[', 0),  # an unterminated string runs to the end
        (b"]]][[", 0),
        (b"[]" * 1000, 1),
        (b"[" * 10 + b"]" * 10, 10),
    ],
)
def test_nesting_depth(text: bytes, depth: int) -> None:
    assert nesting_depth(text, limit=1000) == depth


def _reference_depth(text: bytes) -> int:
    """The depth by a plain character walk (the definition nesting_depth must agree with)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == ord("\\"):
                escaped = True
            elif ch == ord('"'):
                in_string = False
        elif ch == ord('"'):
            in_string = True
        elif ch in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in b"]}":
            depth -= 1
    return deepest


@settings(max_examples=300, deadline=None)
@given(text=st.lists(st.sampled_from([b"[", b"]", b"{", b"}", b'"', b"\\", b"a", b"\n", b":"]), max_size=200))
def test_nesting_depth_agrees_with_a_character_walk(text: list[bytes]) -> None:
    data = b"".join(text)
    ref = _reference_depth(data)
    assert nesting_depth(data, limit=8) == (ref if ref <= 8 else 9)


def test_nesting_depth_refuses_more_brackets_than_any_message_holds() -> None:
    with pytest.raises(ProtocolError, match="more than 65536 arrays and objects"):
        nesting_depth(b"[]" * (1 << 16))


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 1000, 200_000])
def test_deep_nesting_is_a_protocol_error_not_a_recursion_error(depth: int) -> None:
    body = "[" * depth + "]" * depth
    data = f'{{"v":2,"type":"response","id":"1","ok":true,"body":{{"x":{body}}}}}'.encode()
    with pytest.raises(ProtocolError, match=f"deeper than {MAX_DEPTH} levels|more than 65536 arrays and objects"):
        decode(data)


def test_nesting_at_the_limit_decodes() -> None:
    inner = "[" * (MAX_DEPTH - 2) + "]" * (MAX_DEPTH - 2)
    msg = decode(f'{{"v":2,"type":"response","id":"1","ok":true,"body":{{"x":{inner}}}}}'.encode())
    assert isinstance(msg, Response)


# ---- what a message may hold ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        pytest.param(b'{"v":2,"type":"ack","n":' + b"9" * 5000 + b"}", "not JSON", id="int-too-many-digits"),
        pytest.param(b'{"v":2,"type":"ack","n":NaN}', "not JSON", id="nan"),
        pytest.param(b'{"v":2,"type":"ack","n":-Infinity}', "not JSON", id="infinity"),
        pytest.param(b'{"v":"' + b"x" * 100_000 + b'","type":"ack"}', "unsupported protocol version", id="huge-v"),
        pytest.param(
            line({"v": 2, "type": "hello", "body": {**REPORT_BODY, "cmdline": "x" * 5000}}),
            "'cmdline' is longer than 4096",
            id="report-cmdline",
        ),
        pytest.param(
            line({"v": 2, "type": "hello", "body": {**REPORT_BODY, "errors": ["e"] * 65}}),
            "'errors' may hold 64 strings",
            id="report-errors",
        ),
        pytest.param(
            line({"v": 2, "type": "hello", "body": {**REPORT_BODY, "instance": "ZZ" * 16}}),
            "'instance' must be 16 to 64 lowercase hex",
            id="report-instance",
        ),
        pytest.param(
            line({"v": 2, "type": "hello", "body": {**REPORT_BODY, "vcpus": 1 << 40}}),
            "'vcpus' must be at most 2147483647",
            id="report-vcpus",
        ),
        pytest.param(
            line({"v": 2, "type": "hello", "body": {**REPORT_BODY, "nics": [{"name": "e", "mac": "m"}] * 65}}),
            "more than 64 nics",
            id="report-nics",
        ),
        pytest.param(
            line({"v": 2, "type": "hello", "body": {**REPORT_BODY, "hugepages": {"1" * 30: {"total": 1, "free": 1}}}}),
            "is not a positive KiB count",
            id="report-hugepage-size",
        ),
    ],
)
def test_decode_bounds(data: bytes, problem: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode(data)
    assert problem in str(info.value)
    assert len(str(info.value)) < 1024


def test_frame_longer_than_the_limit_is_refused_before_parsing() -> None:
    with pytest.raises(FrameTooLong):
        decode(b" " * (MAX_FRAME_BYTES + 1))


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"exit_code": 1 << 31}, "'exit_code' must be at most 2147483647"),
        ({"pid": 1 << 40}, "'pid' must be at most"),
        ({"finished_at_ns": 1 << 63}, "'finished_at_ns' must be at most 9223372036854775807"),
        ({"id": "c" * 129}, "'id' is longer than 128"),
        ({"state": "x" * 10_000}, "unknown container state"),
    ],
)
def test_container_state_numbers_fit_their_fields(changes: dict[str, object], problem: str) -> None:
    with pytest.raises(ProtocolError, match=problem) as info:
        container_state_from_body({**STATE_BODY, **changes})
    assert len(str(info.value)) < 256


def test_exec_output_is_bounded_and_base64_checked() -> None:
    body = {"exit_code": 0, "timed_out": False, "dropped_bytes": 0}
    with pytest.raises(ProtocolError, match="holds more than 16777216 bytes"):
        exec_result_from_body({**body, "stdout": "A" * (4 * ((16 << 20) // 3 + 2))})
    with pytest.raises(ProtocolError, match="not base64"):
        exec_result_from_body({**body, "stdout": "é"})


def test_error_text_is_cut_and_code_read() -> None:
    msg = decode(line({"v": 2, "type": "response", "id": "1", "ok": False, "error": "e" * 100_000, "code": "x"}))
    assert isinstance(msg, Response)
    assert len(msg.error) < 2100 and msg.error.endswith("characters)")
    assert msg.code == "x"
    unknown = Response("2", False, error='no container "c"', code=ap.UNKNOWN_CONTAINER)
    assert decode(encode(unknown)) == unknown


def test_instance_round_trips_and_is_optional() -> None:
    report = ap.report_from_body(REPORT_BODY)
    assert report.instance == REPORT_BODY["instance"]
    assert decode(encode(Hello(report))) == Hello(report)
    older = {k: v for k, v in REPORT_BODY.items() if k != "instance"}
    assert ap.report_from_body(older).instance == ""
    assert "instance" not in ap.report_to_body(GuestReport("a", "k", 1, 0, {}, "", 0))


# ---- the budget of unsolicited messages ------------------------------------------------------------------


def test_unsolicited_budget_allows_a_burst_then_its_rate() -> None:
    budget: UnsolicitedBudget | None = UnsolicitedBudget(at=100.0)
    for _ in range(ap.UNSOLICITED_BURST):
        assert budget is not None
        budget = budget.spend(100.0)
    assert budget is not None and budget.spend(100.0) is None
    later = budget.spend(101.0)  # one second refills UNSOLICITED_PER_S
    for _ in range(int(ap.UNSOLICITED_PER_S) - 1):
        assert later is not None
        later = later.spend(101.0)
    assert later is not None and later.spend(101.0) is None
    assert budget.spend(99.0) is None  # a clock that goes back refills nothing


# ---- the real reader over a socketpair ----------------------------------------------------------------


def _pair() -> tuple[_Connection, socket.socket]:
    host, guest = socket.socketpair()
    return _Connection(host, "pair", "sandbox 0123456789ab"), guest


def _feed(sock: socket.socket, data: bytes) -> threading.Thread:
    def run() -> None:
        with contextlib.suppress(OSError):  # the host hung up at its limit
            sock.sendall(data)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_the_largest_legitimate_response_is_read() -> None:
    """ExecSync's 16 MiB of output per stream, base64-encoded, in one line."""
    out = base64.b64encode(b"\xff" * (16 << 20)).decode()
    data = line(
        {
            "v": 2,
            "type": "response",
            "id": "1",
            "ok": True,
            "body": {"exit_code": 0, "stdout": out, "stderr": out, "timed_out": False, "dropped_bytes": 0},
        }
    )
    assert len(data) < MAX_FRAME_BYTES
    conn, guest = _pair()
    feeder = _feed(guest, data)
    start = time.monotonic()
    msg = conn.read(time.monotonic() + 30, "the response")
    assert time.monotonic() - start < 10
    assert isinstance(msg, Response)
    assert exec_result_from_body(msg.body).stdout == b"\xff" * (16 << 20)
    feeder.join(timeout=10)
    conn.close()
    guest.close()


def test_an_endless_line_is_cut_off_at_the_limit_in_bounded_memory() -> None:
    conn, guest = _pair()
    chunk = b"x" * (4 << 20)

    def endless() -> None:
        with contextlib.suppress(OSError):  # until the host hangs up
            while True:
                guest.sendall(chunk)

    feeder = threading.Thread(target=endless, daemon=True)
    tracemalloc.start()
    try:
        feeder.start()
        with pytest.raises(FrameTooLong, match=r"^sandbox 0123456789ab: .*longer than \d+ bytes; disconnected$"):
            conn.read(time.monotonic() + 60, "the response")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert conn.buffered <= MAX_FRAME_BYTES + 1
    assert peak < MAX_FRAME_BYTES * 1.5 + 2 * CHUNK_BYTES + len(chunk), f"peak {peak >> 20} MiB"
    conn.close()
    feeder.join(timeout=10)
    assert not feeder.is_alive()
    guest.close()


def test_lines_split_across_reads_and_several_in_one_read() -> None:
    conn, guest = _pair()
    ack = b'{"v":2,"type":"ack"}\n'
    guest.sendall(ack + ack[:5])
    assert isinstance(conn.read(time.monotonic() + 5, "x"), ap.Ack)
    guest.sendall(ack[5:] + ack)
    assert isinstance(conn.read(time.monotonic() + 5, "x"), ap.Ack)
    assert isinstance(conn.read(time.monotonic() + 5, "x"), ap.Ack)
    guest.close()
    with pytest.raises(GuestChannelClosed, match=r"^sandbox 0123456789ab: "):
        conn.read(time.monotonic() + 5, "x")
    conn.close()
