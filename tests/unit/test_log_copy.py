"""The container log copy: the pure line and rate decisions (vmsandbox.log_copy), and
``shim.log_copy.LogCopies`` against an agent that answers honestly, one that lies, and one that
floods (a real ``AgentClient`` talking to ``tests.hostile_agent`` in another process), with the
shim's memory measured while it is fed."""

from __future__ import annotations

import base64
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shim.log_copy import CHUNK_BYTES, LogCopies
from vmsandbox.adapters.agent_client import AgentClient
from vmsandbox.adapters.guest_channel import GuestRequestFailed
from vmsandbox.agent_protocol import LogChunk, ProtocolError, log_chunk_from_body
from vmsandbox.log_copy import LineCut, TokenBucket, whole_lines

CID = "c" * 64
MiB = 1 << 20


@pytest.mark.parametrize(
    ("data", "eof", "max_line", "expected"),
    [
        (b"", False, 10, LineCut(b"", 0)),
        (b"", True, 10, LineCut(b"", 0)),
        (b"a\n", False, 10, LineCut(b"a\n", 2)),
        (b"a\nb\npart", False, 10, LineCut(b"a\nb\n", 4)),
        (b"part", False, 10, LineCut(b"", 0)),  # asked for again, with what follows it
        (b"part", True, 10, LineCut(b"part\n", 4)),  # the log ends without a line end
        (b"0123456789", False, 10, LineCut(b"0123456789\n", 10)),  # as long as a chunk: cut
        (b"a\n0123456789", False, 10, LineCut(b"a\n", 2)),
    ],
)
def test_whole_lines(data: bytes, eof: bool, max_line: int, expected: LineCut) -> None:
    assert whole_lines(data, eof, max_line) == expected


@given(
    st.lists(st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")), max_size=30),
    st.booleans(),
    st.lists(st.integers(1, 64), min_size=1, max_size=20),
)
def test_whole_lines_rebuilds_any_stream_however_it_is_cut(lines: list[bytes], ended: bool, cuts: list[int]) -> None:
    """The copy loop over an honest stream, answered in pieces of any size up to the asked 64
    bytes: the kubelet's file gets the stream itself, line for line (a last line without a line end
    gets one), lines no longer than a chunk never cut."""
    stream = b"\n".join(lines) + (b"\n" if ended and lines else b"")
    out, offset, i = b"", 0, 0
    while offset < len(stream):
        data = stream[offset : offset + cuts[i % len(cuts)]]
        i += 1
        cut = whole_lines(data, offset + len(data) == len(stream), 64)
        out += cut.text
        offset += cut.consumed
        if not cut.consumed:
            cuts = [64]  # a partial line is asked for again; the honest agent then sends all it has
    expected = stream if not stream or stream.endswith(b"\n") else stream + b"\n"
    assert out == expected


@given(
    st.lists(st.tuples(st.integers(0, 10 * MiB), st.floats(0, 2)), max_size=50),
    st.integers(1, 8 * MiB),
    st.integers(1, 16 * MiB),
)
def test_token_bucket_holds_the_rate(spends: list[tuple[int, float]], rate: int, burst: int) -> None:
    """Whoever waits the delays it is given never spends more than burst + rate * elapsed."""
    now = 0.0
    bucket = TokenBucket.full(rate, burst, now)
    spent = 0
    for n, idle in spends:
        bucket, delay = bucket.take(n, now)
        assert delay >= 0
        spent += n
        now += delay
        assert spent <= burst + rate * now + 1e-6 * max(spent, 1)
        now += idle


@pytest.mark.parametrize("key", ["log_rate_bytes", "log_burst_bytes"])
def test_rate_settings_are_checked(key: str) -> None:
    from shim.config import ShimConfig, config_from_mapping
    from vmsandbox.errors import InvalidArgument

    assert getattr(config_from_mapping({key: 1000}, "config.yaml"), key) == 1000
    assert ShimConfig().log_rate_bytes == 4 * MiB and ShimConfig().log_burst_bytes == 16 * MiB
    for bad in (0, -1, True, "4Mi"):
        with pytest.raises(InvalidArgument, match=f"{key}: must be a positive integer"):
            config_from_mapping({key: bad}, "config.yaml")


def test_token_bucket_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        TokenBucket.full(0, 10, 0)


class Stream:
    """A container's log as an honest agent serves it: an offset-addressed byte stream,
    answered from ``offset`` up to ``max_bytes``."""

    def __init__(self, data: bytes = b"", eof: bool = False) -> None:
        self.data = data
        self.eof = eof
        self.asked: list[int] = []
        self.lock = threading.Lock()

    def read(self, offset: int, max_bytes: int, wait_s: float) -> LogChunk:
        with self.lock:
            self.asked.append(offset)
            part = self.data[offset : offset + max_bytes]
            end = self.eof and offset + len(part) == len(self.data)
        if not part and not end:
            time.sleep(min(wait_s, 0.05))
        return LogChunk(offset, part, end)


def wait_until(check: object, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_copies_whole_lines_and_records_progress(tmp_path: Path) -> None:
    stream = Stream(b"one\ntwo\nthr")
    logs = LogCopies(tmp_path / "state", 1 << 30, 1 << 30)
    dst = tmp_path / "k" / "c.log"
    logs.start(CID, dst, stream.read)
    wait_until(lambda: logs.offset(CID) == 8)  # recorded after the write
    assert dst.read_bytes() == b"one\ntwo\n"
    with stream.lock:
        stream.data += b"ee\nfour\n"
        stream.eof = True
    logs.finish(CID, 5)
    assert dst.read_bytes() == b"one\ntwo\nthree\nfour\n"
    assert logs.offset(CID) == len(stream.data)
    # the progress is host-only state: under the state directory, nowhere near a guest's share
    assert (tmp_path / "state" / "logs" / CID).read_text() == str(len(stream.data))
    logs.close()


def test_a_new_copy_resumes_from_the_recorded_offset(tmp_path: Path) -> None:
    stream = Stream(b"a\nb\n")
    dst = tmp_path / "c.log"
    first = LogCopies(tmp_path / "state", 1 << 30, 1 << 30)
    first.start(CID, dst, stream.read)
    wait_until(lambda: first.offset(CID) == 4)
    first.close()
    with stream.lock:
        stream.data += b"c\n"
    second = LogCopies(tmp_path / "state", 1 << 30, 1 << 30)
    second.start(CID, dst, stream.read)
    wait_until(lambda: dst.read_bytes() == b"a\nb\nc\n")
    assert stream.asked[-1] >= 4 and 0 not in stream.asked[stream.asked.index(4) :]
    second.forget(CID)
    assert not (tmp_path / "state" / "logs" / CID).exists()
    second.close()


def test_reopen_moves_to_a_new_file(tmp_path: Path) -> None:
    stream = Stream(b"old\n")
    dst = tmp_path / "c.log"
    logs = LogCopies(tmp_path / "state", 1 << 30, 1 << 30)
    logs.start(CID, dst, stream.read)
    wait_until(lambda: dst.exists() and dst.read_bytes() == b"old\n")
    dst.rename(tmp_path / "c.log.1")
    logs.reopen(CID)
    with stream.lock:
        stream.data += b"new\n"
    wait_until(lambda: dst.exists() and dst.read_bytes() == b"new\n")
    assert (tmp_path / "c.log.1").read_bytes() == b"old\n"
    logs.close()


def test_rate_limit_per_container(tmp_path: Path) -> None:
    stream = Stream((b"x" * 1023 + b"\n") * 16 * 1024)  # 16 MiB waiting
    dst = tmp_path / "c.log"
    rate = 1 * MiB
    logs = LogCopies(tmp_path / "state", rate, CHUNK_BYTES)
    t0 = time.monotonic()
    logs.start(CID, dst, stream.read)
    time.sleep(1.5)
    copied, elapsed = dst.stat().st_size, time.monotonic() - t0
    logs.close()
    assert copied <= CHUNK_BYTES + rate * elapsed + CHUNK_BYTES, (copied, elapsed)
    assert copied >= rate * 0.5


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ({"offset": 5, "data": "YQo=", "eof": False}, "before the 6 asked for"),
        ({"offset": 6, "data": base64.b64encode(b"y" * (CHUNK_BYTES + 1)).decode(), "eof": False}, "at most"),
        ({"offset": 6, "data": "%%%%", "eof": False}, "not base64"),
    ],
)
def test_a_lying_answer_stops_that_copy_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, body: dict[str, object], problem: str
) -> None:
    calls = []

    def read(offset: int, max_bytes: int, wait_s: float) -> LogChunk:
        calls.append(offset)
        if offset == 0:
            return LogChunk(0, b"ok\nok\n", False)
        return log_chunk_from_body(body, offset, max_bytes)

    dst = tmp_path / "c.log"
    logs = LogCopies(tmp_path / "state", 1 << 30, 1 << 30)
    with caplog.at_level(logging.WARNING, logger="shim.log_copy"):
        logs.start(CID, dst, read)
        wait_until(lambda: problem in caplog.text)
    time.sleep(0.2)
    assert calls == [0, 6]  # stopped: never asked again
    assert dst.read_bytes() == b"ok\nok\n"
    logs.close()


def test_a_deleted_container_ends_its_copy(tmp_path: Path) -> None:
    def read(offset: int, max_bytes: int, wait_s: float) -> LogChunk:
        raise GuestRequestFailed("guest refused 'log_read': no container")

    logs = LogCopies(tmp_path / "state", 1 << 30, 1 << 30)
    logs.start(CID, tmp_path / "c.log", read)
    copy = logs._copies[CID]
    assert copy.ended.wait(5)
    logs.close()


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _hostile(tmp_path: Path, mode: str) -> tuple[subprocess.Popen[bytes], AgentClient]:
    sock = tmp_path / "agent.sock"
    proc = subprocess.Popen([sys.executable, "-m", "tests.hostile_agent", str(sock), mode])
    try:
        return proc, AgentClient.open(sock, 30)
    except BaseException:
        proc.kill()
        proc.wait()
        raise


@pytest.mark.parametrize("mode", ["flood", "noline"])
def test_shim_memory_stays_bounded_whatever_the_guest_streams(tmp_path: Path, mode: str) -> None:
    """An agent that answers every read with as much as asked for, as fast as it can: the copy
    takes 200 MB through the real client and the shim's RSS does not grow with it."""
    proc, agent = _hostile(tmp_path, mode)
    fed = [0]

    def read(offset: int, max_bytes: int, wait_s: float) -> LogChunk:
        chunk = agent.log_read(CID, offset, max_bytes, wait_s)
        fed[0] += len(chunk.data)
        return chunk

    logs = LogCopies(tmp_path / "state", 1 << 40, 1 << 40)
    try:
        before = peak = _rss()
        logs.start(CID, Path("/dev/null"), read)
        deadline = time.monotonic() + 60
        while fed[0] < 200 * MiB and time.monotonic() < deadline:
            peak = max(peak, _rss())
            time.sleep(0.02)
        assert fed[0] >= 50 * MiB, fed[0]
        assert peak - before < 24 * MiB, (peak - before, fed[0])
        assert logs.offset(CID) >= fed[0] - CHUNK_BYTES
    finally:
        logs.close()
        agent.close()
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("mode", ["backwards", "oversize", "badb64"])
def test_a_lying_agent_stops_the_copy_not_the_shim(tmp_path: Path, caplog: pytest.LogCaptureFixture, mode: str) -> None:
    proc, agent = _hostile(tmp_path, mode)
    logs = LogCopies(tmp_path / "state", 1 << 30, 1 << 30)
    try:
        with caplog.at_level(logging.WARNING, logger="shim.log_copy"):
            logs.start(CID, tmp_path / "c.log", lambda o, m, w: agent.log_read(CID, o, m, w))
            assert logs._copies[CID].ended.wait(10)
        assert "the guest answered wrongly" in caplog.text
        assert agent.request("ping", {}, 10) == {}  # the channel is still fine for everything else
        with pytest.raises(ProtocolError):
            agent.log_read(CID, 10**6, 10, 0) if mode != "backwards" else agent.log_read(CID, 10, 10, 0)
    finally:
        logs.close()
        agent.close()
        proc.kill()
        proc.wait()


def test_a_container_without_a_log_path_is_drained(tmp_path: Path) -> None:
    """Nobody reads it, but the agent must be able to drop it (else the container blocks)."""
    stream = Stream(b"a\n" * 1000, eof=True)
    logs = LogCopies(tmp_path / "state", 1 << 30, 1 << 30)
    logs.start(CID, None, stream.read)
    assert logs._copies[CID].ended.wait(5)
    assert logs.offset(CID) == 2000
    logs.close()
