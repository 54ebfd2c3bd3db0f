"""vmsandbox.adapters.agent_client against a fake guest on a unix socket (tests/fake_guest.py):
how the host tells an agent it reconnects to from one that started over, the budget of unsolicited
messages, and a bad line failing the pending requests with a typed error that names the sandbox."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests import fake_guest as fg
from vmsandbox.adapters.agent_client import AgentClient, AgentLost
from vmsandbox.adapters.guest_channel import GuestRequestFailed
from vmsandbox.agent_ops import MAX_ONLINE_CPUS
from vmsandbox.agent_protocol import (
    CPUS_ONLINE_VERSION,
    IMAGE_MOUNTS_VERSION,
    TTY_VERSION,
    UNKNOWN_CONTAINER,
    UNSOLICITED_BURST,
    USERNS_VERSION,
    ImageMount,
    ProtocolError,
)
from vmsandbox.errors import InfrastructureError, InternalError, WrongState

LABEL = "sandbox 0123456789ab"


class Lost:
    def __init__(self) -> None:
        self.why: list[str] = []
        self.event = threading.Event()

    def __call__(self, why: str) -> None:
        self.why.append(why)
        self.event.set()


@pytest.fixture
def lost() -> Lost:
    return Lost()


def _client(path: Path, lost: Lost) -> AgentClient:
    return AgentClient.open(path, 5, label=LABEL, on_lost=lost)


@pytest.fixture
def guest(tmp_path: Path) -> Iterator[Callable[[Callable[[int, fg.Peer], None]], fg.FakeGuest]]:
    made: list[fg.FakeGuest] = []

    def make(script: Callable[[int, fg.Peer], None]) -> fg.FakeGuest:
        made.append(fg.FakeGuest(tmp_path / "agent.sock", script))
        return made[-1]

    yield make
    for g in made:
        g.close()


def _then(first: Callable[[dict[str, object]], bytes], *, before_answer: bytes) -> Callable[[dict[str, object]], bytes]:
    """``first``'s answers, but a ping is preceded by ``before_answer`` (something the guest says unasked)."""

    def answer(msg: dict[str, object]) -> bytes:
        out = first(msg)
        return before_answer + out if msg.get("op") == "ping" else out

    return answer


def test_a_hello_of_the_same_instance_is_acked_again_and_the_connection_kept(guest, lost: Lost, tmp_path) -> None:  # type: ignore[no-untyped-def]
    acks: list[dict[str, object]] = []

    def script(n: int, peer: fg.Peer) -> None:
        answer = _then(fg.agent(), before_answer=fg.hello())
        while (msg := peer.recv()) is not None:
            if msg.get("type") == "ack":
                acks.append(msg)
            elif msg.get("type") == "request":
                peer.send(answer(msg))

    guest(script)
    client = _client(tmp_path / "agent.sock", lost)
    assert client.instance == fg.INSTANCE
    assert client.request("ping", {}, 5) == {}
    assert client.request("ping", {}, 5) == {}
    deadline = time.monotonic() + 5
    while len(acks) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(acks) == 2
    assert not client.closed and not lost.why
    client.close()


@pytest.mark.parametrize("instance", [fg.OTHER_INSTANCE, ""], ids=["another-instance", "no-instance"])
def test_a_hello_of_another_instance_is_a_lost_agent(guest, lost: Lost, tmp_path, instance: str) -> None:  # type: ignore[no-untyped-def]
    guest(lambda n, peer: peer.serve(_then(fg.agent(), before_answer=fg.hello(instance))))
    client = _client(tmp_path / "agent.sock", lost)
    with pytest.raises(AgentLost, match=r"sandbox 0123456789ab: the guest agent started over") as info:
        client.request("ping", {}, 5)
    assert "the containers it ran are lost" in str(info.value)
    assert lost.event.wait(5)
    assert len(lost.why) == 1 and "started over" in lost.why[0]
    assert client.closed
    with pytest.raises(AgentLost):
        client.request("ping", {}, 5)
    client.close()


def test_a_flood_of_unsolicited_responses_is_a_lost_agent(guest, lost: Lost, tmp_path) -> None:  # type: ignore[no-untyped-def]
    flood = b"".join(fg.ok(f"x{i}", {}) for i in range(UNSOLICITED_BURST + 1))
    guest(lambda n, peer: peer.serve(_then(fg.agent(), before_answer=flood)))
    client = _client(tmp_path / "agent.sock", lost)
    with pytest.raises(AgentLost, match="more unsolicited messages than the host accepts"):
        client.request("ping", {}, 5)
    assert lost.event.wait(5)
    client.close()


def test_a_few_late_answers_are_tolerated(guest, lost: Lost, tmp_path) -> None:  # type: ignore[no-untyped-def]
    late = b"".join(fg.ok(f"x{i}", {}) for i in range(UNSOLICITED_BURST // 2))
    guest(lambda n, peer: peer.serve(_then(fg.agent(), before_answer=late)))
    client = _client(tmp_path / "agent.sock", lost)
    assert client.request("ping", {}, 5) == {}
    assert not client.closed and not lost.why
    client.close()


@pytest.mark.parametrize(
    "garbage",
    [
        pytest.param(b"[" * 100_000 + b"\n", id="deep-nesting"),
        pytest.param(
            b'{"v":2,"type":"response","id":"1","ok":true,"body":{"x":' + b"9" * 10_000 + b"}}\n", id="huge-int"
        ),
        pytest.param(b"\xff\xfe\n", id="not-utf8"),
        pytest.param(b'{"v":2,"type":"response","id":"1","ok":"yes","body":{}}\n', id="wrong-type"),
    ],
)
def test_a_bad_line_fails_the_pending_request_with_a_typed_error(guest, lost: Lost, tmp_path, garbage: bytes) -> None:  # type: ignore[no-untyped-def]
    guest(lambda n, peer: peer.serve(lambda msg: garbage if msg.get("op") == "ping" else fg.agent()(msg)))
    client = _client(tmp_path / "agent.sock", lost)
    with pytest.raises(ProtocolError) as info:
        client.request("ping", {}, 5)
    message = str(info.value)
    assert message.startswith("no response to 'ping': sandbox 0123456789ab: the guest agent sent a bad message")
    assert len(message) < 1024
    assert isinstance(info.value, InfrastructureError)  # UNAVAILABLE
    assert client.closed
    assert not lost.event.wait(0.2)  # a bad line is not a lost agent: the next client reconnects
    client.close()


def test_unknown_container_is_a_refusal_with_its_code(guest, lost: Lost, tmp_path) -> None:  # type: ignore[no-untyped-def]
    answers = {"status": lambda msg: fg.refused(msg["id"], 'no container "c1"', UNKNOWN_CONTAINER)}
    guest(lambda n, peer: peer.serve(fg.agent(answers=answers)))
    client = _client(tmp_path / "agent.sock", lost)
    with pytest.raises(
        GuestRequestFailed, match=r'^sandbox 0123456789ab: the guest refused .status.: no container "c1"$'
    ) as info:
        client.status("c1")
    assert info.value.code == UNKNOWN_CONTAINER
    assert not client.closed
    client.close()


def test_a_tty_container_is_refused_before_an_agent_that_gives_no_terminal_sees_it(guest, lost: Lost, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """An agent older than protocol 4 would create the container without a terminal: the host
    refuses with a reason instead of sending it (a tty-less create still goes through)."""
    seen: list[object] = []

    def create(msg: dict[str, object]) -> bytes:
        seen.append(msg["args"])
        return fg.ok(msg["id"], fg.state("c1", "created"))

    guest(lambda n, peer: peer.serve(fg.agent(answers={"create": create})))
    client = _client(tmp_path / "agent.sock", lost)
    assert client.report.protocol < TTY_VERSION
    with pytest.raises(WrongState, match=r"speaks protocol 2, .* a container with tty needs protocol 4"):
        client.create("c1", lower="images/x", spec={"process": {}}, tty=True)
    assert seen == []
    client.create("c1", lower="images/x", spec={"process": {}})
    assert len(seen) == 1
    client.close()


def test_an_image_volume_is_refused_before_an_agent_that_mounts_none_sees_it(guest, lost: Lost, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """An agent older than protocol 7 would ignore ``image_mounts`` and bind the placeholder
    source: the host refuses with a reason instead of sending the create."""
    seen: list[object] = []

    def create(msg: dict[str, object]) -> bytes:
        seen.append(msg["args"])
        return fg.ok(msg["id"], fg.state("c1", "created"))

    guest(lambda n, peer: peer.serve(fg.agent(answers={"create": create})))
    client = _client(tmp_path / "agent.sock", lost)
    assert client.report.protocol < IMAGE_MOUNTS_VERSION
    with pytest.raises(WrongState, match=r"speaks protocol 2, .* an image volume needs protocol 7"):
        client.create("c1", lower="disks/abc", spec={"process": {}}, image_mounts=(ImageMount("/v", "abc", "x"),))
    assert seen == []
    client.close()


def test_a_user_namespace_container_is_refused_before_an_agent_that_would_not_idmap_its_root(  # type: ignore[no-untyped-def]
    guest, lost: Lost, tmp_path
) -> None:
    """An agent older than protocol 8 would run a container in a user namespace on a root whose
    files are not mapped into it: the host refuses with a reason instead of sending it."""
    seen: list[object] = []

    def create(msg: dict[str, object]) -> bytes:
        seen.append(msg["args"])
        return fg.ok(msg["id"], fg.state("c1", "created"))

    guest(lambda n, peer: peer.serve(fg.agent(answers={"create": create})))
    client = _client(tmp_path / "agent.sock", lost)
    assert client.report.protocol < USERNS_VERSION
    spec = {"process": {}, "linux": {"namespaces": [{"type": "pid"}, {"type": "user"}]}}
    with pytest.raises(WrongState, match=r"speaks protocol 2, .* \(hostUsers: false\) needs protocol 8"):
        client.create("c1", lower="disks/x", spec=spec)
    assert seen == []
    client.create("c1", lower="disks/x", spec={"process": {}, "linux": {"namespaces": [{"type": "pid"}]}})
    assert len(seen) == 1
    client.close()


def _cpus_agent(protocol: int, online: object, seen: list[object]) -> Callable[[dict[str, object]], bytes]:
    def cpus_online(msg: dict[str, object]) -> bytes:
        seen.append(msg["args"])
        return fg.ok(msg["id"], {"online": online})

    def report(msg: dict[str, object]) -> bytes:
        return fg.ok(msg["id"], {**fg.report_body(), "protocol": protocol})

    return fg.agent(answers={"cpus_online": cpus_online, "report": report})


def test_cpus_online_asks_the_agent_for_a_count(guest, lost: Lost, tmp_path) -> None:  # type: ignore[no-untyped-def]
    seen: list[object] = []
    guest(lambda n, peer: peer.serve(_cpus_agent(CPUS_ONLINE_VERSION, 2, seen)))
    client = _client(tmp_path / "agent.sock", lost)
    assert client.cpus_online(2) == 2
    assert seen == [{"count": 2}]
    client.close()


@pytest.mark.parametrize("count", [0, -1, MAX_ONLINE_CPUS + 1])
def test_cpus_online_of_a_count_out_of_bounds_is_not_sent(guest, lost: Lost, tmp_path, count: int) -> None:  # type: ignore[no-untyped-def]
    seen: list[object] = []
    guest(lambda n, peer: peer.serve(_cpus_agent(CPUS_ONLINE_VERSION, 2, seen)))
    client = _client(tmp_path / "agent.sock", lost)
    with pytest.raises(InternalError, match="cpus_online of"):
        client.cpus_online(count)
    assert seen == []
    client.close()


def test_cpus_online_is_refused_before_an_agent_without_it(guest, lost: Lost, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """An agent older than protocol 9 has no cpus_online (and its guest booted every vCPU it had):
    the host refuses with a reason instead of sending it."""
    seen: list[object] = []
    guest(lambda n, peer: peer.serve(_cpus_agent(CPUS_ONLINE_VERSION - 1, 2, seen)))
    client = _client(tmp_path / "agent.sock", lost)
    with pytest.raises(WrongState, match=r"speaks protocol 8, .* needs protocol 9"):
        client.cpus_online(2)
    assert seen == []
    client.close()


@pytest.mark.parametrize("online", [-1, "2", 2.0, None, 1 << 31])
def test_a_bad_cpus_online_answer_is_a_protocol_error(guest, lost: Lost, tmp_path, online: object) -> None:  # type: ignore[no-untyped-def]
    guest(lambda n, peer: peer.serve(_cpus_agent(CPUS_ONLINE_VERSION, online, [])))
    client = _client(tmp_path / "agent.sock", lost)
    with pytest.raises(ProtocolError, match="online"):
        client.cpus_online(2)
    client.close()
