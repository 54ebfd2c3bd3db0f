"""The container log copy: the pure line and rate decisions (vmsandbox.log_copy_rules), and
``shim.log_copy.LogCopies`` against an agent that answers honestly, one that lies, and one that
floods (a real ``AgentClient`` talking to ``tests.hostile_agent`` in another process), with the
shim's memory measured while it is fed."""

from __future__ import annotations

import base64
import calendar
import logging
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shim.log_copy import CHUNK_BYTES, CriLogFile, LogCopies
from vmsandbox.adapters.agent_client import AgentClient
from vmsandbox.adapters.guest_channel import GuestRequestFailed
from vmsandbox.agent_ops import LogChunk, log_chunk_from_body
from vmsandbox.agent_protocol import ProtocolError
from vmsandbox.log_copy_rules import (
    MAX_PARTIAL_CHAIN,
    RECORD_AHEAD_NS,
    RECORD_BEHIND_NS,
    LineCut,
    RecordState,
    TokenBucket,
    check_records,
    render_time,
    whole_lines,
)

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


NOW = 1_790_000_000_123_456_789  # the host's clock in these tests (2026-09-21)
FIRST = NOW - 3600 * 10**9  # the copy of the log began an hour ago
S = RecordState(FIRST)
_T = b"2026-09-21T14:13:20.123456789Z"  # NOW as the guest writes it
_RECORD = rb"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{0,8}[1-9])?Z (stdout|stderr) [PF] [^\n]*\n"  # RFC3339Nano UTC


def _fixed(got: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in got.items() if v}


@pytest.mark.parametrize(
    ("line", "tty", "written", "fixed"),
    [
        (_T + b" stdout F hello", False, _T + b" stdout F hello\n", {}),
        (_T + b" stderr P ", False, _T + b" stderr P \n", {}),  # an empty part
        (b"2026-09-21T16:13:20.123456789+02:00 stdout F tz", False, _T + b" stdout F tz\n", {}),  # as UTC
        (b"2026-09-21T14:13:20Z stdout F whole second", False, b"2026-09-21T14:13:20Z stdout F whole second\n", {}),
        # forged times: far ahead of the host, long before the copy began, not a date: the host's clock
        (b"2099-01-01T00:00:00Z stdout F ahead", False, _T + b" stdout F ahead\n", {"restamped": 1}),
        (b"2001-01-01T00:00:00Z stdout F behind", False, _T + b" stdout F behind\n", {"restamped": 1}),
        (b"2026-02-30T00:00:00Z stdout F no date", False, _T + b" stdout F no date\n", {"restamped": 1}),
        (b"2026-09-21T14:13:20+24:00 stdout F no zone", False, _T + b" stdout F no zone\n", {"restamped": 1}),
        (_T + b" stderr F on a terminal", True, _T + b" stdout F on a terminal\n", {"restreamed": 1}),
        # not records: dropped
        (b"hello", False, b"", {"dropped": 1}),
        (_T + b" stdin F x", False, b"", {"dropped": 1}),
        (_T + b" stdout X x", False, b"", {"dropped": 1}),
        (_T + b" stdout F", False, b"", {"dropped": 1}),
        (b"2026-09-21 14:13:20Z stdout F x", False, b"", {"dropped": 1}),
        (b"2026-09-21T14:13:20.1234567890Z stdout F x", False, b"", {"dropped": 1}),
        (b" " + _T + b" stdout F x", False, b"", {"dropped": 1}),
    ],
)
def test_check_records(line: bytes, tty: bool, written: bytes, fixed: dict[str, int]) -> None:
    got = check_records(line + b"\n", S, NOW, tty=tty)
    assert (got.text, _fixed(got.fixes)) == (written, fixed)


def test_a_record_earlier_than_the_one_before_takes_its_time() -> None:
    before = render_time(NOW - 10**9)
    got = check_records(_T + b" stdout F a\n" + before + b" stderr F b\n", S, NOW, tty=False)
    assert got.text == _T + b" stdout F a\n" + _T + b" stderr F b\n"
    assert (_fixed(got.fixes), got.state.last_ns) == ({"reordered": 1}, NOW)


def test_a_chain_of_partial_records_ends_at_its_bound_across_chunks() -> None:
    part = b"x" * (MAX_PARTIAL_CHAIN // 4)
    state, tags = S, []
    for _ in range(6):  # one P record per chunk
        got = check_records(_T + b" stdout P " + part + b"\n", state, NOW, tty=False)
        state = got.state
        tags.append(got.text.split(b" ")[2])
    assert tags == [b"P", b"P", b"P", b"F", b"P", b"P"]
    assert state.chain == 2 * len(part)


_contents = st.binary(max_size=30).map(lambda b: b.replace(b"\n", b""))


@given(
    st.lists(
        st.tuples(st.integers(-RECORD_BEHIND_NS, 3600 * 10**9), st.sampled_from([b"stdout", b"stderr"]),
                  st.sampled_from([b"P", b"F"]), _contents),
        max_size=20,
    )
)  # fmt: skip
def test_honest_records_are_written_as_they_are(records: list[tuple[int, bytes, bytes, bytes]]) -> None:
    """What the agent writes (times from the copy's start on, in order, UTC) passes unchanged."""
    records.sort(key=lambda r: r[0])
    lines = b"".join(b"%s %s %s %s\n" % (render_time(FIRST + d), s, t, c) for d, s, t, c in records)
    got = check_records(lines, S, NOW, tty=False)
    assert (got.text, _fixed(got.fixes)) == (lines, {})


@given(st.lists(st.one_of(_contents, st.tuples(st.integers(0, 2**64), _contents)), max_size=30), st.booleans())
def test_whatever_the_guest_sends_the_host_writes_records_it_can_stand_behind(
    lines: list[bytes | tuple[int, bytes]], tty: bool
) -> None:
    """Any bytes, and records with any time: every line written is a CRI record of a stream the
    container has, at a time within the plausible window and never going back."""
    data = b"".join(
        (b"%s stderr F %s\n" % (str(x[0]).encode()[:4].rjust(4, b"0") + _T[4:], x[1]))
        if isinstance(x, tuple)
        else x + b"\n"
        for x in lines
    )
    got = check_records(data, S, NOW, tty=tty)
    written = got.text.split(b"\n")[:-1]
    assert len(written) + got.fixes["dropped"] == len(lines)
    times = []
    for line in written:
        assert re.fullmatch(_RECORD, line + b"\n"), line
        assert not (tty and b" stderr " in line[:40])
        times.append(_ns(line.split(b" ")[0]))
    assert times == sorted(times)
    assert all(FIRST - RECORD_BEHIND_NS <= t <= NOW + RECORD_AHEAD_NS for t in times)


def _ns(stamp: bytes) -> int:
    """An RFC3339Nano UTC time (as the host writes them) in ns since the epoch."""
    whole, _, fraction = stamp.rstrip(b"Z").partition(b".")
    seconds = calendar.timegm(time.strptime(whole.decode(), "%Y-%m-%dT%H:%M:%S"))
    return seconds * 10**9 + int(fraction.ljust(9, b"0"))


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


def rec(text: bytes, stream: bytes = b"stdout", tag: bytes = b"F") -> bytes:
    """A CRI record of now, as the agent writes it."""
    return b"%s %s %s %s\n" % (render_time(time.time_ns()), stream, tag, text)


def test_copies_whole_lines_and_records_progress(tmp_path: Path) -> None:
    one, two, three, four = rec(b"one"), rec(b"two"), rec(b"three"), rec(b"four")
    stream = Stream(one + two + three[:-3])
    logs = LogCopies(tmp_path / "state", 1 << 30, 1 << 30)
    dst = tmp_path / "k" / "c.log"
    logs.start(CID, CriLogFile(dst), stream.read)
    wait_until(lambda: logs.offset(CID) == len(one + two))  # recorded after the write
    assert dst.read_bytes() == one + two
    with stream.lock:
        stream.data += three[-3:] + four
        stream.eof = True
    logs.finish(CID, 5)
    assert dst.read_bytes() == one + two + three + four
    assert logs.offset(CID) == len(stream.data)
    # the progress is host-only state: under the state directory, nowhere near a guest's share
    assert (tmp_path / "state" / "logs" / CID).read_text().split()[0] == str(len(stream.data))
    logs.close()


def test_the_guests_records_are_checked_before_the_kubelet_reads_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A guest of a container with a terminal forges a time, a stream and a line that is no record."""
    honest = rec(b"honest")
    stream = Stream(honest + b"2099-01-01T00:00:00Z stdout F from the future\n" + b"no record\n"
                    + rec(b"to stderr", b"stderr"), eof=True)  # fmt: skip
    logs = LogCopies(tmp_path / "state", 1 << 30, 1 << 30)
    dst = tmp_path / "c.log"
    with caplog.at_level(logging.WARNING, logger="shim.log_copy"):
        logs.start(CID, CriLogFile(dst), stream.read, tty=True)
        logs.finish(CID, 5)
    written = dst.read_bytes().split(b"\n")[:-1]
    assert len(written) == 3 and written[0] + b"\n" == honest
    assert not written[1].startswith(b"2099") and written[1].endswith(b" stdout F from the future")
    assert written[2].endswith(b" stdout F to stderr")
    assert "1 dropped, 1 reordered, 1 restamped, 1 restreamed" in caplog.text  # the last: after the host's time
    logs.close()


def test_a_record_time_is_checked_against_when_the_copy_began_even_after_a_restart(tmp_path: Path) -> None:
    stream = Stream(rec(b"a"))
    dst = tmp_path / "c.log"
    first = LogCopies(tmp_path / "state", 1 << 30, 1 << 30)
    first.start(CID, CriLogFile(dst), stream.read)
    wait_until(lambda: first.offset(CID) == len(stream.data))
    first.close()
    began = first.progress(CID)[1].first_ns
    with stream.lock:  # a time long before the copy began: not taken, however long the shim was away
        stream.data += render_time(began - 2 * RECORD_BEHIND_NS) + b" stdout F b\n"
    second = LogCopies(tmp_path / "state", 1 << 30, 1 << 30)
    assert second.progress(CID)[1].first_ns == began
    second.start(CID, CriLogFile(dst), stream.read)
    wait_until(lambda: dst.read_bytes().endswith(b" stdout F b\n"))
    assert not dst.read_bytes().split(b"\n")[1].startswith(render_time(began - 2 * RECORD_BEHIND_NS))
    second.close()


def test_a_new_copy_resumes_from_the_recorded_offset(tmp_path: Path) -> None:
    a, b, c = rec(b"a"), rec(b"b"), rec(b"c")
    stream = Stream(a + b)
    dst = tmp_path / "c.log"
    first = LogCopies(tmp_path / "state", 1 << 30, 1 << 30)
    first.start(CID, CriLogFile(dst), stream.read)
    wait_until(lambda: first.offset(CID) == len(a + b))
    first.close()
    with stream.lock:
        stream.data += c
    second = LogCopies(tmp_path / "state", 1 << 30, 1 << 30)
    second.start(CID, CriLogFile(dst), stream.read)
    wait_until(lambda: dst.read_bytes() == a + b + c)
    at = len(a + b)
    assert stream.asked[-1] >= at and 0 not in stream.asked[stream.asked.index(at) :]
    second.forget(CID)
    assert not (tmp_path / "state" / "logs" / CID).exists()
    second.close()


def test_stopping_a_copy_waiting_on_its_guest_does_not_wait_and_drops_the_answer(tmp_path: Path) -> None:
    """An idle container's copy waits long in the guest (the long poll); stopping it returns at
    once with the sink closed, and the answer that comes later is neither written nor recorded."""
    first, late = rec(b"first"), rec(b"late")
    asked, release = threading.Event(), threading.Event()
    waits: list[float] = []

    def read(offset: int, max_bytes: int, wait_s: float) -> LogChunk:
        waits.append(wait_s)
        if offset == 0:
            return LogChunk(0, first, False)
        asked.set()
        release.wait(30)  # the guest holds the request until output comes
        return LogChunk(offset, late, False)

    dst = tmp_path / "c.log"
    logs = LogCopies(tmp_path / "state", 1 << 30, 1 << 30)
    logs.start(CID, CriLogFile(dst), read)
    assert asked.wait(10)
    t0 = time.monotonic()
    logs.forget(CID)
    assert time.monotonic() - t0 < 2
    release.set()
    time.sleep(0.3)
    assert dst.read_bytes() == first
    assert not (tmp_path / "state" / "logs" / CID).exists()  # forgotten, not recorded again
    assert waits and max(waits) >= 10  # an idle guest is asked rarely
    logs.close()


def test_reopen_moves_to_a_new_file(tmp_path: Path) -> None:
    old, new = rec(b"old"), rec(b"new")
    stream = Stream(old)
    dst = tmp_path / "c.log"
    logs = LogCopies(tmp_path / "state", 1 << 30, 1 << 30)
    logs.start(CID, CriLogFile(dst), stream.read)
    wait_until(lambda: dst.exists() and dst.read_bytes() == old)
    dst.rename(tmp_path / "c.log.1")
    logs.reopen(CID)
    with stream.lock:
        stream.data += new
    wait_until(lambda: dst.exists() and dst.read_bytes() == new)
    assert (tmp_path / "c.log.1").read_bytes() == old
    logs.close()


def test_rate_limit_per_container(tmp_path: Path) -> None:
    line = rec(b"x")
    stream = Stream(rec(b"x" * (1024 - len(line))) * 16 * 1024)  # 16 MiB waiting
    dst = tmp_path / "c.log"
    rate = 1 * MiB
    logs = LogCopies(tmp_path / "state", rate, CHUNK_BYTES)
    t0 = time.monotonic()
    logs.start(CID, CriLogFile(dst), stream.read)
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
        logs.start(CID, CriLogFile(dst), read)
        wait_until(lambda: problem in caplog.text)
    time.sleep(0.2)
    assert calls == [0, 6]  # stopped: never asked again
    assert dst.read_bytes() == b""  # "ok" is no CRI record: dropped
    logs.close()


def test_a_deleted_container_ends_its_copy(tmp_path: Path) -> None:
    def read(offset: int, max_bytes: int, wait_s: float) -> LogChunk:
        raise GuestRequestFailed("guest refused 'log_read': no container")

    logs = LogCopies(tmp_path / "state", 1 << 30, 1 << 30)
    logs.start(CID, CriLogFile(tmp_path / "c.log"), read)
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
        logs.start(CID, CriLogFile(Path("/dev/null")), read)
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
            logs.start(CID, CriLogFile(tmp_path / "c.log"), lambda o, m, w: agent.log_read(CID, o, m, w))
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
