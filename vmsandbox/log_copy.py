"""Decisions of the container log copy (pure): which bytes of a chunk the guest sent go to the
kubelet's file, and how fast (a token bucket per container).

The guest agent keeps each container's CRI log (``<RFC3339Nano> stdout|stderr F|P <text>\\n``
lines) and serves it by offset (``log_read``, images/README.md). The host writes only whole
lines; what follows the last line end of a chunk is asked for again, so nothing but the chunk in
hand is ever held. A line as long as a whole chunk is cut there (the rest starts a new line), and
the last line of a log that ends without a line end is written with one.
"""

from __future__ import annotations

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
