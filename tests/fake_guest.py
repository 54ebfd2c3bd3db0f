"""The guest end of an agent channel for tests: a unix socket server whose connections are each
served by a script (a fake agent), so that the real host code (guest_channel, agent_client and
the shim above them) talks to whatever a test wants a guest to say, hostile lines included."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Callable
from pathlib import Path

from vmsandbox.agent_protocol import UNKNOWN_CONTAINER

INSTANCE = "0123456789abcdef0123456789abcdef"
OTHER_INSTANCE = "fedcba9876543210fedcba9876543210"


def report_body(instance: str = INSTANCE) -> dict[str, object]:
    body: dict[str, object] = {
        "agent": "vmsandbox-agent/2",
        "protocol": 2,
        "kernel": "6.1.0-56-amd64",
        "vcpus": 1,
        "mem_total_kib": 200000,
        "hugepages": {"2048": {"total": 0, "free": 0}},
        "cmdline": "console=ttyS0",
        "boot_ms": 1000,
    }
    if instance:
        body["instance"] = instance
    return body


def line(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def hello(instance: str = INSTANCE) -> bytes:
    return line({"v": 2, "type": "hello", "body": report_body(instance)})


def ok(rid: object, body: object) -> bytes:
    return line({"v": 2, "type": "response", "id": rid, "ok": True, "body": body})


def refused(rid: object, error: str, code: str = "") -> bytes:
    msg: dict[str, object] = {"v": 2, "type": "response", "id": rid, "ok": False, "error": error}
    if code:
        msg["code"] = code
    return line(msg)


def state(cid: str, st: str = "running") -> dict[str, object]:
    return {
        "id": cid,
        "state": st,
        "pid": 10,
        "exit_code": 0,
        "signal": 0,
        "oom_killed": False,
        "created_at_ns": 1,
        "started_at_ns": 2,
        "finished_at_ns": 0,
    }


class Peer:
    """One connection, from the guest's side: read the host's requests, write anything."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._file = sock.makefile("rb")

    def recv(self) -> dict[str, object] | None:
        """The host's next message, None when it hung up."""
        try:
            data = self._file.readline()
        except OSError:
            return None
        return json.loads(data) if data else None

    def send(self, data: bytes) -> bool:
        """False when the host hung up."""
        try:
            self.sock.sendall(data)
        except OSError:
            return False
        return True

    def serve(self, answer: Callable[[dict[str, object]], bytes | None]) -> None:
        """Answer each request with ``answer(request)`` (None: no answer) until the host hangs up."""
        while (msg := self.recv()) is not None:
            if msg.get("type") == "request":
                out = answer(msg)
                if out is not None and not self.send(out):
                    return


class FakeGuest:
    """Listens on ``path``; connection number n (from 0) runs ``script(n, peer)`` in its own thread."""

    def __init__(self, path: Path, script: Callable[[int, Peer], None]) -> None:
        self.path = path
        self.connections = 0
        self.errors: list[BaseException] = []
        self._script = script
        self._server = socket.socket(socket.AF_UNIX)
        self._server.bind(str(path))
        self._server.listen()
        self._peers: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._server.accept()
            except OSError:
                return
            n = self.connections
            self.connections += 1
            self._peers.append(sock)
            threading.Thread(target=self._run, args=(n, sock), daemon=True).start()

    def _run(self, n: int, sock: socket.socket) -> None:
        try:
            self._script(n, Peer(sock))
        except BaseException as exc:  # reported by close()
            self.errors.append(exc)
        finally:
            with contextlib.suppress(OSError):
                sock.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)
        self._server.close()
        for sock in self._peers:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=5)
        if self.errors:
            raise self.errors[0]


def agent(
    instance: str = INSTANCE, answers: dict[str, Callable[[dict[str, object]], bytes]] | None = None
) -> Callable[[dict[str, object]], bytes]:
    """An answer function like the real agent's: ``report`` with ``instance``, ``ping``, and ``answers``
    by op; other ops refused."""

    def answer(msg: dict[str, object]) -> bytes:
        op = str(msg.get("op"))
        if answers and op in answers:
            return answers[op](msg)
        if op == "report":
            return ok(msg["id"], report_body(instance))
        if op == "ping":
            return ok(msg["id"], {})
        return refused(msg["id"], f"unknown op: {op}")

    return answer


class ContainerAgent:
    """A fake agent that keeps what a real one keeps of containers and volume copies, and every
    request it was asked (``asked``): container RPCs run against it, and a test reads what the
    guest is left holding (``containers``, ``volumes``) and what it was told (``cgroup``). The
    ops in ``refuse`` fail, as a guest that cannot carry them out answers."""

    PROTOCOL = 7  # image volumes, volume copies and terminals

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.containers: dict[str, str] = {}  # id -> created, running or exited
        self.volumes: dict[str, str] = {}  # volume id -> the version committed
        self.cgroup: dict[str, dict[str, str]] = {}  # container id -> the limit files written last
        self.asked: list[str] = []  # ops, in order
        self.refuse: set[str] = set()  # ops refused, as a guest that cannot carry them out
        self.creates: dict[str, dict[str, object]] = {}  # container id -> the args of its create

    LOG_WAIT_S = 0.2  # how long a log_read waits for output that never comes (a long poll, answered apart)

    def serve(self, n: int, peer: Peer) -> None:
        """A ``FakeGuest`` script: every connection is served by this agent."""
        lock = threading.Lock()

        def send(data: bytes) -> None:
            with lock:
                peer.send(data)

        while (msg := peer.recv()) is not None:
            if msg.get("type") != "request":
                continue
            if msg.get("op") == "log_read":
                threading.Timer(self.LOG_WAIT_S, lambda m=msg: send(self.answer(m))).start()
            else:
                send(self.answer(msg))

    def answer(self, msg: dict[str, object]) -> bytes:
        op, rid = str(msg.get("op")), msg["id"]
        args = msg.get("args")
        a: dict[str, object] = args if isinstance(args, dict) else {}
        with self._lock:
            self.asked.append(op)
            if op == "report":
                body = report_body()
                return ok(rid, {**body, "protocol": self.PROTOCOL, "agent": f"vmsandbox-agent/{self.PROTOCOL}"})
            if op == "ping":
                return ok(rid, {})
            if op == "list":
                return ok(rid, {"containers": [self._state(c) for c in self.containers]})
            if op in self.refuse:
                return refused(rid, f"{op} failed in the guest")
            if op.startswith("volume_"):
                return self._volume(op, rid, a)
            cid = str(a.get("id", ""))
            if op == "create":
                if cid in self.containers:
                    return refused(rid, f'container "{cid}" exists')
                self.containers[cid] = "created"
                self.creates[cid] = a
                return ok(rid, self._state(cid))
            if cid not in self.containers:
                return refused(rid, f'no container "{cid}"', UNKNOWN_CONTAINER)
            if op == "start":
                if self.containers[cid] != "created":
                    return refused(rid, f'container "{cid}" is {self.containers[cid]}')
                self.containers[cid] = "running"
            elif op == "kill":
                if self.containers[cid] == "running":
                    self.containers[cid] = "exited"
            elif op == "delete":
                del self.containers[cid]
                self.cgroup.pop(cid, None)
                return ok(rid, {})
            elif op == "update":
                files = a.get("files")
                self.cgroup[cid] = dict(files) if isinstance(files, dict) else {}
                return ok(rid, {})
            elif op == "log_read":  # no output; the log ends with the container
                return ok(rid, {"offset": a.get("offset", 0), "data": "", "eof": self.containers[cid] == "exited"})
            elif op not in ("status", "wait"):
                return refused(rid, f"unknown op: {op}")
            return ok(rid, self._state(cid))

    def _state(self, cid: str) -> dict[str, object]:
        st = self.containers[cid]
        body = state(cid, st)
        if st == "exited":
            body.update(exit_code=137, finished_at_ns=3)
        return body

    def _volume(self, op: str, rid: object, a: dict[str, object]) -> bytes:
        vid = str(a.get("volume", ""))
        if op == "volume_begin":
            return ok(rid, {"current": self.volumes.get(vid) == a.get("version")})
        if op == "volume_commit":
            self.volumes[vid] = str(a.get("version", ""))
        elif op == "volume_remove":
            self.volumes.pop(vid, None)
        return ok(rid, {})
