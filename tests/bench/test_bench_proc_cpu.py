"""A process's CPU seconds from its /proc stat line: fields counted after the command's name,
which may hold spaces and parentheses."""

from __future__ import annotations

import os

import pytest

from bench.proc_cpu import TICKS_PER_S, cpu_s, stat_cpu_s


@pytest.mark.parametrize("comm", ["qemu-system-x86", "a (b) c", ")", "CPU 0/TCG"])
def test_user_and_system_time_are_read_after_the_name(comm: str) -> None:
    fields = ["S", "1", "2", "3", "4", "5", "6", "7", "8", "9", "10", str(3 * TICKS_PER_S), str(TICKS_PER_S), "99"]
    assert stat_cpu_s(f"42 ({comm}) " + " ".join(fields)) == 4.0


def test_this_process_has_used_some_cpu() -> None:
    sum(range(2_000_000))
    assert cpu_s(os.getpid()) > 0
