"""A pod's cgroup on the host, as the kubelet names it (``LinuxPodSandboxConfig.cgroup_parent``):
which names are accepted, the cgroup v1 controllers a VM pod's QEMU is moved into, and the usage
the kubelet reads from them (cAdvisor's working set). Pure.

The kubelet makes the pod's cgroup (``--cgroups-per-qos``: ``/kubepods/<qos>/pod<uid>`` with the
cgroupfs driver, a ``.slice`` name with systemd's) and accounts and evicts by it. A VM pod's QEMU,
all its threads, is moved into it in the controllers that count what the pod uses (``CONTROLLERS``);
``cpuset`` and ``devices`` stay libvirt's (its per-vCPU pinning and the device list QEMU may open).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from vmsandbox.errors import InvalidArgument

CGROUPFS = "cgroupfs"
SYSTEMD = "systemd"
CGROUP_PARENT_MAX = 512  # bytes of the whole path (the kubelet's are under 100)
COMPONENT_MAX = 255  # a directory name
CONTROLLERS = ("cpu", "cpuacct", "memory", "pids")
"""The v1 hierarchies a VM pod's QEMU joins: what the kubelet's accounting and eviction read."""
_COMPONENT = re.compile(r"[A-Za-z0-9_.:@+-]+")  # what cgroupfs and systemd unit names use, ASCII only
STAT_LINES_MAX = 128  # memory.stat has about 40 lines
STAT_NAME_MAX = 64


def cgroup_parent(value: str, driver: str, where: str) -> str:
    """``value`` as the pod's cgroup ("" when none is given): an absolute cgroupfs path of at most
    ``CGROUP_PARENT_MAX`` bytes, every component a plain name (no '.', '..' or empty one). A
    systemd slice name is refused as such when the runtime's driver is cgroupfs."""
    if not value:
        return ""
    shown = repr(value[:80]) + ("..." if len(value) > 80 else "")
    if len(value.encode()) > CGROUP_PARENT_MAX:
        raise InvalidArgument(f"{where} {shown}: longer than {CGROUP_PARENT_MAX} bytes")
    if driver == CGROUPFS and not value.startswith("/") and value.endswith(".slice"):
        raise InvalidArgument(
            f"{where} {shown} is a systemd slice name, but this runtime's cgroup driver is cgroupfs "
            "(RuntimeConfig): set the kubelet's cgroupDriver to cgroupfs"
        )
    if driver != CGROUPFS:
        raise InvalidArgument(f"{where}: the cgroup driver {driver!r} is not supported (cgroupfs only)")
    if not value.startswith("/"):
        raise InvalidArgument(f"{where} {shown}: must be an absolute cgroupfs path")
    parts = value.split("/")[1:]
    if parts == [""]:
        raise InvalidArgument(f"{where} {shown}: must name a cgroup below the root, not the root")
    for part in parts:
        if part in ("", ".", ".."):
            raise InvalidArgument(f"{where} {shown}: must not contain an empty, '.' or '..' component")
        if len(part) > COMPONENT_MAX or not _COMPONENT.fullmatch(part):
            raise InvalidArgument(
                f"{where} {shown}: each component is at most {COMPONENT_MAX} of A-Z a-z 0-9 _ . : @ + -"
            )
    return value


@dataclass(frozen=True)
class PodUsage:
    """What a pod's cgroup says it uses, at ``timestamp_ns``."""

    timestamp_ns: int
    cpu_usage_ns: int  # cpuacct.usage
    memory_usage_bytes: int  # memory.usage_in_bytes
    memory_working_set_bytes: int  # usage less inactive file pages, as cAdvisor and the kubelet count it
    memory_rss_bytes: int  # total_rss of memory.stat
    page_faults: int
    major_page_faults: int


def parse_stat(text: str) -> dict[str, int]:
    """``memory.stat``'s "name value" lines; anything else is skipped, at most ``STAT_LINES_MAX``."""
    out: dict[str, int] = {}
    for line in text.splitlines()[:STAT_LINES_MAX]:
        name, _, value = line.partition(" ")
        if 0 < len(name) <= STAT_NAME_MAX and value.isascii() and value.isdigit() and len(value) <= 20:
            out[name] = int(value)
    return out


def working_set(usage_bytes: int, stat: Mapping[str, int]) -> int:
    """cAdvisor's working set of a v1 memory cgroup: usage less the inactive file pages (never below 0)."""
    return max(usage_bytes - stat.get("total_inactive_file", 0), 0)


def pod_usage(timestamp_ns: int, cpu_usage_ns: int, usage_bytes: int, stat: Mapping[str, int]) -> PodUsage:
    return PodUsage(
        timestamp_ns=timestamp_ns,
        cpu_usage_ns=max(cpu_usage_ns, 0),
        memory_usage_bytes=max(usage_bytes, 0),
        memory_working_set_bytes=working_set(usage_bytes, stat),
        memory_rss_bytes=stat.get("total_rss", 0),
        page_faults=stat.get("total_pgfault", 0),
        major_page_faults=stat.get("total_pgmajfault", 0),
    )


def proc_cgroups(text: str) -> dict[str, str]:
    """``/proc/<pid>/cgroup`` as controller -> path, for the v1 hierarchies (a line per hierarchy,
    ``id:controller[,controller]:path``; the v2 line's empty controller list is left out)."""
    out: dict[str, str] = {}
    for line in text.splitlines()[:64]:
        fields = line.split(":", 2)
        if len(fields) != 3 or not fields[2].startswith("/"):
            continue
        for controller in fields[1].split(","):
            if controller:
                out[controller] = fields[2]
    return out
