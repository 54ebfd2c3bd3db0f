"""The guest console's tail quoted in a failed RunPodSandbox's error (shim.sandboxes): the guest
writes the console, so the read and the message are bounded."""

from __future__ import annotations

import time
from pathlib import Path

from shim.sandboxes import Sandboxes


def test_console_tail_reads_only_the_end_of_a_huge_console(tmp_path: Path) -> None:
    """A failed start quotes the guest console's last lines: a guest that filled it (here 4 GiB,
    sparse, then one endless line) costs a bounded read and a bounded message."""
    console = tmp_path / "console.log"
    with console.open("wb") as f:
        f.truncate(4 << 30)
        f.seek(4 << 30)
        f.write(b"early\nlast line \x1b[31m red\n" + b"z" * 5000)  # a long last line, cut in the message
    t0 = time.monotonic()
    tail = Sandboxes._console_tail(str(console))
    assert time.monotonic() - t0 < 1
    assert "last line \\x1b[31m red" in tail and len(tail) < 1000, tail[:200]
    assert Sandboxes._console_tail(str(tmp_path / "missing")) == ""
