"""The front process (``front/``, ``vmsandbox-front``): started, watched and stopped by the shim.

With a downstream runtime, the CRI socket is read first by the front, a Go program that sends the
calls the kubelet makes all the time for ordinary pods straight to the downstream and relays
everything else to the shim's own socket (``<state_dir>/shim.sock``, root only). The shim makes
the CRI socket itself (its mode and group as without a front) and hands the front the listening
descriptor; the front's standard input is a pipe from the shim, so it exits when the shim does.
A front that dies is started again (the socket keeps its queue meanwhile).

The front asks vmsandbox's own side of ``ListPodSandbox`` and ``ListContainers`` on a socket pair
of their own (``ListChannel``), answered here without gRPC: the lists are what the kubelet asks
most often, and a gRPC call into the shim costs several times what the answer does. An answer
made from the records alone carries the records' generation (``Records.generation``), and each
new generation is sent to the front as it happens: the front answers the same list again from
what it kept while the generation stands. The frame format is written in ``front/lists.go``.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from vmsandbox.errors import InfrastructureError, InvalidArgument

if TYPE_CHECKING:
    from shim.config import ShimConfig

log = logging.getLogger(__name__)

SHIM_SOCKET = "shim.sock"  # below state_dir: the shim's own gRPC socket when a front reads the CRI socket
_RESTART_DELAY_S = (0.2, 5.0)  # first and longest wait before a dead front is started again
_HEAD = struct.Struct(">IIB")  # length of the rest, request id, op
_GENERATION = struct.Struct(">Q")
_LISTS = {1: "ListPodSandbox", 2: "ListContainers"}
_REPLY, _FAILED, _REPLY_KEPT, _GENERATION_NOW = 0, 1, 2, 3  # the shim's ops
_MAX_REQUEST = 1 << 20  # a list request is a filter: anything longer ends the channel
_LIST_WORKERS = 4  # lists answered at once (one may wait on a guest's agent)
_MAX_LOG_LINE = 2048

# answers a list: the method name and the request's bytes to the reply's bytes and the generation
# it holds for (None: ask again each time); aborts like a servicer
ListAnswer = Callable[[str, bytes, Any], tuple[bytes, int | None]]


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class _ChannelContext:
    """What a servicer uses of its context, for a call that came on the list channel."""

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)

    def invocation_metadata(self) -> tuple[()]:
        return ()

    def time_remaining(self) -> None:
        return None


class ListChannel:
    """Serves the front's end of a socket pair until it closes."""

    def __init__(self, sock: socket.socket, answer: ListAnswer, generation: int) -> None:
        self.sock = sock
        self.answer = answer
        self._write = threading.Lock()
        self._pool = futures.ThreadPoolExecutor(_LIST_WORKERS, thread_name_prefix="front-lists")
        self._generation = generation  # the newest, to be sent by the pusher
        self._changed = threading.Condition()
        self._closed = False
        threading.Thread(target=self._read, name="front-lists", daemon=True).start()
        threading.Thread(target=self._push, name="front-generation", daemon=True).start()

    def generation_changed(self, generation: int) -> None:
        """A new generation of the records (never blocks: the pusher sends the newest)."""
        with self._changed:
            self._generation = max(self._generation, generation)
            self._changed.notify()

    def _push(self) -> None:
        sent = 0
        while True:
            with self._changed:
                while self._generation == sent and not self._closed:
                    self._changed.wait()
                if self._closed:
                    return
                sent = self._generation
            self._send(0, _GENERATION_NOW, _GENERATION.pack(sent))

    def _send(self, request_id: int, op: int, payload: bytes) -> None:
        with self._write, contextlib.suppress(OSError):  # the front gone: the reader sees it too
            self.sock.sendall(_HEAD.pack(len(payload) + _HEAD.size - 4, request_id, op) + payload)

    def _read(self) -> None:
        reader = self.sock.makefile("rb")
        try:
            while True:
                head = reader.read(_HEAD.size)
                if len(head) < _HEAD.size:
                    return
                length, request_id, op = _HEAD.unpack(head)
                if not _HEAD.size - 4 <= length <= _MAX_REQUEST or op not in _LISTS:
                    log.error("front list channel: a frame of op %d and length %d; closing it", op, length)
                    return
                data = reader.read(length - (_HEAD.size - 4))
                if len(data) < length - (_HEAD.size - 4):
                    return
                self._pool.submit(self._serve, request_id, _LISTS[op], data)
        finally:
            with self._changed:
                self._closed = True
                self._changed.notify()
            self._pool.shutdown(wait=False)
            self.sock.close()

    def _serve(self, request_id: int, name: str, data: bytes) -> None:
        try:
            reply, generation = self.answer(name, data, _ChannelContext())
        except Aborted as exc:
            self._send(request_id, _FAILED, bytes([exc.code.value[0]]) + exc.details.encode()[:4096])
        except Exception as exc:  # a servicer's own errors abort; anything else is a bug
            log.exception("front list channel: %s failed", name)
            message = f"{name}: internal error: {exc}".encode()[:4096]
            self._send(request_id, _FAILED, bytes([grpc.StatusCode.INTERNAL.value[0]]) + message)
        else:
            if generation is None:
                self._send(request_id, _REPLY, reply)
            else:
                self._send(request_id, _REPLY_KEPT, _GENERATION.pack(generation) + reply)


@dataclass(frozen=True)
class FrontLimits:
    """What the front holds for its clients, passed as its flags; the defaults are the flags' own
    (``front/limits.go``) and the configuration's (``front_max_conns``, ...)."""

    max_conns: int = 256  # client connections at once; one more gets GOAWAY
    max_buffered_mib: int = 256  # requests, replies collected whole and replies waiting, all clients
    window_timeout_s: float = 10.0  # a reply waiting this long for its client's window is reset
    idle_timeout_s: float = 300.0  # a connection with no stream and no frame this long gets GOAWAY

    @classmethod
    def of(cls, config: ShimConfig) -> FrontLimits:
        return cls(
            max_conns=config.front_max_conns,
            max_buffered_mib=config.front_max_buffered_mib,
            window_timeout_s=config.front_window_timeout_s,
            idle_timeout_s=config.front_idle_timeout_s,
        )

    def flags(self) -> list[str]:
        return [
            "-max-conns",
            str(self.max_conns),
            "-max-buffered-mib",
            str(self.max_buffered_mib),
            "-window-timeout",
            repr(float(self.window_timeout_s)),
            "-idle-timeout",
            repr(float(self.idle_timeout_s)),
        ]


def _relay_log(process: subprocess.Popen[bytes]) -> None:
    """The front's lines into the shim's log (its format and level), each bounded."""
    assert process.stderr is not None
    stderr = process.stderr
    for line in iter(lambda: stderr.readline(_MAX_LOG_LINE), b""):
        log.warning("front (pid %d): %s", process.pid, line.decode(errors="replace").rstrip())


def shim_socket(state_dir: str) -> Path:
    return Path(state_dir) / SHIM_SOCKET


def check_binary(path: str) -> None:
    """A front that cannot be run is a configuration error, said before anything starts."""
    binary = Path(path)
    if not binary.is_file():
        raise InvalidArgument(
            f"front_binary {path} does not exist: build it with scripts/build-front.sh (make setup does), "
            "or set front_binary: '' to let the shim read the CRI socket itself"
        )


class Front:
    def __init__(
        self,
        binary: str,
        listener: socket.socket,
        shim: Path,
        endpoint: str,
        timeout_s: float,
        lists: ListAnswer,
        generation: Callable[[], int],
        limits: FrontLimits | None = None,
    ) -> None:
        self.listener = listener
        self.lists = lists
        self.generation = generation
        self._channel: ListChannel | None = None
        self.argv = [
            binary,
            "-listen-fd",
            str(listener.fileno()),
            "-shim",
            str(shim),
            "-downstream",
            endpoint,
            "-downstream-timeout",
            repr(timeout_s),
            *(limits or FrontLimits()).flags(),
        ]
        self._process: subprocess.Popen[bytes] | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._watcher: threading.Thread | None = None

    def start(self) -> None:
        self._spawn()
        self._watcher = threading.Thread(target=self._watch, name="front-watch", daemon=True)
        self._watcher.start()

    def _spawn(self) -> None:
        mine, theirs = socket.socketpair()
        try:
            process = subprocess.Popen(
                [*self.argv, "-lists-fd", str(theirs.fileno())],
                stdin=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(self.listener.fileno(), theirs.fileno()),
            )
        except OSError as exc:
            mine.close()
            raise InfrastructureError(f"cannot start the front {self.argv[0]}: {exc}") from None
        finally:
            theirs.close()
        threading.Thread(target=_relay_log, args=(process,), name="front-log", daemon=True).start()
        channel = ListChannel(mine, self.lists, self.generation())
        with self._lock:
            self._channel = channel
            self._process = process
        log.info("front %s started (pid %d)", self.argv[0], process.pid)

    def generation_changed(self, generation: int) -> None:
        with self._lock:
            channel = self._channel
        if channel is not None:
            channel.generation_changed(generation)

    @property
    def pid(self) -> int | None:
        with self._lock:
            return self._process.pid if self._process is not None else None

    def _watch(self) -> None:
        delay = _RESTART_DELAY_S[0]
        while not self._stopping.is_set():
            with self._lock:
                process = self._process
            assert process is not None
            started = time.monotonic()
            code = process.wait()
            if self._stopping.is_set():
                return
            log.error("front (pid %d) exited with %s; starting it again in %.1f s", process.pid, code, delay)
            if self._stopping.wait(delay):
                return
            delay = _RESTART_DELAY_S[0] if time.monotonic() - started > 60 else min(delay * 2, _RESTART_DELAY_S[1])
            try:
                self._spawn()
            except InfrastructureError as exc:
                log.error("%s", exc)
                with self._lock:
                    self._process = process  # waited on again at once: the next try after a longer delay

    def stop(self, timeout_s: float = 5.0) -> None:
        """Closes the front's pipe (it exits), waits for it, then lets the CRI socket go."""
        self._stopping.set()
        with self._lock:
            process = self._process
        if process is not None:
            if process.stdin is not None:
                process.stdin.close()
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._watcher is not None:
            self._watcher.join(timeout_s)
        self.listener.close()
