"""Tests of vmsandbox.agent_protocol: encoding, strict decoding, the container ops' bodies, and the
host side of the channel (vmsandbox.adapters.guest_channel) against a fake guest on a unix socket.
The guest's own implementation (images/agent) is tested in a real guest
(tests/integration/test_guest_image.py, test_guest_containers.py)."""

from __future__ import annotations

import io
import json
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from vmsandbox.adapters.guest_channel import (
    GuestChannel,
    GuestChannelClosed,
    GuestChannelTimeout,
    GuestRequestFailed,
    wait_for_hello,
)
from vmsandbox.agent_ops import (
    ExecResult,
    LogChunk,
    container_state_from_body,
    container_states_from_body,
    exec_result_from_body,
    log_chunk_from_body,
    written_from_body,
)
from vmsandbox.agent_protocol import (
    MAX_REQUEST_BYTES,
    VERSION,
    Ack,
    GuestReport,
    Hello,
    HugePages,
    Message,
    NicReport,
    ProtocolError,
    Request,
    Response,
    decode,
    encode,
    report_from_body,
    report_to_body,
)
from vmsandbox.errors import InfrastructureError

REPORT = GuestReport(
    agent="init/1",
    kernel="6.1.0-56-amd64",
    vcpus=2,
    mem_total_kib=210504,
    hugepages={2048: HugePages(total=8, free=8), 1048576: HugePages(total=0, free=0)},
    cmdline='console=ttyS0 hugepagesz=2M hugepages=8 x="a\\b"',
    boot_ms=2620,
)

# A hello exactly as the guest image sent it (q35, TCG, -smp 2 -m 256).
GUEST_HELLO = (
    b'{"v":1,"type":"hello","body":{"agent":"init/1","kernel":"6.1.0-56-amd64","vcpus":2,'
    b'"mem_total_kib":210504,"hugepages":{"2048":{"total":8,"free":8}},'
    b'"cmdline":"console=ttyS0 hugepagesz=2M hugepages=8 ","boot_ms":2620}}\n'
)

HELLO_BODY = json.loads(GUEST_HELLO)["body"]


def line(obj: object) -> bytes:
    return json.dumps(obj).encode() + b"\n"


def hello_with(**changes: object) -> bytes:
    body = {k: v for k, v in HELLO_BODY.items() if changes.get(k, "") is not None}
    body.update({k: v for k, v in changes.items() if v is not None})
    return line({"v": 1, "type": "hello", "body": body})


# ---- round trips ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "msg",
    [
        Hello(REPORT),
        Hello(GuestReport("a", "k", 1, 0, {}, "", 0, errors=("insmod x failed", "é"))),
        Hello(
            GuestReport(
                "a",
                "k",
                1,
                0,
                {},
                "",
                0,
                hostname="web-0",
                nics=(NicReport("eth0", "0a:58:0a:58:00:05", ("10.88.0.5/16", "fe80::1/64"), up=True),),
            )
        ),
        Ack(),
        Request(id="1", op="ping"),
        Request(id='we"ird\n id', op="future-op"),
        Response(id="1", ok=True, body={}),
        Response(id="2", ok=True, body={"nested": {"list": [1, "two", None]}}),
        Response(id="3", ok=False, error="unknown op: dance"),
        Response(id=None, ok=False, error="unparsable message: not a JSON object"),
    ],
    ids=lambda m: type(m).__name__,
)
def test_encode_decode_round_trip(msg: Message) -> None:
    data = encode(msg)
    assert data.endswith(b"\n")
    assert data.count(b"\n") == 1
    assert decode(data) == msg


def test_hello_from_the_guest_image_decodes() -> None:
    msg = decode(GUEST_HELLO)
    assert isinstance(msg, Hello)
    assert msg.report == GuestReport(
        agent="init/1",
        kernel="6.1.0-56-amd64",
        vcpus=2,
        mem_total_kib=210504,
        hugepages={2048: HugePages(8, 8)},
        cmdline="console=ttyS0 hugepagesz=2M hugepages=8 ",
        boot_ms=2620,
    )


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b'{"v":1,"type":"ack"}', Ack()),
        (b'{"v":1,"type":"ack"}\r\n', Ack()),
        (b'  {"type":"ack","v":1,"later":"field"}  ', Ack()),
        (b'{"v":1,"type":"request","id":"x","op":"ping","args":{}}', Request("x", "ping")),
        (b'{"v":1,"type":"response","id":"7","ok":true,"body":{"a":1}}', Response("7", True, {"a": 1})),
        (b'{"v":1,"type":"response","id":null,"ok":false,"error":"e"}', Response(None, False, error="e")),
    ],
)
def test_decode_accepts(data: bytes, expected: Message) -> None:
    assert decode(data) == expected


def test_report_is_hashable_and_frozen() -> None:
    hash(REPORT)
    with pytest.raises(AttributeError):
        REPORT.vcpus = 3  # type: ignore[misc]


# ---- strict decoding -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        pytest.param(b"", "empty message", id="empty"),
        pytest.param(b"\n", "empty message", id="blank"),
        pytest.param(b"\xff\xfe{}", "not UTF-8", id="not-utf8"),
        pytest.param(b"{not json", "not JSON", id="bad-json"),
        pytest.param(b"[1,2]", "not a JSON object", id="array"),
        pytest.param(b'"hello"', "not a JSON object", id="string"),
        pytest.param(b'{"type":"ack"}', "no protocol version", id="no-version"),
        pytest.param(b'{"v":10,"type":"ack"}', "unsupported protocol version 10", id="version-10"),
        pytest.param(b'{"v":"1","type":"ack"}', "unsupported protocol version '1'", id="version-string"),
        pytest.param(b'{"v":true,"type":"ack"}', "unsupported protocol version True", id="version-bool"),
        pytest.param(b'{"v":1.0,"type":"ack"}', "unsupported protocol version 1.0", id="version-float"),
        pytest.param(b'{"v":1}', "missing field 'type'", id="no-type"),
        pytest.param(b'{"v":1,"type":7}', "field 'type' must be a string, got an integer", id="type-int"),
        pytest.param(b'{"v":1,"type":"bye"}', "unknown message type 'bye'", id="unknown-type"),
        pytest.param(b'{"v":1,"type":"request","op":"ping"}', "missing field 'id'", id="request-no-id"),
        pytest.param(b'{"v":1,"type":"request","id":3,"op":"ping"}', "'id' must be a string", id="request-int-id"),
        pytest.param(b'{"v":1,"type":"request","id":"3"}', "missing field 'op'", id="request-no-op"),
        pytest.param(b'{"v":1,"type":"request","id":"","op":"ping"}', "must not be empty", id="request-empty"),
        pytest.param(b'{"v":1,"type":"response","ok":true,"body":{}}', "missing field 'id'", id="resp-no-id"),
        pytest.param(b'{"v":1,"type":"response","id":"1","body":{}}', "missing field 'ok'", id="resp-no-ok"),
        pytest.param(
            b'{"v":1,"type":"response","id":"1","ok":1,"body":{}}',
            "'ok' must be a boolean, got an integer",
            id="resp-ok-int",
        ),
        pytest.param(b'{"v":1,"type":"response","id":"1","ok":true}', "missing field 'body'", id="resp-no-body"),
        pytest.param(
            b'{"v":1,"type":"response","id":"1","ok":true,"body":[]}',
            "'body' must be an object, got an array",
            id="resp-body-array",
        ),
        pytest.param(b'{"v":1,"type":"response","id":"1","ok":false}', "missing field 'error'", id="resp-no-error"),
        pytest.param(b'{"v":1,"type":"hello"}', "missing field 'body'", id="hello-no-body"),
        pytest.param(hello_with(vcpus=None), "missing field 'vcpus'", id="hello-no-vcpus"),
        pytest.param(hello_with(vcpus=0), "'vcpus' must be at least 1", id="hello-zero-vcpus"),
        pytest.param(hello_with(vcpus=True), "'vcpus' must be an integer, got a boolean", id="hello-bool-vcpus"),
        pytest.param(hello_with(vcpus=2.0), "'vcpus' must be an integer, got a number", id="hello-float-vcpus"),
        pytest.param(hello_with(mem_total_kib=-1), "must not be negative", id="hello-negative-mem"),
        pytest.param(hello_with(kernel=None), "missing field 'kernel'", id="hello-no-kernel"),
        pytest.param(hello_with(cmdline=["a"]), "'cmdline' must be a string, got an array", id="hello-cmdline"),
        pytest.param(hello_with(boot_ms="3"), "'boot_ms' must be an integer, got a string", id="hello-boot-ms"),
        pytest.param(hello_with(agent=None), "missing field 'agent'", id="hello-no-agent"),
        pytest.param(hello_with(hugepages=None), "missing field 'hugepages'", id="hello-no-hugepages"),
        pytest.param(
            hello_with(hugepages={"2M": {"total": 1, "free": 1}}),
            "hugepage size '2M'",
            id="hugepage-size-unit",
        ),
        pytest.param(hello_with(hugepages={"0": {"total": 1, "free": 1}}), "hugepage size '0'", id="hugepage-0"),
        pytest.param(hello_with(hugepages={"\u00b2": {"total": 1, "free": 1}}), "hugepage size", id="hp-superscript"),
        pytest.param(hello_with(hugepages={"\u0663": {"total": 1, "free": 1}}), "hugepage size", id="hugepage-arabic"),
        pytest.param(hello_with(hugepages={"2048": 8}), "hugepages['2048'] must be an object", id="hugepage-int"),
        pytest.param(
            hello_with(hugepages={"2048": {"total": 8}}),
            "hugepages['2048']: missing field 'free'",
            id="hp-free",
        ),
        pytest.param(hello_with(errors="boom"), "'errors' must be an array", id="errors-string"),
        pytest.param(hello_with(errors=[1]), "'errors' must be an array of strings", id="errors-ints"),
    ],
)
def test_decode_rejects(data: bytes, problem: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode(data)
    assert problem in str(info.value)
    assert isinstance(info.value, InfrastructureError)


def test_encode_rejects_empty_request_fields() -> None:
    with pytest.raises(ProtocolError, match="empty id or op"):
        encode(Request(id="", op="ping"))


def test_encode_refuses_a_request_longer_than_the_agent_reads() -> None:
    def request(pad: int) -> Request:
        return Request(id="7", op="volume_write", args={"data": "A" * pad})

    fits = MAX_REQUEST_BYTES - len(encode(request(0)))
    assert len(encode(request(fits))) == MAX_REQUEST_BYTES
    with pytest.raises(ProtocolError, match="longer than the agent reads"):
        encode(request(fits + 1))


def test_report_from_body_names_where() -> None:
    body = {k: v for k, v in HELLO_BODY.items() if k != "vcpus"}
    with pytest.raises(ProtocolError, match=r"^report response body: missing field 'vcpus'$"):
        report_from_body(body, "report response body")


# ---- protocol 2: arguments and container ops ------------------------------------------------------

STATE_BODY = {
    "id": "c1",
    "state": "exited",
    "pid": 120,
    "exit_code": 137,
    "signal": 9,
    "oom_killed": True,
    "created_at_ns": 1,
    "started_at_ns": 2,
    "finished_at_ns": 3,
}


def test_request_args_round_trip() -> None:
    msg = Request("9", "create", {"id": "c1", "spec": {"process": {"args": ["sh"]}}})
    data = encode(msg)
    assert json.loads(data)["v"] == VERSION == 9
    assert json.loads(encode(msg, 2))["v"] == 2
    assert decode(data) == msg
    assert decode(data).args == msg.args  # type: ignore[union-attr]


def test_hello_of_a_protocol_2_agent() -> None:
    body = dict(HELLO_BODY, agent="vmsandbox-agent/2", protocol=2)
    msg = decode(line({"v": 2, "type": "hello", "body": body}))
    assert isinstance(msg, Hello) and msg.report.protocol == 2
    assert isinstance(decode(GUEST_HELLO), Hello) and decode(GUEST_HELLO).report.protocol == 1  # type: ignore[union-attr]


def test_container_state_decodes() -> None:
    st = container_state_from_body(STATE_BODY)
    assert (st.state, st.exit_code, st.signal, st.oom_killed) == ("exited", 137, 9, True)


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"state": "zombie"}, "unknown container state 'zombie'"),
        ({"oom_killed": 1}, "'oom_killed' must be a boolean"),
        ({"exit_code": -1}, "'exit_code' must not be negative"),
        ({"pid": None}, "'pid' must be an integer, got null"),
    ],
)
def test_container_state_rejects(changes: dict[str, object], problem: str) -> None:
    with pytest.raises(ProtocolError, match=problem):
        container_state_from_body({**STATE_BODY, **changes})


def test_exec_result_decodes_base64_output() -> None:
    body = {"exit_code": 7, "stdout": "aW4K", "stderr": None, "timed_out": False, "dropped_bytes": 0}
    assert exec_result_from_body(body) == ExecResult(7, b"in\n", b"", False, 0)
    for bad in ("!!", "aW4", "aW4K=", "aW4K====", "aW==aW==", "=aW4", "aW4K\n"):
        with pytest.raises(ProtocolError, match="not base64"):
            exec_result_from_body({**body, "stdout": bad})


@pytest.mark.parametrize(
    ("read", "body", "problem"),
    [
        (report_from_body, {**HELLO_BODY, "instance": ""}, "'instance' must be 16 to 64"),
        (report_from_body, {**HELLO_BODY, "protocol": 0}, "'protocol' must be at least 1"),
        (container_states_from_body, {"containers": [STATE_BODY, 1]}, r"containers\[1\] must be an object"),
        (container_states_from_body, {"containers": {}}, "'containers' must be an array"),
        (lambda b: written_from_body(b, 6, "w"), {"written": True}, "'written' must be an integer"),
        (lambda b: written_from_body(b, 6, "w"), {"written": 7}, "'written' must be at most 6"),
        (lambda b: written_from_body(b, 6, "w"), {"written": 6, "closed": "yes"}, "'closed' must be a boolean"),
    ],
)
def test_answers_with_mistyped_fields_are_refused(
    read: Callable[[dict[str, object]], object], body: dict[str, object], problem: str
) -> None:
    with pytest.raises(ProtocolError, match=problem):
        read(body)


def test_written_and_list_read() -> None:
    assert written_from_body({"written": 3}, 6, "w") == (3, False)
    assert written_from_body({"written": 0, "closed": True}, 6, "w") == (0, True)
    assert container_states_from_body({"containers": [STATE_BODY]})[0].id == "c1"


LOG_OK = {"offset": 100, "data": "aGVsbG8K", "eof": False}  # "hello\n"


def test_log_chunk_decodes() -> None:
    assert log_chunk_from_body(LOG_OK, 100, 6) == LogChunk(100, b"hello\n", False)
    assert log_chunk_from_body({**LOG_OK, "offset": 150, "eof": True}, 100, 6) == LogChunk(150, b"hello\n", True)
    assert log_chunk_from_body({**LOG_OK, "data": ""}, 100, 1) == LogChunk(100, b"", False)


@pytest.mark.parametrize(
    ("changes", "asked", "max_bytes", "problem"),
    [
        ({"offset": 99}, 100, 6, "before the 100 asked for"),
        ({}, 100, 5, "6 bytes for at most 5"),
        ({"data": "A" * 12}, 100, 6, "12 base64 characters for at most 6"),
        ({"data": "!!!!"}, 100, 6, "not base64"),
        ({"data": "aGVsbG8"}, 100, 6, "not base64"),
        ({"data": None}, 100, 6, "'data' must be a string"),
        ({"offset": -1}, 0, 6, "must not be negative"),
        ({"offset": "100"}, 100, 6, "'offset' must be an integer"),
        ({"eof": 1}, 100, 6, "'eof' must be a boolean"),
        ({"eof": None}, 100, 6, "'eof' must be a boolean"),
    ],
)
def test_log_chunk_rejects_lies(changes: dict[str, object], asked: int, max_bytes: int, problem: str) -> None:
    with pytest.raises(ProtocolError, match=problem):
        log_chunk_from_body({**LOG_OK, **changes}, asked, max_bytes)


def test_log_chunk_never_decodes_more_than_asked() -> None:
    """Checked on the base64 text before it is decoded (a guest sends ~1 MiB lines at most)."""
    with pytest.raises(ProtocolError, match="base64 characters"):
        log_chunk_from_body({**LOG_OK, "data": "QUFB" * 200_000}, 100, 1024)


# ---- the host side (vmsandbox.adapters.guest_channel) against a fake guest on a unix socket ------------------


class FakeGuest:
    """Listens on ``path`` (optionally after ``delay_s``) and runs ``script`` on the first
    connection, with a line reader and a writer."""

    def __init__(
        self, path: Path, script: Callable[[Callable[[], Message], Callable[[Message], None]], None], delay_s: float = 0
    ) -> None:
        self.path = path
        self.error: BaseException | None = None
        self._script = script
        self._delay_s = delay_s
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            time.sleep(self._delay_s)
            with socket.socket(socket.AF_UNIX) as server:
                server.bind(str(self.path))
                server.listen()
                server.settimeout(10)
                conn, _ = server.accept()
                with conn, conn.makefile("rwb") as f:

                    def send(msg: Message) -> None:
                        f.write(encode(msg))
                        f.flush()

                    self._script(lambda: decode(f.readline()), send)
        except BaseException as e:  # reported by join()
            self.error = e

    def join(self) -> None:
        self._thread.join(timeout=10)
        assert not self._thread.is_alive()
        if self.error is not None:
            raise self.error


def booting_guest(recv: Callable[[], Message], send: Callable[[Message], None]) -> None:
    """Like images/guest/init: hello first, then answer requests until the host leaves."""
    send(Hello(REPORT))
    while True:
        try:
            msg = recv()
        except ProtocolError:  # EOF: empty line
            return
        if isinstance(msg, Request):
            if msg.op == "report":
                send(Response(msg.id, True, report_to_body(REPORT)))
            elif msg.op == "ping":
                send(Response(msg.id, True, {}))
            else:
                send(Response(msg.id, False, error=f"unknown op: {msg.op}"))


def test_wait_for_hello_acks_and_retries_until_the_socket_exists(tmp_path: Path) -> None:
    seen: list[Message] = []

    def script(recv: Callable[[], Message], send: Callable[[Message], None]) -> None:
        send(Hello(REPORT))
        seen.extend([recv(), recv()])

    guest = FakeGuest(tmp_path / "late.sock", script, delay_s=0.3)
    assert wait_for_hello(tmp_path / "late.sock", 5) == REPORT
    guest.join()
    assert seen == [Request("0", "report"), Ack()]


def test_open_takes_the_report_of_an_already_acked_guest(tmp_path: Path) -> None:
    def acked_guest(recv: Callable[[], Message], send: Callable[[Message], None]) -> None:
        request = recv()
        assert request == Request("0", "report")
        send(Response("0", True, report_to_body(REPORT)))
        assert recv() == Request("1", "ping")
        send(Response("1", True, {"pong": True}))

    guest = FakeGuest(tmp_path / "g.sock", acked_guest)
    with GuestChannel.open(tmp_path / "g.sock", 5) as channel:
        assert channel.report == REPORT
        assert channel.request("ping", 5) == {"pong": True}
    guest.join()


def test_request_skips_stale_messages_and_reports_refusals(tmp_path: Path) -> None:
    guest = FakeGuest(tmp_path / "g.sock", booting_guest)
    with GuestChannel.open(tmp_path / "g.sock", 5) as channel:
        # the answer to the greeting request ("0") is still in flight and must be skipped
        assert channel.request("ping", 5) == {}
        assert channel.report_now(5) == REPORT
        with pytest.raises(GuestRequestFailed, match=r"refused 'dance' on .*g\.sock: unknown op: dance"):
            channel.request("dance", 5)
    guest.join()


def test_requests_from_threads_each_get_their_own_answer(tmp_path: Path) -> None:
    guest = FakeGuest(tmp_path / "g.sock", booting_guest)
    with GuestChannel.open(tmp_path / "g.sock", 5) as channel, ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda op: channel.request(op, 5), ["ping", "report"] * 8))
    guest.join()
    assert results == [{}, report_to_body(REPORT)] * 8


def test_wait_for_hello_times_out_naming_the_socket(tmp_path: Path) -> None:
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(tmp_path / "silent.sock"))
        server.listen()
        start = time.monotonic()
        with pytest.raises(GuestChannelTimeout, match=r"no hello from the guest within 0\.3 s on .*silent\.sock"):
            wait_for_hello(tmp_path / "silent.sock", 0.3)
        assert time.monotonic() - start < 2


def test_wait_for_hello_times_out_when_nothing_listens(tmp_path: Path) -> None:
    with pytest.raises(GuestChannelTimeout, match=r"on .*absent\.sock within 0\.2 s \(connect: No such file"):
        wait_for_hello(tmp_path / "absent.sock", 0.2)


def test_malformed_line_from_the_guest_is_a_protocol_error(tmp_path: Path) -> None:
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(tmp_path / "g.sock"))
        server.listen()

        def serve() -> None:
            conn, _ = server.accept()
            with conn:
                conn.sendall(b'{"v":1,"type":"hello","body":{}}\n')
                conn.recv(4096)

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        with pytest.raises(
            ProtocolError, match=r"g\.sock: the guest agent sent a bad message: hello message body: missing field"
        ):
            wait_for_hello(tmp_path / "g.sock", 5)
        thread.join(timeout=5)


def test_guest_leaving_mid_request_is_reported(tmp_path: Path) -> None:
    def leaves(recv: Callable[[], Message], send: Callable[[Message], None]) -> None:
        send(Hello(REPORT))
        for _ in range(3):  # greeting request, ack, the ping: then hang up
            recv()

    guest = FakeGuest(tmp_path / "g.sock", leaves)
    with (
        GuestChannel.open(tmp_path / "g.sock", 5) as channel,
        pytest.raises(GuestChannelClosed, match="by the other end"),
    ):
        channel.request("ping", 5)
    guest.join()


def _serve_raw(path: Path, guest: Callable[[io.BufferedIOBase], None]) -> threading.Thread:
    """A guest on ``path`` that takes one connection and runs ``guest`` on its raw lines (JSON
    frames written by hand, to see the versions the host sends), in a thread of its own."""

    def serve() -> None:
        with socket.socket(socket.AF_UNIX) as server:
            server.bind(str(path))
            server.listen()
            server.settimeout(10)
            conn, _ = server.accept()
            with conn, conn.makefile("rwb") as f:
                guest(f)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("protocol", [2, 3, 4, 9])
def test_host_speaks_the_version_the_guest_reads(tmp_path: Path, protocol: int) -> None:
    """The greeting goes out as version 1 (every agent reads it); after the guest said which it
    speaks, the host sends the highest version both sides know."""
    seen: list[int] = []
    path = tmp_path / "agent.sock"
    report = {**report_to_body(REPORT), "protocol": protocol}

    def guest(f: io.BufferedIOBase) -> None:
        f.write(json.dumps({"v": 2, "type": "hello", "body": report}).encode() + b"\n")
        f.flush()
        for line in f:
            obj = json.loads(line)
            seen.append(obj["v"])
            if obj["type"] == "request":
                answer = {"v": 2, "type": "response", "id": obj["id"], "ok": True, "body": {}}
                f.write(json.dumps(answer).encode() + b"\n")
                f.flush()

    thread = _serve_raw(path, guest)
    with GuestChannel.open(path, 10) as channel:
        channel.request("ping", 10)
    thread.join(timeout=10)
    assert seen[0] == 1  # the greeting report request
    assert set(seen[1:]) == {min(protocol, VERSION)}, seen


def test_open_with_request_is_one_round_trip_and_skips_a_hello(tmp_path: Path) -> None:
    """A restored guest's agent is known: the connection opens with the request itself (no
    greeting), a hello the guest sent before reading it is skipped, and the answer is the report."""
    seen: list[Message] = []
    fresh = report_to_body(replace(REPORT, instance="b" * 32))

    def unacked_guest(recv: Callable[[], Message], send: Callable[[Message], None]) -> None:
        send(Hello(REPORT))
        seen.append(recv())
        send(Response("1", True, fresh))
        seen.append(recv())
        send(Response("2", True, {}))

    guest = FakeGuest(tmp_path / "g.sock", unacked_guest, delay_s=0.2)
    with GuestChannel.open_with_request(
        tmp_path / "g.sock", "personalize", {"hostname": "h"}, version=5, timeout_s=5
    ) as channel:
        assert channel.report.instance == "b" * 32
        assert channel.request("ping", 5) == {}
    guest.join()
    assert seen == [Request("1", "personalize", {"hostname": "h"}), Request("2", "ping")]


def test_open_with_request_never_sends_it_twice(tmp_path: Path) -> None:
    def refuses(recv: Callable[[], Message], send: Callable[[Message], None]) -> None:
        recv()
        send(Response("1", False, error="bad seed"))

    guest = FakeGuest(tmp_path / "g.sock", refuses)
    with pytest.raises(GuestRequestFailed, match=r"refused 'personalize'.*bad seed"):
        GuestChannel.open_with_request(tmp_path / "g.sock", "personalize", {}, version=5, timeout_s=5)
    guest.join()

    def leaves(recv: Callable[[], Message], send: Callable[[Message], None]) -> None:
        recv()

    guest = FakeGuest(tmp_path / "h.sock", leaves)
    with pytest.raises(GuestChannelClosed, match="by the other end"):
        GuestChannel.open_with_request(tmp_path / "h.sock", "personalize", {}, version=5, timeout_s=5)
    guest.join()


@pytest.mark.parametrize(("version", "sent"), [(5, 5), (VERSION + 3, VERSION), (0, 1)])
def test_open_with_request_speaks_the_version_it_is_given(tmp_path: Path, version: int, sent: int) -> None:
    seen: list[int] = []
    path = tmp_path / "agent.sock"

    def guest(f: io.BufferedIOBase) -> None:
        obj = json.loads(f.readline())
        seen.append(obj["v"])
        answer = {"v": 2, "type": "response", "id": obj["id"], "ok": True, "body": report_to_body(REPORT)}
        f.write(json.dumps(answer).encode() + b"\n")
        f.flush()

    thread = _serve_raw(path, guest)
    with GuestChannel.open_with_request(path, "personalize", {}, version=version, timeout_s=10) as channel:
        assert channel.report == REPORT
    thread.join(timeout=10)
    assert seen == [sent]
