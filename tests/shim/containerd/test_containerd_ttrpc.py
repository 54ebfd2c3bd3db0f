"""Shim mode's ttrpc against containerd's own Go client and server (tests/containerd_ttrpc/, built
with the modules containerd v2.4.2 builds with): a ``TtrpcServer`` answers the generated
``containerd.task.v3.Task`` client, its errors read by containerd's errgrpc and errdefs as their
codes say, and an ``EventPublisher``'s ``Forward`` is decoded by containerd's events service and
typeurl. Quick once Go's module cache holds those modules (the first build fetches them)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.message import Message

from gen.containerd.events import task_pb2 as events
from gen.containerd.runtime.task.v3 import shim_pb2
from gen.containerd.types.task import task_pb2
from shim.containerd.events import EventPublisher
from shim.containerd.ttrpc_server import TtrpcServer
from shim.containerd.wire import handler, timestamp
from tests.front.test_front_go import go
from vmsandbox.errors import AlreadyExists, InvalidArgument, NotFound, Unsupported

PROGRAM = Path(__file__).resolve().parents[2] / "containerd_ttrpc"
TASK_SERVICE = "containerd.task.v3.Task"


def _go_env() -> dict[str, str]:
    return {**os.environ, "GOTOOLCHAIN": "local", "GO111MODULE": "on", "GOFLAGS": "-mod=mod"}


def test_go_vet() -> None:
    out = subprocess.run(
        [go(), "vet", "./..."], cwd=PROGRAM, env=_go_env(), capture_output=True, text=True, timeout=600, check=False
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    binary = tmp_path_factory.mktemp("containerd_ttrpc") / "containerd_ttrpc"
    built = subprocess.run(
        [go(), "build", "-o", str(binary), "."],
        cwd=PROGRAM,
        env=_go_env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert built.returncode == 0, built.stderr[-4000:]
    return binary


def state(req: shim_pb2.StateRequest) -> Message:
    if req.id == "running":
        return shim_pb2.StateResponse(
            id=req.id, bundle="/run/b", pid=42, status=task_pb2.RUNNING, stdout="/run/fifo-1", terminal=True
        )
    if req.id == "exited":
        return shim_pb2.StateResponse(id=req.id, status=task_pb2.STOPPED, exit_status=137)
    raise {
        "gone": NotFound("container gone not found"),
        "bad": InvalidArgument("id bad is not valid"),
        "twice": AlreadyExists("container twice exists"),
        "later": Unsupported("State of later is not built"),
    }.get(req.id, RuntimeError("a bug"))


@pytest.fixture
def task_socket(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "shim.sock"
    server = TtrpcServer(path, {TASK_SERVICE: {"State": handler(shim_pb2.StateRequest, state)}}, name="test-shim")
    server.start()
    yield path
    server.close()


CASES: list[tuple[str, dict[str, Any]]] = [
    ("running", {"id": "running", "bundle": "/run/b", "pid": 42, "status": "RUNNING", "exit_status": 0,
                 "stdout": "/run/fifo-1", "terminal": True}),
    ("exited", {"id": "exited", "bundle": "", "pid": 0, "status": "STOPPED", "exit_status": 137, "stdout": "",
                "terminal": False}),
    ("gone", {"kind": "not_found", "says": "container gone not found"}),
    ("bad", {"kind": "invalid_argument", "says": "id bad is not valid"}),
    ("twice", {"kind": "already_exists", "says": "container twice exists"}),
    ("later", {"kind": "not_implemented", "says": "State of later is not built"}),
    ("bug", {"kind": "internal", "says": "State: internal error: RuntimeError: a bug"}),
]  # fmt: skip


def test_containerds_task_client_reads_state_errors_and_what_is_not_served(program: Path, task_socket: Path) -> None:
    ran = subprocess.run(
        [str(program), "state", str(task_socket), *(id_ for id_, _ in CASES)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert ran.returncode == 0, ran.stderr[-4000:]
    *got, pids = [json.loads(line) for line in ran.stdout.splitlines()]
    assert len(got) == len(CASES)
    assert pids["kind"] == "not_implemented", pids
    assert "containerd.task.v3.Task/Pids" in pids["error"]
    for (id_, want), line in zip(CASES, got, strict=True):
        if "kind" in want:
            assert line["id"] == id_
            assert line["kind"] == want["kind"], line
            assert want["says"] in line["error"], line
        else:
            assert line == want


def test_containerds_events_service_decodes_what_the_publisher_forwards(program: Path, tmp_path: Path) -> None:
    path = tmp_path / "containerd.sock.ttrpc"
    sent: list[tuple[str, Message]] = [
        ("/tasks/create", events.TaskCreate(container_id="c1", bundle="/run/b", pid=42)),
        ("/tasks/oom", events.TaskOOM(container_id="c1")),
        ("/tasks/exit", events.TaskExit(container_id="c1", id="c1", pid=42, exit_status=137,
                                        exited_at=timestamp(1_700_000_000_000_000_000))),
    ]  # fmt: skip
    server = subprocess.Popen(
        [str(program), "events", str(path), str(len(sent))], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        assert server.stdout.readline().strip() == "listening"
        publisher = EventPublisher(f"unix://{path}", "k8s.io")
        for topic, event in sent:
            publisher.publish(topic, event)
        out, err = server.communicate(timeout=30)
        publisher.close()
    finally:
        server.kill()
        server.wait()
    assert server.returncode == 0, err[-4000:]
    got = [json.loads(line) for line in out.splitlines()]
    assert [g["topic"] for g in got] == [topic for topic, _ in sent]
    for g, (_, event) in zip(got, sent, strict=True):
        assert g["namespace"] == "k8s.io"
        assert g["timestamp_set"] is True
        assert g["type_url"] == event.DESCRIPTOR.full_name
        assert "error" not in g, g
        assert g["go_type"] == "*events." + type(event).__name__
    assert got[0]["event"] == {"container_id": "c1", "bundle": "/run/b", "pid": 42}
    assert got[1]["event"] == {"container_id": "c1"}
    assert got[2]["event"] == {
        "container_id": "c1", "id": "c1", "pid": 42, "exit_status": 137, "exited_at": "2023-11-14T22:13:20Z"
    }  # fmt: skip
