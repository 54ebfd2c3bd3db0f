"""CPU time of host processes, from ``/proc/<pid>/stat``: what the benchmarks charge a pod's
processes (its QEMU; a runc pod's container, pause and shim) for the CPU they used."""

from __future__ import annotations

import os
from pathlib import Path

TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def stat_cpu_s(stat: str) -> float:
    """User + system seconds of a ``/proc/<pid>/stat`` text (fields 14 and 15, counted after the
    command's name, which may hold spaces and parentheses); they keep the time of threads that
    have ended."""
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_S


def cpu_s(pid: int, proc: Path = Path("/proc")) -> float:
    """The process's CPU seconds so far (every thread)."""
    return stat_cpu_s((proc / str(pid) / "stat").read_text())
