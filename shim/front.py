"""The front process (``front/``, ``vmsandbox-front``): started, watched and stopped by the shim.

With a downstream runtime, the CRI socket is read first by the front, a Go program that sends the
calls the kubelet makes all the time for ordinary pods straight to the downstream and relays
everything else to the shim's own socket (``<state_dir>/shim.sock``, root only). The shim makes
the CRI socket itself (its mode and group as without a front) and hands the front the listening
descriptor; the front's standard input is a pipe from the shim, so it exits when the shim does.
A front that dies is started again (the socket keeps its queue meanwhile).

The front asks vmsandbox's own side of ``ListPodSandbox`` and ``ListContainers`` on a socket pair
of their own (``ListChannel``), answered here without gRPC: the lists are what the kubelet asks
most often, and a gRPC call into the shim costs several times what the answer does. The frame
format is written in ``front/lists.go``.
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
from pathlib import Path
from typing import Any

import grpc

from vmsandbox.errors import InfrastructureError, InvalidArgument

log = logging.getLogger(__name__)

SHIM_SOCKET = "shim.sock"  # below state_dir: the shim's own gRPC socket when a front reads the CRI socket
_RESTART_DELAY_S = (0.2, 5.0)  # first and longest wait before a dead front is started again
_HEAD = struct.Struct(">IIB")  # length of the rest, request id, op
_LISTS = {1: "ListPodSandbox", 2: "ListContainers"}
_MAX_REQUEST = 1 << 20  # a list request is a filter: anything longer ends the channel
_LIST_WORKERS = 4  # lists answered at once (one may wait on a guest's agent)

# answers a list: the method name and the request's bytes to the reply's bytes; aborts like a servicer
ListAnswer = Callable[[str, bytes, Any], bytes]


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

    def __init__(self, sock: socket.socket, answer: ListAnswer) -> None:
        self.sock = sock
        self.answer = answer
        self._write = threading.Lock()
        self._pool = futures.ThreadPoolExecutor(_LIST_WORKERS, thread_name_prefix="front-lists")
        threading.Thread(target=self._read, name="front-lists", daemon=True).start()

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
            self._pool.shutdown(wait=False)
            self.sock.close()

    def _serve(self, request_id: int, name: str, data: bytes) -> None:
        try:
            payload, op = self.answer(name, data, _ChannelContext()), 0
        except Aborted as exc:
            payload, op = bytes([exc.code.value[0]]) + exc.details.encode()[:4096], 1
        except Exception as exc:  # a servicer's own errors abort; anything else is a bug
            log.exception("front list channel: %s failed", name)
            payload, op = (
                bytes([grpc.StatusCode.INTERNAL.value[0]]) + f"{name}: internal error: {exc}".encode()[:4096],
                1,
            )
        with self._write, contextlib.suppress(OSError):  # the front gone: the reader sees it too
            self.sock.sendall(_HEAD.pack(len(payload) + _HEAD.size - 4, request_id, op) + payload)


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
        self, binary: str, listener: socket.socket, shim: Path, endpoint: str, timeout_s: float, lists: ListAnswer
    ) -> None:
        self.listener = listener
        self.lists = lists
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
                pass_fds=(self.listener.fileno(), theirs.fileno()),
            )
        except OSError as exc:
            mine.close()
            raise InfrastructureError(f"cannot start the front {self.argv[0]}: {exc}") from None
        finally:
            theirs.close()
        ListChannel(mine, self.lists)
        with self._lock:
            self._process = process
        log.info("front %s started (pid %d)", self.argv[0], process.pid)

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
