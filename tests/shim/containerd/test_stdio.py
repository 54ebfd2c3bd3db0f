"""Shim mode's stdio: CRI records to containerd's fifos, and the tasks' store."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from shim.containerd import stdio
from shim.containerd.stdio import Fifo, FifoSink, record_texts
from shim.containerd.tasks import ExecProcess, TaskIO, Tasks, check_io
from vmsandbox.agent_ops import StreamOutput
from vmsandbox.errors import AlreadyExists, InvalidArgument, NotFound

CID = "c" * 64


@pytest.mark.parametrize(
    ("records", "want"),
    [
        (b"2026-01-01T00:00:00Z stdout F hello\n", [(b"stdout", b"hello\n")]),
        (b"2026-01-01T00:00:00Z stderr P part\nT stderr F end\n", [(b"stderr", b"part"), (b"stderr", b"end\n")]),
        (b"2026-01-01T00:00:00Z stdout F \n", [(b"stdout", b"\n")]),
        (b"2026-01-01T00:00:00Z stdout F a b  c\n", [(b"stdout", b"a b  c\n")]),
        (b"garbage\n\n", []),
    ],
)
def test_record_texts(records: bytes, want: list[tuple[bytes, bytes]]) -> None:
    assert record_texts(records) == want


def reader(path: Path) -> tuple[int, list[bytes]]:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    return fd, []


def drain(fd: int) -> bytes:
    out = b""
    while True:
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return out
        if not data:
            return out
        out += data


def test_sink_writes_each_stream_to_its_fifo_and_its_end_is_seen(tmp_path: Path) -> None:
    out, err = tmp_path / "out", tmp_path / "err"
    os.mkfifo(out)
    os.mkfifo(err)
    rout, _ = reader(out)
    rerr, _ = reader(err)
    sink = FifoSink(str(out), str(err))
    sink.write(b"T stdout F one\nT stderr F two\nT stdout P thr\nT stdout F ee\n")
    sink.close()
    assert drain(rout) == b"one\nthree\n" and drain(rerr) == b"two\n"
    assert os.read(rout, 10) == b"" and os.read(rerr, 10) == b""  # the writers are gone: end of stream
    os.close(rout)
    os.close(rerr)


def test_a_fifo_without_a_reader_drops_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stdio, "OPEN_WAIT_S", 0.1)
    path = tmp_path / "out"
    os.mkfifo(path)
    fifo = Fifo(str(path), write=True)
    assert not fifo.open_now(0.1) and not fifo.write_all(b"lost")


def test_a_stalled_reader_loses_output_after_the_stall_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stdio, "STALL_S", 1.0)
    path = tmp_path / "out"
    os.mkfifo(path)
    rfd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    fifo = Fifo(str(path), write=True)
    done: list[bool] = []
    t = threading.Thread(target=lambda: done.append(fifo.write_all(b"x" * (4 << 20))))
    t.start()
    t.join(10)
    assert done == [False]
    fifo.close()
    os.close(rfd)


def test_a_regular_file_is_no_fifo(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_text("")
    with pytest.raises(OSError, match="not a fifo"):
        Fifo(str(path), write=True).write_all(b"x")


def test_a_symlink_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "real"
    os.mkfifo(target)
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(OSError):
        Fifo(str(tmp_path / "link"), write=False).read_some(0.1)


def test_tasks_keep_fifos_across_a_restart_and_exits_once(tmp_path: Path) -> None:
    tasks = Tasks(tmp_path)
    io = TaskIO("/run/x/stdin", "/run/x/stdout", "", True)
    tasks.add(CID, io)
    assert Tasks(tmp_path).io(CID) == io and Tasks(tmp_path).known() == [CID]
    assert tasks.exited(CID, 3) and not tasks.exited(CID, 4)
    assert tasks.exit_of(CID).code == 3 and tasks.exit_of(CID).done.is_set()
    tasks.add_exec(ExecProcess(CID, "e1", TaskIO(), ("ls",)))
    with pytest.raises(AlreadyExists):
        tasks.add_exec(ExecProcess(CID, "e1", TaskIO(), ("ls",)))
    assert tasks.exec(CID, "e1").argv == ("ls",)
    tasks.forget(CID)
    assert tasks.io(CID) is None and tasks.known() == []
    with pytest.raises(NotFound):
        tasks.exec(CID, "e1")


@pytest.mark.parametrize("path", ["relative/fifo", "/run/../etc/shadow", "/run/x\x00y"])
def test_fifo_paths_must_be_absolute_and_plain(path: str) -> None:
    with pytest.raises(InvalidArgument):
        check_io(TaskIO(stdout=path), "CreateTaskRequest")


def test_a_task_id_must_be_a_container_id(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument):
        Tasks(tmp_path).add("../../etc", TaskIO())


class FakeSession:
    """An attach session whose reads are given in turn (then it waits for ``more``)."""

    id = "s" * 16

    def __init__(self, reads: list[StreamOutput]) -> None:
        self.reads = reads
        self.more = threading.Event()
        self.released = threading.Event()

    def read(self, max_bytes: int, timeout_s: float) -> StreamOutput:
        if self.reads:
            return self.reads.pop(0)
        self.more.wait(timeout_s)
        return StreamOutput(b"", b"", self.more.is_set(), None)

    def release(self) -> None:
        self.released.set()


def test_an_attached_containers_output_reaches_its_fifos_as_it_comes(tmp_path: Path) -> None:
    """critest's attach: `echo -n hello` typed into a shell; its answer has no newline, and reaches
    the fifo containerd's attach reads at once, not at the next newline (the log copy's unit)."""
    out, err = tmp_path / "out", tmp_path / "err"
    os.mkfifo(out)
    os.mkfifo(err)
    rout, _ = reader(out)
    rerr, _ = reader(err)
    session = FakeSession([StreamOutput(b"hello", b"", False, None), StreamOutput(b"", b"oops", False, None)])
    stop = threading.Event()
    t = stdio.pump_attached(session, str(out), str(err), stop)  # type: ignore[arg-type]
    got, deadline = b"", time.monotonic() + 5
    while got != b"hello" and time.monotonic() < deadline:
        got += drain(rout)
        time.sleep(0.01)
    assert got == b"hello" and not session.released.is_set()
    session.more.set()  # the container exited and its output was taken
    t.join(5)
    assert drain(rerr) == b"oops" and session.released.is_set() and stop.is_set()
    assert os.read(rout, 10) == b"" and os.read(rerr, 10) == b""  # containerd sees the end of its stdio
    os.close(rout)
    os.close(rerr)


class InputSession:
    """A stream session that records what reaches its input, and when the input closed; each write
    takes ``delay_s`` (a guest that takes its time)."""

    id = "i" * 16

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.got = b""
        self.closed_after = b""
        self.closed = threading.Event()

    def write_some(self, data: bytes) -> tuple[int, bool]:
        time.sleep(self.delay_s)
        self.got += data
        return len(data), False

    def close_input(self) -> None:
        if not self.closed.is_set():
            self.closed_after = self.got
            self.closed.set()


@pytest.mark.parametrize("delay_s", [0.0, 0.05])
def test_close_io_closes_the_input_after_what_was_written_before_it(tmp_path: Path, delay_s: float) -> None:
    """containerd writes a client's stdin to the fifo, then calls CloseIO (kubectl exec -i with its
    input at an end): everything written reaches the session before its input closes."""
    path = tmp_path / "stdin"
    os.mkfifo(path)
    session = InputSession(delay_s)
    stop = threading.Event()
    writer = os.open(path, os.O_RDWR)  # containerd's end, held open as containerd holds it
    feed = stdio.StdinFeed(session, str(path), stop)  # type: ignore[arg-type]
    for chunk in (b"over ", b"stdin\n", b"and more"):
        os.write(writer, chunk)
    feed.finish()
    assert session.closed.is_set() and session.closed_after == b"over stdin\nand more"
    os.close(writer)
    stop.set()


def test_the_end_of_the_fifo_closes_the_input(tmp_path: Path) -> None:
    path = tmp_path / "stdin"
    os.mkfifo(path)
    session = InputSession()
    writer = os.open(path, os.O_RDWR)
    stdio.StdinFeed(session, str(path), threading.Event())  # type: ignore[arg-type]
    os.write(writer, b"all of it")
    time.sleep(0.2)
    os.close(writer)
    assert session.closed.wait(5) and session.closed_after == b"all of it"
