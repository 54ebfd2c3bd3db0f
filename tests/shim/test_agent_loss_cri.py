"""A guest's agent against the CRI, through the real gRPC server (tests/cri_server.py) whose
seeded sandbox's agent channel is a fake guest (tests/fake_guest.py): the guest's word never
makes the CRI lie, and never makes it answer INTERNAL.

- An agent that answers garbage (deeply nested JSON, ...) gives UNAVAILABLE naming the sandbox on
  ContainerStatus; once it behaves again, the next call reconnects and answers.
- An agent that is not the instance that reported at RunPodSandbox, that greets again as a new
  instance on a live connection, or that does not know a container it ran, is a lost agent: the
  sandbox turns NOTREADY and its containers EXITED (255, ``Unknown``, the cause in the message).
- The same instance reconnecting (a shim restart's adoption) changes nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from shim.model import CONTAINER_RUNNING, ContainerRecord
from tests import fake_guest as fg
from tests.cri_server import SEED_CONTAINER, SEED_SANDBOXES, Server, cri_server
from vmsandbox.agent_protocol import UNKNOWN_CONTAINER

pytest.importorskip("libvirt")

SANDBOX = SEED_SANDBOXES[0]


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    with cri_server() as s:
        sock = s.root / "agent.sock"
        monkeypatch.setattr(s.sandboxes.hypervisor, "channel_path", lambda _domain, _name: str(sock))
        # the seeded container as CreateContainer + StartContainer leave it; its sandbox as RunPodSandbox
        # leaves it, with the instance of the agent that reported then
        doc = next(d for cid, *_, d in s.sandboxes.ledger.containers(SANDBOX) if cid == SEED_CONTAINER)
        running = replace(ContainerRecord.from_doc(doc), state=CONTAINER_RUNNING, image_id="sha256:" + "1" * 64)
        s.sandboxes.records.save_container(running)
        record = s.sandboxes.records.get(SANDBOX)
        ready = replace(record, guest={**fg.report_body(fg.INSTANCE)})
        s.sandboxes.ledger.put_sandbox(SANDBOX, record.state, record.created_ns, ready.to_doc())
        s.sandboxes.records.reload()
        yield s


@pytest.fixture
def guest(server: Server) -> Iterator[Callable[[Callable[[int, fg.Peer], None]], fg.FakeGuest]]:
    made: list[fg.FakeGuest] = []

    def make(script: Callable[[int, fg.Peer], None]) -> fg.FakeGuest:
        made.append(fg.FakeGuest(server.root / "agent.sock", script))
        return made[-1]

    yield make
    for g in made:
        g.close()


def _status(server: Server) -> tuple[grpc.StatusCode, str, pb.ContainerStatus]:
    code, details, body = server.rpc("ContainerStatus", pb.ContainerStatusRequest(container_id=SEED_CONTAINER))
    return code, details, pb.ContainerStatusResponse.FromString(body).status


def _sandbox_state(server: Server) -> int:
    code, details, body = server.rpc("PodSandboxStatus", pb.PodSandboxStatusRequest(pod_sandbox_id=SANDBOX))
    assert code == grpc.StatusCode.OK, details
    return int(pb.PodSandboxStatusResponse.FromString(body).status.state)


def _running(cid: str = SEED_CONTAINER) -> Callable[[dict[str, object]], bytes]:
    return lambda msg: fg.ok(msg["id"], fg.state(cid))


def _assert_lost(server: Server, cause: str) -> None:
    code, details, status = _status(server)
    assert code == grpc.StatusCode.OK, details
    assert (status.state, status.exit_code, status.reason) == (pb.CONTAINER_EXITED, 255, "Unknown")
    assert "guest agent was lost" in status.message and cause in status.message
    assert status.finished_at > 0
    assert _sandbox_state(server) == pb.SANDBOX_NOTREADY
    assert server.sandboxes.records.get(SANDBOX).guest.get("lost")


@pytest.mark.parametrize(
    "garbage",
    [
        pytest.param(b"[" * 100_000 + b"]" * 100_000 + b"\n", id="deep-nesting"),
        pytest.param(b'{"v":2,"type":"response","id":"1","ok":true,"body":{"a":' * 5000 + b"\n", id="deep-objects"),
        pytest.param(
            b'{"v":2,"type":"response","id":"1","ok":true,"body":{"id":"c","state":"running","pid":1,'
            b'"exit_code":99999999999999999999,"signal":0,"oom_killed":false,"created_at_ns":1,'
            b'"started_at_ns":1,"finished_at_ns":0}}\n',
            id="exit-code-beyond-int32",
        ),
    ],
)
def test_garbage_from_the_agent_is_unavailable_and_the_next_call_reconnects(
    server: Server, guest: Callable[[Callable[[int, fg.Peer], None]], fg.FakeGuest], garbage: bytes
) -> None:
    def script(n: int, peer: fg.Peer) -> None:
        # the first connection answers the greeting and then garbage; the next is a sound agent
        sound = fg.agent(answers={"status": _running()})
        peer.serve(sound if n >= 1 else lambda msg: sound(msg) if msg.get("op") == "report" else garbage)

    g = guest(script)
    code, details, _ = _status(server)
    assert code == grpc.StatusCode.UNAVAILABLE, details
    assert "sandbox abababababab: " in details
    assert len(details) <= 2100
    assert _sandbox_state(server) == pb.SANDBOX_READY  # a bad line is no proof the containers are gone
    code, details, status = _status(server)
    assert code == grpc.StatusCode.OK, details
    assert status.state == pb.CONTAINER_RUNNING
    assert g.connections == 2


def test_deep_nesting_as_the_greeting_answer_is_unavailable_not_internal(
    server: Server, guest: Callable[[Callable[[int, fg.Peer], None]], fg.FakeGuest]
) -> None:
    nested = b'{"v":2,"type":"response","id":"0","ok":true,"body":' + b"[" * 100_000 + b"]" * 100_000 + b"}\n"
    guest(lambda n, peer: peer.serve(lambda msg: nested))
    code, details, _ = _status(server)
    assert code == grpc.StatusCode.UNAVAILABLE, details
    assert details.startswith("sandbox abababababab: the guest agent sent a bad message: ")
    assert len(details) <= 2100
    assert _sandbox_state(server) == pb.SANDBOX_READY


def test_an_agent_that_does_not_know_its_container_is_lost(
    server: Server, guest: Callable[[Callable[[int, fg.Peer], None]], fg.FakeGuest]
) -> None:
    unknown = {"status": lambda msg: fg.refused(msg["id"], f'no container "{SEED_CONTAINER}"', UNKNOWN_CONTAINER)}
    guest(lambda n, peer: peer.serve(fg.agent(answers=unknown)))
    _assert_lost(server, f"does not know container {SEED_CONTAINER[:12]}")


def test_another_agent_instance_at_connect_is_a_lost_agent(
    server: Server, guest: Callable[[Callable[[int, fg.Peer], None]], fg.FakeGuest]
) -> None:
    guest(lambda n, peer: peer.serve(fg.agent(fg.OTHER_INSTANCE, answers={"status": _running()})))
    _assert_lost(server, f"instance {fg.OTHER_INSTANCE}, not {fg.INSTANCE}")


def test_a_new_instance_greeting_on_a_live_connection_is_noticed_without_an_rpc(
    server: Server, guest: Callable[[Callable[[int, fg.Peer], None]], fg.FakeGuest]
) -> None:
    def script(n: int, peer: fg.Peer) -> None:
        answer = fg.agent(answers={"status": _running()})
        msg = peer.recv()  # the greeting request
        assert msg is not None
        peer.send(answer(msg))
        msg = peer.recv()  # ContainerStatus's status
        assert msg is not None
        peer.send(answer(msg))
        time.sleep(0.3)
        peer.send(fg.hello(fg.OTHER_INSTANCE))  # the agent restarted: it greets whoever listens
        while peer.recv() is not None:
            pass

    guest(script)
    code, details, status = _status(server)
    assert (code, status.state) == (grpc.StatusCode.OK, pb.CONTAINER_RUNNING), details
    deadline = time.monotonic() + 10
    while _sandbox_state(server) != pb.SANDBOX_NOTREADY:
        assert time.monotonic() < deadline, "the sandbox stayed READY after its agent started over"
        time.sleep(0.05)
    _assert_lost(server, "started over")


def test_the_same_instance_reconnecting_is_not_a_lost_agent(
    server: Server, guest: Callable[[Callable[[int, fg.Peer], None]], fg.FakeGuest]
) -> None:
    def script(n: int, peer: fg.Peer) -> None:
        answer = fg.agent(answers={"status": _running()})
        for _ in range(2):  # the greeting and one request, then hang up: the next call reconnects
            msg = peer.recv()
            assert msg is not None
            peer.send(answer(msg))

    g = guest(script)
    for _ in range(3):
        code, details, status = _status(server)
        assert (code, status.state) == (grpc.StatusCode.OK, pb.CONTAINER_RUNNING), details
        time.sleep(0.1)  # the hang-up reaches the client before the next call
    assert _sandbox_state(server) == pb.SANDBOX_READY
    assert g.connections >= 2


@pytest.mark.parametrize(
    ("instance", "state"), [(fg.INSTANCE, pb.SANDBOX_READY), (fg.OTHER_INSTANCE, pb.SANDBOX_NOTREADY)]
)
def test_watch_guests_adopts_the_same_instance_and_notices_another(
    server: Server, guest: Callable[[Callable[[int, fg.Peer], None]], fg.FakeGuest], instance: str, state: int
) -> None:
    """What the shim runs at start-up and periodically: no RPC needed to notice an agent that started over."""
    guest(lambda n, peer: peer.serve(fg.agent(instance)))
    assert server.containers is not None
    assert server.containers.pool.watch_guests() == (1 if state == pb.SANDBOX_READY else 0)
    assert _sandbox_state(server) == state


def test_a_lost_agent_reported_twice_or_for_a_removed_sandbox_changes_nothing(server: Server) -> None:
    assert server.sandboxes.reconciler.agent_lost(SANDBOX, "first") is True
    assert server.sandboxes.reconciler.agent_lost(SANDBOX, "second") is False
    assert server.sandboxes.records.get(SANDBOX).guest["lost"] == "first"
    assert server.sandboxes.reconciler.agent_lost("f" * 64, "gone") is False


def test_a_lost_agent_is_logged_with_the_last_lines_of_its_guest_console(
    server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Why the agent started over is in the guest's console (its init logs the agent's exit)."""
    console_dir = tmp_path / "console"
    console_dir.mkdir()
    (console_dir / f"{SANDBOX}.log").write_bytes(b"booted\nvmsandbox-init: agent stopped (status 2), restarting\n")
    reconciler = server.sandboxes.reconciler
    monkeypatch.setattr(reconciler, "config", replace(reconciler.config, console_dir=str(console_dir)))
    with caplog.at_level("WARNING", logger="shim.reconcile"):
        assert reconciler.agent_lost(SANDBOX, "it started over") is True
    assert "last console lines: booted | vmsandbox-init: agent stopped (status 2), restarting" in caplog.text
