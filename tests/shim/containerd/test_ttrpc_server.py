"""TtrpcServer and EventPublisher over real unix sockets: dispatch, error codes, bad clients."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gen.containerd.events import task_pb2 as events
from gen.containerd.services.ttrpc.events.v1 import events_pb2
from shim.containerd.events import QUEUE_MAX, EventPublisher
from shim.containerd.ttrpc_server import TtrpcServer
from shim.nri import wire
from vmsandbox import ttrpc
from vmsandbox.errors import CannotFit, NotFound, Unsupported

SERVICE = "example.v1.Echo"


def echo(payload: bytes) -> bytes:
    return payload[::-1]


def fails(exc: Exception) -> object:
    def handler(_: bytes) -> bytes:
        raise exc

    return handler


def slow(_: bytes) -> bytes:
    time.sleep(1.0)
    return b"late"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[TtrpcServer]:
    s = TtrpcServer(
        tmp_path / "t.sock",
        {
            SERVICE: {
                "Echo": echo,
                "Gone": fails(NotFound("no such task")),  # type: ignore[dict-item]
                "Full": fails(CannotFit("no room")),  # type: ignore[dict-item]
                "Nope": fails(Unsupported("not here")),  # type: ignore[dict-item]
                "Boom": fails(RuntimeError("bug")),  # type: ignore[dict-item]
                "Slow": slow,
            }
        },
        name="test",
        max_calls=4,
    )
    s.start()
    yield s
    s.close()


def connect(server: TtrpcServer) -> socket.socket:
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.settimeout(10)
    c.connect(str(server.path))
    return c


def call(c: socket.socket, method: str, payload: bytes = b"", stream: int = 1, service: str = SERVICE) -> wire.Response:
    c.sendall(ttrpc.encode_frame(wire.request_frame(stream, wire.Request(service, method, payload))))
    buf = b""
    while True:
        data = c.recv(65536)
        assert data, "connection closed"
        frames, buf = ttrpc.decode_frames(buf + data)
        for f in frames:
            if f.stream_id == stream:
                return wire.parse_response(f)


@pytest.mark.parametrize(
    ("method", "code", "says"),
    [
        ("Echo", ttrpc.OK, ""),
        ("Gone", ttrpc.NOT_FOUND, "no such task"),
        ("Full", ttrpc.RESOURCE_EXHAUSTED, "no room"),
        ("Nope", ttrpc.UNIMPLEMENTED, "not here"),
        ("Boom", ttrpc.INTERNAL, "internal error: RuntimeError: bug"),
        ("Missing", ttrpc.UNIMPLEMENTED, "is not served"),
    ],
)
def test_calls_answer_with_the_errors_code(server: TtrpcServer, method: str, code: int, says: str) -> None:
    with connect(server) as c:
        reply = call(c, method, b"abc")
    assert reply.code == code and says in reply.message
    if code == ttrpc.OK:
        assert reply.payload == b"cba"


def test_socket_is_the_owners_only(server: TtrpcServer) -> None:
    assert server.path.stat().st_mode & 0o777 == 0o600


def test_a_long_call_does_not_hold_up_others_on_the_same_connection(server: TtrpcServer) -> None:
    with connect(server) as c:
        c.sendall(ttrpc.encode_frame(wire.request_frame(1, wire.Request(SERVICE, "Slow", b""))))
        started = time.monotonic()
        assert call(c, "Echo", b"x", stream=3).payload == b"x"
        assert time.monotonic() - started < 0.9


def test_calls_beyond_the_bound_are_refused_at_once(server: TtrpcServer) -> None:
    with connect(server) as c:
        for stream in (1, 3, 5, 7):
            c.sendall(ttrpc.encode_frame(wire.request_frame(stream, wire.Request(SERVICE, "Slow", b""))))
        time.sleep(0.2)
        reply = call(c, "Echo", b"x", stream=9)
    assert reply.code == ttrpc.RESOURCE_EXHAUSTED


def test_a_client_that_stops_half_way_does_not_stall_another(server: TtrpcServer) -> None:
    stalled = connect(server)
    stalled.sendall(ttrpc.encode_frame(wire.request_frame(1, wire.Request(SERVICE, "Echo", b"y" * 1000)))[:500])
    with connect(server) as c:
        assert call(c, "Echo", b"ok").payload == b"ko"
    stalled.close()


def test_connections_beyond_the_bound_are_closed_and_the_others_served(tmp_path: Path) -> None:
    server = TtrpcServer(tmp_path / "c.sock", {SERVICE: {"Echo": echo}}, name="test", max_connections=2)
    server.start()
    try:
        held = [connect(server), connect(server)]
        assert call(held[0], "Echo", b"ab").payload == b"ba"
        with connect(server) as extra:
            assert extra.recv(1) == b""  # closed at once, nothing answered
        assert call(held[1], "Echo", b"cd").payload == b"dc"
        held[0].close()
        deadline = time.monotonic() + 10
        while server.connections() > 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with connect(server) as again:  # room again once one went
            assert call(again, "Echo", b"ef").payload == b"fe"
        held[1].close()
    finally:
        server.close()


@pytest.mark.parametrize(
    "frame",
    [
        ttrpc.encode_frame(ttrpc.Frame(1, ttrpc.TYPE_RESPONSE, 0, b"")),  # not a request
        (ttrpc.MAX_MESSAGE + 1).to_bytes(4, "big") + b"\x00\x00\x00\x01\x01\x00",  # more than 4 MiB announced
        ttrpc.encode_frame(ttrpc.Frame(1, ttrpc.TYPE_REQUEST, 0, b"\xff\xff\xff")),  # no protobuf
    ],
)
def test_a_broken_frame_closes_that_connection_only(server: TtrpcServer, frame: bytes) -> None:
    with connect(server) as bad:
        bad.sendall(frame)
        assert bad.recv(100) == b""
    with connect(server) as c:
        assert call(c, "Echo", b"ab").payload == b"ba"


def test_streams_are_refused(server: TtrpcServer) -> None:
    with connect(server) as c:
        msg = wire.request_frame(1, wire.Request(SERVICE, "Echo", b""))
        c.sendall(ttrpc.encode_frame(ttrpc.Frame(1, ttrpc.TYPE_REQUEST, ttrpc.FLAG_REMOTE_OPEN, msg.payload)))
        buf = b""
        while True:
            buf += c.recv(65536)
            frames, buf = ttrpc.decode_frames(buf)
            if frames:
                assert wire.parse_response(frames[0]).code == ttrpc.UNIMPLEMENTED
                return


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(junk=st.binary(max_size=300))
def test_any_bytes_are_answered_or_closed_never_hung(server: TtrpcServer, junk: bytes) -> None:
    with connect(server) as c:
        c.settimeout(3)
        c.sendall(junk)
        c.shutdown(socket.SHUT_WR)
        try:
            while c.recv(65536):
                pass
        except TimeoutError:
            pytest.fail("the server neither answered nor closed")
    with connect(server) as ok:
        assert call(ok, "Echo", b"1").payload == b"1"


def test_close_ends_connections_and_removes_the_socket(server: TtrpcServer) -> None:
    c = connect(server)
    deadline = time.monotonic() + 5
    while server.connections() != 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    server.close()
    assert c.recv(10) == b"" and not server.path.exists()
    server.close()  # idempotent


def test_events_reach_containerds_forward_and_survive_a_restart_of_it(tmp_path: Path) -> None:
    got: list[events_pb2.ForwardRequest] = []
    arrived = threading.Event()

    def forward(payload: bytes) -> bytes:
        req = events_pb2.ForwardRequest()
        req.ParseFromString(payload)
        got.append(req)
        arrived.set()
        return b""

    path = tmp_path / "containerd.sock.ttrpc"
    services = {"containerd.services.events.ttrpc.v1.Events": {"Forward": forward}}
    publisher = EventPublisher(f"unix://{path}", "k8s.io")
    first = TtrpcServer(path, services, name="containerd")
    first.start()
    publisher.publish("/tasks/exit", events.TaskExit(container_id="c" * 64, id="c" * 64, exit_status=3))
    assert arrived.wait(10)
    first.close()
    arrived.clear()
    second = TtrpcServer(path, services, name="containerd")
    second.start()
    publisher.publish("/tasks/start", events.TaskStart(container_id="d" * 64, pid=7))
    assert arrived.wait(10)
    second.close()
    publisher.close()
    exit_, start = got
    assert (exit_.envelope.topic, exit_.envelope.namespace) == ("/tasks/exit", "k8s.io")
    assert exit_.envelope.event.type_url == "containerd.events.TaskExit"
    decoded = events.TaskExit()
    decoded.ParseFromString(exit_.envelope.event.value)
    assert decoded.exit_status == 3
    assert start.envelope.event.type_url == "containerd.events.TaskStart"


def test_closing_a_publisher_whose_peer_is_gone_waits_no_longer_than_asked(tmp_path: Path) -> None:
    publisher = EventPublisher(f"unix://{tmp_path / 'nobody.sock'}", "k8s.io")
    for n in range(QUEUE_MAX + 100):  # a full queue, each event retried against a socket that is not there
        publisher.publish("/tasks/start", events.TaskStart(container_id="c", pid=n))
    started = time.monotonic()
    publisher.close(wait_s=1.0)
    assert time.monotonic() - started < 1.8


def test_an_accept_that_keeps_failing_is_retried_without_spinning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tries = []

    def out_of_files(self: socket.socket) -> tuple[socket.socket, object]:
        tries.append(1)
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(socket.socket, "accept", out_of_files)
    s = TtrpcServer(tmp_path / "t.sock", {}, name="test")
    s.start()
    time.sleep(0.5)
    s.close()
    assert 1 <= len(tries) <= 10
