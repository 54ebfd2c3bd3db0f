"""What the shim gives the CRI front: the records' generation (``Records``), whether the lists
follow from the records alone (``Pods.lists_settled``), and the list channel's frames
(``shim.front.ListChannel``, the format ``front/lists.go`` reads)."""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import grpc
import pytest

from shim.front import Aborted, ListChannel
from shim.model import CONTAINER_EXITED, CONTAINER_RUNNING, RemovePodSandbox, StopPodSandbox
from shim.pods import Pods
from shim.rpc.remove_pod_sandbox import remove_pod_sandbox
from shim.rpc.stop_pod_sandbox import stop_pod_sandbox
from tests.cri_server import SEED_CONTAINER, SEED_SANDBOXES, Server, cri_server

HEAD = struct.Struct(">IIB")


@pytest.fixture
def server() -> Iterator[Server]:
    with cri_server() as s:
        yield s


def test_every_change_to_the_records_moves_the_generation_and_is_heard(server: Server) -> None:
    sb = server.sandboxes
    assert server.pods is not None
    pods = server.pods
    heard: list[int] = []
    sb.records.watch_generation(heard.append)
    seed = sb.records.container(SEED_CONTAINER)
    changes: list[tuple[str, Callable[[], object]]] = [
        ("a container's state", lambda: sb.records.save_container(replace(seed, state=CONTAINER_EXITED))),
        ("a container removed", lambda: sb.records.remove_container(SEED_CONTAINER)),
        ("a sandbox stopped", lambda: stop_pod_sandbox(pods, StopPodSandbox(SEED_SANDBOXES[1]))),
        ("a sandbox removed", lambda: remove_pod_sandbox(pods, RemovePodSandbox(SEED_SANDBOXES[1]))),
    ]
    for what, change in changes:
        before = sb.records.generation
        change()
        assert sb.records.generation > before, what
        assert heard[-1] == sb.records.generation, what
    assert heard == sorted(heard)
    # what changes nothing leaves it
    now = sb.records.generation
    sb.records.list_sandboxes()
    sb.records.remove_container("f" * 64)
    assert sb.records.generation == now


def test_lists_are_settled_unless_a_container_waits_on_its_guest(server: Server) -> None:
    assert server.containers is not None
    sb = server.sandboxes
    pods = Pods(sb, server.containers)
    seed = sb.records.container(SEED_CONTAINER)
    cases = [
        (replace(seed, state=CONTAINER_RUNNING, image_id=""), True),  # never created in a guest
        (replace(seed, state=CONTAINER_EXITED, image_id="sha256:" + "1" * 64), True),
        (replace(seed, state=CONTAINER_RUNNING, image_id="sha256:" + "1" * 64), False),
    ]
    for record, settled in cases:
        sb.records.save_container(record)
        assert pods.lists_settled() is settled, record.state


class Peer:
    """The front's end of the channel."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = sock.makefile("rb")

    def ask(self, request_id: int, op: int, payload: bytes) -> None:
        self.sock.sendall(HEAD.pack(len(payload) + 5, request_id, op) + payload)

    def frame(self) -> tuple[int, int, bytes]:
        head = self.reader.read(HEAD.size)
        assert len(head) == HEAD.size, "the channel closed"
        length, request_id, op = HEAD.unpack(head)
        return request_id, op, self.reader.read(length - 5)

    def answer_to(self, request_id: int) -> tuple[int, bytes]:
        while True:
            rid, op, payload = self.frame()
            if rid == request_id and op != 3:
                return op, payload


@pytest.fixture
def channel() -> Iterator[tuple[ListChannel, Peer]]:
    mine, theirs = socket.socketpair()

    def answer(name: str, data: bytes, context: Any) -> tuple[bytes, int | None]:
        if data == b"missing":
            context.abort(grpc.StatusCode.NOT_FOUND, "no such sandbox")
        if data == b"bug":
            raise RuntimeError("boom")
        return name.encode() + b":" + data, (7 if name == "ListPodSandbox" else None)

    ch = ListChannel(mine, answer, generation=5)
    peer = Peer(theirs)
    yield ch, peer
    theirs.close()


def test_channel_frames(channel: tuple[ListChannel, Peer]) -> None:
    ch, peer = channel
    assert peer.frame() == (0, 3, struct.pack(">Q", 5))  # the generation at start
    peer.ask(1, 1, b"filter")
    assert peer.answer_to(1) == (2, struct.pack(">Q", 7) + b"ListPodSandbox:filter")  # kept at generation 7
    peer.ask(2, 2, b"")
    assert peer.answer_to(2) == (0, b"ListContainers:")  # not to be kept
    peer.ask(3, 1, b"missing")
    assert peer.answer_to(3) == (1, bytes([grpc.StatusCode.NOT_FOUND.value[0]]) + b"no such sandbox")
    peer.ask(4, 1, b"bug")
    op, payload = peer.answer_to(4)
    assert (op, payload[0]) == (1, grpc.StatusCode.INTERNAL.value[0]) and b"boom" in payload
    ch.generation_changed(6)
    ch.generation_changed(9)
    seen: list[int] = []
    while not seen or seen[-1] != 9:
        rid, op, payload = peer.frame()
        assert (rid, op) == (0, 3)
        seen.append(struct.unpack(">Q", payload)[0])
    assert seen == sorted(seen)  # the newest last; one in between may be skipped


@pytest.mark.parametrize(
    "frame",
    [
        HEAD.pack(5, 1, 9),  # an op the shim does not answer
        HEAD.pack(4, 1, 1),  # shorter than its own header
        HEAD.pack((1 << 20) + 6, 1, 1),  # a list request longer than any filter
    ],
)
def test_a_bad_frame_closes_the_channel(channel: tuple[ListChannel, Peer], frame: bytes) -> None:
    _, peer = channel
    peer.frame()
    peer.sock.sendall(frame)
    peer.sock.settimeout(5)
    rest = peer.reader.read()
    assert all(HEAD.unpack(rest[i : i + 9])[2] == 3 for i in range(0, len(rest), 17))  # only pushes came


def test_aborted_carries_its_code() -> None:
    exc = Aborted(grpc.StatusCode.NOT_FOUND, "x")
    assert (exc.code, exc.details) == (grpc.StatusCode.NOT_FOUND, "x")
