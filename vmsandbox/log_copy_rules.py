"""Decisions of the container log copy (pure): which bytes of a chunk the guest sent go to the
kubelet's file, how fast (a token bucket per container), and what of each CRI record the host
keeps (``check_records``: the record's form, a plausible time, the stream, partial chains bounded).

The guest agent keeps each container's CRI log (``<RFC3339Nano> stdout|stderr F|P <text>\\n``
lines) and serves it by offset (``log_read``, images/README.md). The host writes only whole
lines; what follows the last line end of a chunk is asked for again, so nothing but the chunk in
hand is ever held. A line as long as a whole chunk is cut there (the rest starts a new line), and
the last line of a log that ends without a line end is written with one.
"""

from __future__ import annotations

import calendar
import datetime
import re
from dataclasses import dataclass, replace
from typing import NamedTuple


class LineCut(NamedTuple):
    text: bytes
    """What to append to the kubelet's file: whole lines only."""
    consumed: int
    """How many bytes of the chunk that took (``text`` may have one line end more)."""


def whole_lines(data: bytes, eof: bool, max_line: int) -> LineCut:
    """The whole lines at the start of ``data``. Without a line end, ``data`` is taken as one line
    when it is ``max_line`` long or more (cut) or when nothing follows (``eof``); else nothing."""
    end = data.rfind(b"\n") + 1
    if end:
        return LineCut(data[:end], end)
    if data and (eof or len(data) >= max_line):
        return LineCut(data + b"\n", len(data))
    return LineCut(b"", 0)


@dataclass(frozen=True)
class TokenBucket:
    """``rate`` bytes per second on average, up to ``burst`` at once. ``tokens`` may go below zero
    (a write larger than what was left): the delay ``take`` returns pays that debt back."""

    rate: float
    burst: float
    tokens: float
    at: float
    """When ``tokens`` was last brought up to date (monotonic seconds)."""

    @classmethod
    def full(cls, rate: float, burst: float, now: float) -> TokenBucket:
        if rate <= 0 or burst <= 0:
            raise ValueError(f"a token bucket needs a positive rate and burst, got {rate} and {burst}")
        return cls(rate, burst, burst, now)

    def take(self, n: int, now: float) -> tuple[TokenBucket, float]:
        """The bucket after spending ``n`` at ``now``, and how long to wait before the next spend."""
        tokens = min(self.burst, self.tokens + max(0.0, now - self.at) * self.rate) - n
        return replace(self, tokens=tokens, at=max(now, self.at)), max(0.0, -tokens / self.rate)


# -- the records themselves -------------------------------------------------------------------------

RECORD_AHEAD_NS = 5 * 10**9
"""A guest's record time may be this far past the host's clock (the guest's clock is its own)."""
RECORD_BEHIND_NS = 60 * 10**9
"""... and this far before the host first copied from that log (the container started then)."""
MAX_PARTIAL_CHAIN = 1 << 20
"""Content bytes of one chain of P records (one line); the record that reaches it is made F."""
STREAMS = (b"stdout", b"stderr")

_RECORD = re.compile(
    rb"(\d{4})-(\d{2})-(\d{2})T(\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?(Z|[+-]\d{2}:\d{2}) (stdout|stderr) ([PF]) "
)


@dataclass(frozen=True)
class RecordState:
    """What checking a log's records carries from one chunk to the next (and across restarts)."""

    first_ns: int
    """The host's clock when the host first copied from this log."""
    last_ns: int = 0
    """The time of the last record written."""
    chain: int = 0
    """Content bytes of the chain of P records still open."""


@dataclass(frozen=True)
class CheckedRecords:
    text: bytes
    """The records to write, each ``<RFC3339Nano UTC> <stream> <P|F> <content>\\n``."""
    state: RecordState
    fixes: dict[str, int]
    """How many records were ``dropped`` (not a record), ``restamped`` (an implausible time),
    ``reordered`` (earlier than the one before), ``restreamed`` (stderr of a terminal), ``ended``
    (a P record that reached MAX_PARTIAL_CHAIN, made F)."""


def _record_ns(m: re.Match[bytes]) -> int | None:
    """The record's time in ns since the epoch; None when the fields name no time."""
    year, month, day, hour, minute, second = (int(g) for g in m.groups()[:6])
    zone = m.group(8)
    offset = 0
    if zone != b"Z":
        hours, minutes = int(zone[1:3]), int(zone[4:6])
        if hours > 23 or minutes > 59:
            return None
        offset = (hours * 3600 + minutes * 60) * (1 if zone[:1] == b"+" else -1)
    try:
        when = datetime.datetime(year, month, day, hour, minute, second, tzinfo=datetime.UTC)
    except ValueError:
        return None
    fraction = (m.group(7) or b"").ljust(9, b"0")
    return (calendar.timegm(when.timetuple()) - offset) * 10**9 + int(fraction)


def render_time(ns: int) -> bytes:
    """``ns`` since the epoch as Go's RFC3339Nano in UTC (trailing zeros of the fraction dropped)."""
    seconds, fraction = divmod(ns, 10**9)
    text = datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S")
    if fraction:
        text += "." + f"{fraction:09d}".rstrip("0")
    return (text + "Z").encode()


def check_records(lines: bytes, state: RecordState, now_ns: int, *, tty: bool) -> CheckedRecords:
    """The CRI records of ``lines`` (whole lines, as ``whole_lines`` gives them) as the host writes
    them. A line that is not ``<RFC3339Nano> <stdout|stderr> <P|F> <content>`` is dropped. A time
    is the guest's when it lies between RECORD_BEHIND_NS before ``state.first_ns`` and
    RECORD_AHEAD_NS after ``now_ns`` (the host's clock) and is no earlier than the record before;
    one earlier than the record before takes that record's time; any other takes the host's clock
    (or the record before's, if later). A terminal's output is all stdout. A chain of P records
    is ended (F) where its content reaches MAX_PARTIAL_CHAIN. Times are written in UTC."""
    fixes = dict.fromkeys(("dropped", "restamped", "reordered", "restreamed", "ended"), 0)
    last, chain = state.last_ns, state.chain
    lo, hi = state.first_ns - RECORD_BEHIND_NS, now_ns + RECORD_AHEAD_NS
    out = []
    for line in lines.split(b"\n")[:-1]:
        m = _RECORD.match(line)
        if m is None:
            fixes["dropped"] += 1
            continue
        content = line[m.end() :]
        ns = _record_ns(m)
        if ns is None or not lo <= ns <= hi:
            fixes["restamped"] += 1
            ns = max(last, now_ns)
        elif ns < last:
            fixes["reordered"] += 1
            ns = last
        last = ns
        stream = m.group(9)
        if tty and stream != b"stdout":
            fixes["restreamed"] += 1
            stream = b"stdout"
        tag = m.group(10)
        if tag == b"P":
            chain += len(content)
            if chain >= MAX_PARTIAL_CHAIN:
                fixes["ended"] += 1
                tag = b"F"
        if tag == b"F":
            chain = 0
        out.append(b"%s %s %s %s\n" % (render_time(ns), stream, tag, content))
    return CheckedRecords(b"".join(out), RecordState(state.first_ns, last, chain), fixes)
