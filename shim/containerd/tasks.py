"""``Tasks``: the one owner of what shim mode keeps about containerd's tasks beside the container
records: each container's stdio (containerd's fifos) and each exec process.

A container's fifos are recorded, one small JSON file per container under
``<state_dir>/containerd/tasks/`` (host-only), before the container is made, so the log copy of a
shim that restarts writes on to them (``sink``) and the container's exit is still reported. The
pods containerd made are marked under ``<state_dir>/containerd/sandboxes/`` likewise: containerd
drops a shim whose connection it lost, so those a vmsandbox that stopped leaves are removed when the
next one starts (``shim.containerd.front``). Exec
processes live in memory only: a shim that restarts loses their sessions, as the kubelet's
streaming Exec does (containerd sees their connection go).

An exit is recorded once (``exited``) and wakes every ``wait`` on it; the caller publishes the
event. Nothing here talks to a guest or to containerd.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from vmsandbox import validation
from vmsandbox.adapters.agent_streams import AgentStream
from vmsandbox.errors import AlreadyExists, InvalidArgument, NotFound

if TYPE_CHECKING:
    from shim.containerd.stdio import StdinFeed

MAX_RECORD_BYTES = 16 * 1024


@dataclass(frozen=True)
class TaskIO:
    """The fifos containerd made for a task or an exec ("": none), and whether it has a terminal."""

    stdin: str = ""
    stdout: str = ""
    stderr: str = ""
    terminal: bool = False

    def to_doc(self) -> dict[str, object]:
        return {"stdin": self.stdin, "stdout": self.stdout, "stderr": self.stderr, "terminal": self.terminal}

    @staticmethod
    def from_doc(doc: object) -> TaskIO:
        if not isinstance(doc, dict):
            raise ValueError("not an object")
        return TaskIO(str(doc["stdin"]), str(doc["stdout"]), str(doc["stderr"]), bool(doc["terminal"]))


def check_io(io: TaskIO, where: str) -> TaskIO:
    """Fifo paths are absolute and normalised (containerd's are); anything else is refused."""
    for name in ("stdin", "stdout", "stderr"):
        path = getattr(io, name)
        if path and (not path.startswith("/") or "\x00" in path or ".." in path.split("/")):
            raise InvalidArgument(f"{where}.{name} {validation.quote(path[:256])} is not an absolute fifo path")
    return io


@dataclass
class Exit:
    """A process's end, once it came."""

    done: threading.Event = field(default_factory=threading.Event)
    code: int = 0
    at_ns: int = 0

    def set(self, code: int, at_ns: int = 0) -> bool:
        """Records the exit; False when it was recorded already (the first one stands)."""
        if self.done.is_set():
            return False
        self.code, self.at_ns = code, at_ns or time.time_ns()
        self.done.set()
        return True


@dataclass
class ExecProcess:
    container_id: str
    exec_id: str
    io: TaskIO
    argv: tuple[str, ...]
    stream: AgentStream | None = None
    exit: Exit = field(default_factory=Exit)
    feed: StdinFeed | None = None  # its stdin's, once started with one


class Tasks:
    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.root = Path(state_dir) / "containerd" / "tasks"
        self.sandboxes = Path(state_dir) / "containerd" / "sandboxes"
        self._lock = threading.Lock()
        self._exits: dict[str, Exit] = {}
        self._execs: dict[tuple[str, str], ExecProcess] = {}
        self._attached: dict[str, AgentStream] = {}  # a container's own stdio session (stdin, terminal)
        self._feeds: dict[str, StdinFeed] = {}  # its stdin's feed

    def _path(self, cid: str) -> Path:
        if not validation.is_full_id(cid):
            raise InvalidArgument(f"task id {validation.quote(cid[:80])} is not a container id (64 hex digits)")
        return self.root / f"{cid}.json"

    # -- containers --------------------------------------------------------------------------------
    def add(self, cid: str, io: TaskIO) -> None:
        """Records a container's fifos (undo: ``forget``)."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = self._path(cid)
        tmp = path.with_name(f".{cid}.tmp")
        tmp.write_text(json.dumps(io.to_doc()))
        os.replace(tmp, path)
        with self._lock:
            self._exits.setdefault(cid, Exit())

    def io(self, cid: str) -> TaskIO | None:
        """The container's fifos; None for a container shim mode did not make."""
        try:
            with self._path(cid).open("rb") as f:
                return TaskIO.from_doc(json.loads(f.read(MAX_RECORD_BYTES)))
        except (FileNotFoundError, InvalidArgument):
            return None
        except (ValueError, KeyError, OSError):
            return None

    def known(self) -> list[str]:
        """The containers whose fifos are recorded."""
        try:
            return sorted(p.stem for p in self.root.glob("*.json") if validation.is_full_id(p.stem))
        except OSError:
            return []

    def exit_of(self, cid: str) -> Exit:
        with self._lock:
            return self._exits.setdefault(cid, Exit())

    def exited(self, cid: str, code: int, at_ns: int = 0) -> bool:
        """The container's exit; False when it was known already."""
        return self.exit_of(cid).set(code, at_ns)

    def attach(self, cid: str, stream: AgentStream, feed: StdinFeed | None = None) -> None:
        """The session on the container's own stdin and terminal, and its stdin's feed."""
        with self._lock:
            self._attached[cid] = stream
            if feed is not None:
                self._feeds[cid] = feed

    def attached(self, cid: str) -> AgentStream | None:
        """The session on the container's own stdin and terminal, while it has one."""
        with self._lock:
            return self._attached.get(cid)

    def attached_feed(self, cid: str) -> StdinFeed | None:
        """The feed of the container's own stdin, while it has one."""
        with self._lock:
            return self._feeds.get(cid)

    def forget(self, cid: str) -> None:
        with self._lock:
            self._exits.pop(cid, None)
            self._attached.pop(cid, None)
            self._feeds.pop(cid, None)
            for key in [k for k in self._execs if k[0] == cid]:
                del self._execs[key]
        with contextlib.suppress(FileNotFoundError, InvalidArgument):
            self._path(cid).unlink()

    # -- sandboxes ---------------------------------------------------------------------------------
    def add_sandbox(self, sandbox_id: str) -> None:
        """Records that containerd made ``sandbox_id`` (before it is made; undo: ``forget_sandbox``)."""
        self._path(sandbox_id)  # checks the id
        self.sandboxes.mkdir(mode=0o700, parents=True, exist_ok=True)
        (self.sandboxes / sandbox_id).touch()

    def known_sandboxes(self) -> list[str]:
        try:
            return sorted(p.name for p in self.sandboxes.iterdir() if validation.is_full_id(p.name))
        except OSError:
            return []

    def forget_sandbox(self, sandbox_id: str) -> None:
        with contextlib.suppress(FileNotFoundError, InvalidArgument):
            self._path(sandbox_id)
            (self.sandboxes / sandbox_id).unlink()

    # -- exec processes ----------------------------------------------------------------------------
    def add_exec(self, p: ExecProcess) -> None:
        with self._lock:
            if (p.container_id, p.exec_id) in self._execs:
                raise AlreadyExists(f"exec {validation.quote(p.exec_id)} of task {p.container_id[:12]} exists already")
            self._execs[(p.container_id, p.exec_id)] = p

    def exec(self, cid: str, exec_id: str) -> ExecProcess:
        with self._lock:
            p = self._execs.get((cid, exec_id))
        if p is None:
            raise NotFound(f"exec {validation.quote(exec_id[:80])} of task {cid[:12]} does not exist")
        return p

    def drop_exec(self, cid: str, exec_id: str) -> ExecProcess:
        with self._lock:
            p = self._execs.pop((cid, exec_id), None)
        if p is None:
            raise NotFound(f"exec {validation.quote(exec_id[:80])} of task {cid[:12]} does not exist")
        return p

    def execs_of(self, cid: str) -> list[ExecProcess]:
        with self._lock:
            return [p for (c, _), p in self._execs.items() if c == cid]
