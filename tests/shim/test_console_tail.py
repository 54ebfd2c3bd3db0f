"""The guest's console log is the guest's own output: a failed start quotes only its last lines,
read from its last few KiB, escaped and bounded, however large the guest made the file."""

from __future__ import annotations

import os
import tracemalloc
from pathlib import Path

from shim.console_logs import console_tail


def test_only_the_tail_of_a_huge_console_is_read(tmp_path: Path) -> None:
    console = tmp_path / "console.log"
    with console.open("wb") as f:
        f.truncate(4 << 30)  # 4 GiB, sparse
        f.seek(0, os.SEEK_END)
        f.write(b"\n".join(b"line %d" % i for i in range(10)) + b"\n")
    tracemalloc.start()
    try:
        tail = console_tail(str(console))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert tail == "; last console lines: line 5 | line 6 | line 7 | line 8 | line 9"
    assert peak < 1 << 20


def test_console_lines_are_escaped_and_bounded(tmp_path: Path) -> None:
    console = tmp_path / "console.log"
    console.write_bytes(b"\x1b[2Jforged\r" + b"x" * 100_000 + b"\n")
    tail = console_tail(str(console))
    assert "\x1b" not in tail and "\r" not in tail
    assert len(tail) < 400


def test_a_missing_or_empty_console(tmp_path: Path) -> None:
    assert console_tail(None) == ""
    assert console_tail(str(tmp_path / "absent.log")) == ""
    (tmp_path / "empty.log").write_bytes(b"")
    assert console_tail(str(tmp_path / "empty.log")) == "; the guest console is empty"
