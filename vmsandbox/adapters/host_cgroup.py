"""A VM pod's QEMU moved into its pod's cgroup on the host (cgroup v1, cgroupfs), back again, and
that cgroup's usage read (the IO edge of ``vmsandbox.pod_cgroup``).

Moving a pid through ``cgroup.procs`` takes all its threads (vCPUs, emulator, I/O) in one write, and
the threads QEMU makes later start where their parent is. The shim, as root, does the writes; the
cgroup directories are root's, so QEMU (an unprivileged uid of its own) cannot leave them or write
their limits. A missing cgroup is made, as runc makes a missing ``cgroup_parent``. Reads are
bounded and never follow a link out of the hierarchy.
"""

from __future__ import annotations

import errno
import os
import time
from dataclasses import dataclass
from pathlib import Path

from vmsandbox import pod_cgroup
from vmsandbox.errors import InfrastructureError, Unsupported

_READ_MAX = 64 * 1024


@dataclass(frozen=True)
class Placed:
    """A pid moved into ``parent``; where it was before, per controller (for the undo)."""

    pid: int
    parent: str
    previous: tuple[tuple[str, str], ...]


def _read(path: Path) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return os.read(fd, _READ_MAX).decode("ascii", "replace")
    finally:
        os.close(fd)


def _write(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


class HostCgroups:
    """The host's v1 hierarchies under ``root`` (one directory per controller) and ``/proc``."""

    def __init__(self, root: str = "/sys/fs/cgroup", proc_root: str = "/proc") -> None:
        self.root = Path(root)
        self.proc = Path(proc_root)

    def _dir(self, controller: str, parent: str) -> Path:
        return self.root / controller / parent.lstrip("/")

    def _check_v1(self) -> None:
        if (self.root / "cgroup.controllers").exists():
            raise Unsupported(
                f"{self.root} is cgroup v2 (unified): placing a VM pod in its cgroup_parent is built for cgroup v1"
            )
        missing = [c for c in pod_cgroup.CONTROLLERS if not (self.root / c).is_dir()]
        if missing:
            raise InfrastructureError(f"cgroup v1 controllers not mounted under {self.root}: {', '.join(missing)}")

    def where(self, pid: int) -> dict[str, str]:
        """The v1 cgroup of ``pid`` per controller."""
        try:
            return pod_cgroup.proc_cgroups(_read(self.proc / str(pid) / "cgroup"))
        except OSError as exc:
            raise InfrastructureError(f"cannot read the cgroups of pid {pid}: {exc}") from exc

    def place(self, pid: int, parent: str) -> Placed:
        """Move ``pid`` (all its threads) into ``parent`` in each of ``CONTROLLERS``; on a failure the
        controllers done are put back and the error says which failed."""
        self._check_v1()
        was = self.where(pid)
        placed = Placed(pid, parent, tuple((c, was.get(c, "/")) for c in pod_cgroup.CONTROLLERS))
        done: list[tuple[str, str]] = []
        try:
            for controller, before in placed.previous:
                target = self._dir(controller, parent)
                target.mkdir(parents=True, exist_ok=True)
                _write(target / "cgroup.procs", str(pid))
                done.append((controller, before))
        except OSError as exc:
            self._put_back(Placed(pid, parent, tuple(done)))
            raise InfrastructureError(
                f"cannot move QEMU (pid {pid}) into the cgroup {parent} ({controller}): {exc}"
            ) from exc
        return placed

    def put_back(self, placed: Placed) -> None:
        """Move the pid back where ``place`` found it (nothing to do once it has exited)."""
        self._put_back(placed)

    def _put_back(self, placed: Placed) -> None:
        for controller, before in placed.previous:
            try:
                _write(self._dir(controller, before) / "cgroup.procs", str(placed.pid))
            except OSError as exc:
                if exc.errno == errno.ESRCH:
                    return  # it exited: it is in no cgroup any more
                if exc.errno != errno.ENOENT:
                    raise InfrastructureError(
                        f"cannot move pid {placed.pid} back to the cgroup {before} ({controller}): {exc}"
                    ) from exc
                # the cgroup it came from is gone (libvirt removed it): its parent's hierarchy root
                _write(self.root / controller / "cgroup.procs", str(placed.pid))

    def usage(self, parent: str) -> pod_cgroup.PodUsage:
        """What ``parent`` uses now: CPU time (cpuacct) and memory (usage, working set)."""
        try:
            now = time.time_ns()
            cpu = int(_read(self._dir("cpuacct", parent) / "cpuacct.usage").strip() or 0)
            memory = self._dir("memory", parent)
            used = int(_read(memory / "memory.usage_in_bytes").strip() or 0)
            stat = pod_cgroup.parse_stat(_read(memory / "memory.stat"))
        except (OSError, ValueError) as exc:
            raise InfrastructureError(f"cannot read the usage of the cgroup {parent}: {exc}") from exc
        return pod_cgroup.pod_usage(now, cpu, used, stat)

    def pids(self, parent: str, controller: str = "cpu") -> list[int]:
        """The processes in ``parent`` (of ``controller``'s hierarchy)."""
        text = _read(self._dir(controller, parent) / "cgroup.procs")
        return [int(p) for p in text.split() if p.isdigit()]
