"""The container ops of the host <-> guest agent protocol (protocol 2 and later), and the guest's
``cpus_online`` (protocol 9): their answers, read (no IO).

``vmsandbox.agent_protocol`` frames and decodes the messages; this reads the bodies of the
responses to container ops (a container's state, an exec's result, cgroup statistics, a chunk of
a container's log, a stream session's output), each field typed and bounded as the protocol's
readers check them, since an untrusted guest wrote them.
"""

from __future__ import annotations

import binascii
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from vmsandbox.agent_protocol import (
    EXEC_OUTPUT_MAX,
    INT32_MAX,
    ProtocolError,
    clip,
    read_count,
    read_field,
    read_object,
    read_str,
    read_text,
)

# ---- container ops (protocol 2) -------------------------------------------------------------------

CONTAINER_STATES = frozenset({"created", "running", "exited"})


@dataclass(frozen=True)
class ContainerState:
    """A container as the guest agent sees it (body of create/start/kill/wait/status, list items)."""

    id: str
    state: str
    """created | running | exited"""
    pid: int
    exit_code: int
    signal: int
    """The signal that ended it (0: it exited on its own)."""
    oom_killed: bool
    created_at_ns: int
    started_at_ns: int
    finished_at_ns: int


def container_state_from_body(body: Mapping[str, object], where: str = "container") -> ContainerState:
    state = read_str(body, "state", where)
    if state not in CONTAINER_STATES:
        raise ProtocolError(f"{where}: unknown container state {state[:40]!r}")
    oom = read_field(body, "oom_killed", bool, where)
    assert isinstance(oom, bool)
    return ContainerState(
        id=read_text(body, "id", where, 128),
        state=state,
        pid=read_count(body, "pid", where, INT32_MAX),
        exit_code=read_count(body, "exit_code", where, INT32_MAX),
        signal=read_count(body, "signal", where, INT32_MAX),
        oom_killed=oom,
        created_at_ns=read_count(body, "created_at_ns", where),
        started_at_ns=read_count(body, "started_at_ns", where),
        finished_at_ns=read_count(body, "finished_at_ns", where),
    )


@dataclass(frozen=True)
class ExecResult:
    exit_code: int
    stdout: bytes
    stderr: bytes
    timed_out: bool
    dropped_bytes: int
    """Output beyond the bound, not kept."""


def _b64(body: Mapping[str, object], key: str, where: str) -> bytes:
    """Output in standard base64 with its padding and nothing else (RFC 4648); missing or null: none."""
    value = body.get(key)
    if value is None:
        return b""
    if not isinstance(value, str):
        raise ProtocolError(f"{where}: field {key!r} must be base64 text")
    if len(value) > 4 * -(-EXEC_OUTPUT_MAX // 3):
        raise ProtocolError(f"{where}: field {key!r} holds more than {EXEC_OUTPUT_MAX} bytes")
    # strict_mode alone still takes padding past the last quantum ("AAAAAAAA=", "AAAA====")
    if len(value) % 4 or "=" in value[:-2]:
        raise ProtocolError(f"{where}: field {key!r} is not base64: its padding is wrong")
    try:
        return binascii.a2b_base64(value, strict_mode=True)
    except (binascii.Error, ValueError) as e:
        raise ProtocolError(f"{where}: field {key!r} is not base64: {e}") from None


def exec_result_from_body(body: Mapping[str, object], where: str = "exec") -> ExecResult:
    timed_out = read_field(body, "timed_out", bool, where)
    assert isinstance(timed_out, bool)
    return ExecResult(
        exit_code=read_count(body, "exit_code", where, INT32_MAX),
        stdout=_b64(body, "stdout", where),
        stderr=_b64(body, "stderr", where),
        timed_out=timed_out,
        dropped_bytes=read_count(body, "dropped_bytes", where),
    )


IO_DEVICES_MAX = 32
"""Devices of ``io.stat`` one stats body may list."""
HUGETLB_SIZES_MAX = 8
"""Hugepage sizes one stats body may list."""
_HUGETLB_SIZE = re.compile(r"[0-9]{1,6}[KMG]B")


@dataclass(frozen=True)
class IoDevice:
    """One line of a cgroup's ``io.stat``: a block device of the guest and what was done on it."""

    major: int
    minor: int
    rbytes: int
    wbytes: int
    rios: int
    wios: int


@dataclass(frozen=True)
class CgroupReadings:
    """What a container's cgroup v2 files, its processes and its writable layer's file system say
    beyond the basic usage: each field is None when the agent did not send it (agents before this
    field, a kernel without the file, or a limit that is "max")."""

    # cpu.stat
    cpu_user_usec: int | None = None
    cpu_system_usec: int | None = None
    cpu_nr_periods: int | None = None
    cpu_nr_throttled: int | None = None
    cpu_throttled_usec: int | None = None
    # memory.stat, memory.events, memory.peak, memory.swap.current
    memory_file: int | None = None
    memory_file_mapped: int | None = None
    memory_kernel: int | None = None
    memory_active_file: int | None = None
    memory_inactive_file: int | None = None
    memory_events_max: int | None = None
    memory_events_oom: int | None = None
    memory_peak: int | None = None
    memory_swap_current: int | None = None
    # limits: memory.max, memory.low, memory.swap.max, cpu.weight, cpu.max, pids.max (0: none)
    memory_max: int | None = None
    memory_low: int | None = None
    memory_swap_max: int | None = None
    cpu_weight: int | None = None
    cpu_max_quota_usec: int | None = None
    cpu_max_period_usec: int | None = None
    pids_max: int | None = None
    # pressure stall totals (cpu.pressure, memory.pressure, io.pressure)
    psi_cpu_some_usec: int | None = None
    psi_cpu_full_usec: int | None = None
    psi_memory_some_usec: int | None = None
    psi_memory_full_usec: int | None = None
    psi_io_some_usec: int | None = None
    psi_io_full_usec: int | None = None
    # the processes of cgroup.procs and their open descriptors
    processes: int | None = None
    file_descriptors: int | None = None
    sockets: int | None = None
    # statfs of the file system holding the writable layer
    fs_bytes: int | None = None
    fs_inodes: int | None = None
    fs_inodes_free: int | None = None
    io: tuple[IoDevice, ...] | None = None
    hugetlb: tuple[tuple[str, int], ...] | None = None
    """(page size as the kernel names it, "2MB"; bytes in use) per hugetlb.<size>.current."""


_READING_COUNTS = tuple(f.name for f in fields(CgroupReadings) if f.name not in ("io", "hugetlb"))


@dataclass(frozen=True)
class CgroupStats:
    """Usage of one container's cgroup (or of the whole guest) at ``timestamp_ns``."""

    timestamp_ns: int
    cpu_usage_ns: int
    memory_usage_bytes: int
    memory_working_set_bytes: int
    memory_rss_bytes: int
    page_faults: int
    major_page_faults: int
    pids: int
    writable_bytes: int
    writable_inodes: int
    oom_kills: int | None = None
    """``oom_kill`` of memory.events (None: not sent)."""
    readings: CgroupReadings = field(default_factory=CgroupReadings)


def _io_devices(body: Mapping[str, object], where: str) -> tuple[IoDevice, ...]:
    raw = read_field(body, "io", list, where)
    assert isinstance(raw, list)
    if len(raw) > IO_DEVICES_MAX:
        raise ProtocolError(f"{where}: field 'io' lists more than {IO_DEVICES_MAX} devices")
    out = []
    for i, entry in enumerate(raw):
        at = f"{where}: io[{i}]"
        if not isinstance(entry, dict):
            raise ProtocolError(f"{at} must be an object")
        out.append(
            IoDevice(
                major=read_count(entry, "major", at, INT32_MAX),
                minor=read_count(entry, "minor", at, INT32_MAX),
                rbytes=read_count(entry, "rbytes", at),
                wbytes=read_count(entry, "wbytes", at),
                rios=read_count(entry, "rios", at),
                wios=read_count(entry, "wios", at),
            )
        )
    return tuple(out)


def _hugetlb(body: Mapping[str, object], where: str) -> tuple[tuple[str, int], ...]:
    raw = read_object(body, "hugetlb", where)
    if len(raw) > HUGETLB_SIZES_MAX:
        raise ProtocolError(f"{where}: field 'hugetlb' lists more than {HUGETLB_SIZES_MAX} page sizes")
    for size in raw:
        if not _HUGETLB_SIZE.fullmatch(size):
            raise ProtocolError(f"{where}: hugetlb page size {clip(size, 20)} is not one the kernel names")
    return tuple(sorted((size, read_count(raw, size, f"{where}: hugetlb")) for size in raw))


def readings_from_body(body: Mapping[str, object], where: str = "stats") -> CgroupReadings:
    """The optional readings of a stats body: each field present is checked, each absent is None."""
    counts = {name: read_count(body, name, where) for name in _READING_COUNTS if name in body}
    return CgroupReadings(
        **counts,
        io=_io_devices(body, where) if "io" in body else None,
        hugetlb=_hugetlb(body, where) if "hugetlb" in body else None,
    )


def stats_from_body(body: Mapping[str, object], where: str = "stats") -> CgroupStats:
    return CgroupStats(
        timestamp_ns=read_count(body, "timestamp_ns", where),
        cpu_usage_ns=read_count(body, "cpu_usage_ns", where),
        memory_usage_bytes=read_count(body, "memory_usage_bytes", where),
        memory_working_set_bytes=read_count(body, "memory_working_set", where),
        memory_rss_bytes=read_count(body, "memory_rss_bytes", where),
        page_faults=read_count(body, "memory_page_faults", where),
        major_page_faults=read_count(body, "memory_major_faults", where),
        pids=read_count(body, "pids", where),
        writable_bytes=read_count(body, "writable_bytes", where) if "writable_bytes" in body else 0,
        writable_inodes=read_count(body, "writable_inodes", where) if "writable_inodes" in body else 0,
        oom_kills=read_count(body, "oom_kills", where) if "oom_kills" in body else None,
        readings=readings_from_body(body, where),
    )


# ---- the guest's CPUs (protocol 9) ---------------------------------------------------------------

MAX_ONLINE_CPUS = 4096
"""The most CPUs ``cpus_online`` asks a guest to have online (the agent refuses more)."""


def cpus_online_from_body(body: Mapping[str, object], where: str = "cpus_online") -> int:
    """How many CPUs the guest says are online after ``cpus_online``. Only the guest relies on it:
    its vCPUs' host CPUs are reserved and pinned whatever it says, and the host waits for its report."""
    return read_count(body, "online", where, INT32_MAX)


# ---- container logs (protocol 3) ------------------------------------------------------------------


@dataclass(frozen=True)
class LogChunk:
    """Body of a ``log_read`` response: ``data`` is the container's CRI log from stream offset
    ``offset``; ``eof``: the container's output streams are closed and nothing follows."""

    offset: int
    data: bytes
    eof: bool


def log_chunk_from_body(body: Mapping[str, object], asked: int, max_bytes: int, where: str = "log_read") -> LogChunk:
    """The chunk answering ``log_read`` from ``asked`` for at most ``max_bytes``. An answer that
    goes back before ``asked`` or carries more than was asked is a ProtocolError (an answer from
    a later offset says the guest no longer holds what lay between)."""
    offset = read_count(body, "offset", where)
    if offset < asked:
        raise ProtocolError(f"{where}: answered from offset {offset}, before the {asked} asked for")
    value = read_field(body, "data", str, where)
    assert isinstance(value, str)
    if len(value) > 4 * ((max_bytes + 2) // 3):  # checked before decoding: never decode more than asked
        raise ProtocolError(f"{where}: {len(value)} base64 characters for at most {max_bytes} bytes")
    data = _b64(body, "data", where)
    if len(data) > max_bytes:
        raise ProtocolError(f"{where}: {len(data)} bytes for at most {max_bytes}")
    eof = read_field(body, "eof", bool, where)
    assert isinstance(eof, bool)
    return LogChunk(offset=offset, data=data, eof=eof)


# ---- stream sessions: streamed processes, attach sessions, forwarded connections -----------------

STREAM_READ_MAX = 64 << 10
"""Bytes of output the host asks one read of a stream session for (the agent buffers at most
256 KiB per stream)."""
STREAM_WRITE_MAX = 32 << 10
"""Bytes one write to a stream session may carry (the agent refuses more)."""


@dataclass(frozen=True)
class StreamKind:
    """The ops of one kind of stream session in the guest agent. Streamed processes, attach
    sessions and forwarded connections have the same ops (open, a long-poll read, bounded writes,
    the end of the input, release; resize for those with a terminal), named apart, with the
    session named by a field of its own and output in fields of their own."""

    open_op: str
    id_field: str
    """The field of the open's answer and of every later op's args that names the session."""
    read_op: str
    write_op: str
    close_input_op: str
    release_op: str
    resize_op: str | None
    output_fields: tuple[str, ...]
    """The read answer's base64 output fields: stdout (and stderr)."""
    done_field: str
    """The read answer's field saying nothing more will come."""
    exit_code: bool
    """A finished read answer carries the exit code."""


PROC = StreamKind(
    open_op="proc_start",
    id_field="proc",
    read_op="proc_read",
    write_op="proc_write",
    close_input_op="proc_close_stdin",
    release_op="proc_release",
    resize_op="proc_resize",
    output_fields=("stdout", "stderr"),
    done_field="done",
    exit_code=True,
)
ATTACH = StreamKind(
    open_op="attach_open",
    id_field="attach",
    read_op="attach_read",
    write_op="attach_write",
    close_input_op="attach_close_stdin",
    release_op="attach_release",
    resize_op="attach_resize",
    output_fields=("stdout", "stderr"),
    done_field="done",
    exit_code=False,
)
TCP = StreamKind(
    open_op="tcp_connect",
    id_field="conn",
    read_op="tcp_read",
    write_op="tcp_write",
    close_input_op="tcp_close_write",
    release_op="tcp_close",
    resize_op=None,
    output_fields=("data",),
    done_field="eof",
    exit_code=False,
)


@dataclass(frozen=True)
class StreamOutput:
    """One read of a stream session: output taken from it, and whether it finished (a process
    exited and its output drained, a container exited, a connection's end of stream)."""

    stdout: bytes
    stderr: bytes
    done: bool
    exit_code: int | None
    """A process's exit code once done (0 for kinds without one); None before."""


def stream_output_from_body(
    kind: StreamKind, body: Mapping[str, object], where: str, limit: int = STREAM_READ_MAX
) -> StreamOutput:
    done = read_field(body, kind.done_field, bool, where)
    assert isinstance(done, bool)
    out = [_b64(body, name, where) for name in kind.output_fields]
    if sum(map(len, out)) > limit:
        raise ProtocolError(f"{where}: {sum(map(len, out))} bytes of output (asked for at most {limit})")
    code = (read_count(body, "exit_code", where) if kind.exit_code else 0) if done else None
    return StreamOutput(out[0], out[1] if len(out) > 1 else b"", done, code)


def stream_id_from_body(kind: StreamKind, body: Mapping[str, object], where: str) -> str:
    sid = read_str(body, kind.id_field, where)
    if not (sid.isascii() and sid.isdigit()) or len(sid) > 20:
        raise ProtocolError(f"{where}: bad {kind.id_field} id {clip(sid)!r}")
    return sid


def container_states_from_body(body: Mapping[str, object], where: str = "list") -> list[ContainerState]:
    """The ``containers`` of a ``list`` answer."""
    items = read_field(body, "containers", list, where)
    assert isinstance(items, list)
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ProtocolError(f"{where}: containers[{i}] must be an object")
        out.append(container_state_from_body(item, f"{where}: containers[{i}]"))
    return out


def written_from_body(body: Mapping[str, object], sent: int, where: str) -> tuple[int, bool]:
    """(bytes taken, the other end closed its input) of a ``proc_write``, ``attach_write`` or
    ``tcp_write`` answer to ``sent`` bytes; ``closed`` is sent only when true."""
    written = read_count(body, "written", where, sent)
    closed = read_field(body, "closed", bool, where) if "closed" in body else False
    return written, closed is True
