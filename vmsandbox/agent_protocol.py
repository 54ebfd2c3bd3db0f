"""The host <-> guest agent protocol: typed messages and their JSON Lines encoding (no IO).

One UTF-8 JSON object per line, each with a version ``"v"`` and a ``"type"``; the full description
is in ``images/README.md``. The guest speaks first (``hello``, repeated until the host sends
``ack``); the host sends ``request`` messages (an ``op`` and its ``args``), each answered by a
``response`` with the same ``id``, in any order. Unknown keys are ignored, so later agents can add
fields without breaking this host; missing or mistyped fields are errors. This host reads versions
1 to 5 (version 1 has no ``args``, version 3 adds ``log_read``, version 4 gives a container created
with ``tty`` a terminal and adds ``attach_resize``, version 5 adds ``personalize``) and sends the
highest version both sides speak.

Everything here reads what an untrusted guest wrote, so it is bounded before it is parsed: a line
is at most ``MAX_FRAME_BYTES``, its arrays and objects nest at most ``MAX_DEPTH`` deep (checked by a
linear scan before ``json.loads`` recurses), numbers fit the fields they fill, and what the host
keeps of a body (a report in the sandbox's record, an error in a message) has bounded size.
``UnsolicitedBudget`` bounds the rate of messages nobody asked for.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import NamedTuple, TypeAlias

from vmsandbox import validation
from vmsandbox.errors import InfrastructureError

VERSION = 6
READABLE_VERSIONS = frozenset({1, 2, 3, 4, 5, 6})
TTY_VERSION = 4
"""The first protocol whose agents give a container created with ``tty`` a terminal (older ones
only joined its stderr to its stdout)."""
PERSONALIZE_VERSION = 5
"""The first protocol version with the ``personalize`` op (a guest restored from a snapshot)."""
VOLUMES_VERSION = 6
"""The first protocol version with the ``volume_*`` ops (copies of the kubelet's atomic-writer
volumes: ``vmsandbox.kubelet_volumes``)."""
CHANNEL_NAME = "io.vmsandbox.agent.0"
"""Name of the virtio-serial port the guest agent listens on."""
SHARED_TAG = "vmsandbox.shared"
"""Mount tag of the sandbox's shared directory (virtio-9p, read-write): logs, a container's files."""
IMAGES_TAG = "vmsandbox.images"
"""Mount tag of the image trees' read-only 9p export of sandboxes started by earlier versions (the
agent still mounts it for a lower named ``images/...``); containers' lower layers are image disks now."""


EXEC_OUTPUT_MAX = 16 << 20
"""Bytes of each output stream an ``exec`` response may carry (ExecSync's bound)."""
MAX_FRAME_BYTES = 2 * 4 * -(-EXEC_OUTPUT_MAX // 3) + (64 << 10)
"""The longest line a guest may send: an ``exec`` response with both streams full, base64-encoded,
plus room for its other fields (about 42.7 MiB)."""
MAX_DEPTH = 32
"""How deep arrays and objects may nest in a guest's line (the deepest legitimate one is 5)."""
MAX_BRACKETS = 1 << 16
"""How many arrays and objects one line may hold (a ``list`` of thousands of containers fits)."""
MAX_ERROR_CHARS = 2048
"""Characters of a guest's error text the host keeps (the rest is cut, saying how much)."""
INT64_MAX = (1 << 63) - 1
INT32_MAX = (1 << 31) - 1
UNKNOWN_CONTAINER = "unknown_container"
"""``code`` of a failed response: the agent has no container with the id asked about."""
_INSTANCE = re.compile(r"[0-9a-f]{16,64}")
_REPORT_TEXT_MAX = 256
_CMDLINE_MAX = 4096
_REPORT_ITEMS_MAX = 64


class ProtocolError(InfrastructureError):
    """A line from the other side is not a valid protocol message."""


class FrameTooLong(ProtocolError):
    """A line from the guest passed ``MAX_FRAME_BYTES`` before its end: the connection is dropped."""


class HugePages(NamedTuple):
    total: int
    free: int


@dataclass(frozen=True)
class NicReport:
    """A guest network interface as the agent sees it (loopback left out)."""

    name: str
    mac: str
    addresses: tuple[str, ...] = ()  # CIDRs
    up: bool = False


@dataclass(frozen=True)
class GuestReport:
    """What the guest says about itself (body of ``hello`` and of the ``report`` response)."""

    agent: str
    kernel: str
    vcpus: int
    mem_total_kib: int
    hugepages: Mapping[int, HugePages] = field(hash=False)
    """Page size in KiB -> pool counts."""
    cmdline: str
    boot_ms: int
    """Guest uptime when the report was made."""
    errors: tuple[str, ...] = ()
    """Problems the guest met while booting (a module that failed to load, ...)."""
    protocol: int = 1
    """Protocol version the agent speaks (reports without the field come from version 1 agents)."""
    hostname: str = ""
    nics: tuple[NicReport, ...] = ()
    """The guest's network interfaces (older agents do not send them)."""
    instance: str = ""
    """The agent process's identity, random, made when it started: another one later means the agent
    restarted and lost its containers (older agents do not send it)."""


@dataclass(frozen=True)
class Hello:
    report: GuestReport


@dataclass(frozen=True)
class Ack:
    pass


@dataclass(frozen=True)
class Request:
    id: str
    op: str
    args: Mapping[str, object] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class Response:
    id: str | None
    """None when the guest could not read the id of the message it answers."""
    ok: bool
    body: Mapping[str, object] = field(default_factory=dict, hash=False)
    error: str = ""
    code: str = ""
    """Why a failure happened, for the host to act on (``UNKNOWN_CONTAINER``); "" when unsaid."""


Message: TypeAlias = Hello | Ack | Request | Response
_JsonObject: TypeAlias = dict[str, object]


# ---- encoding -------------------------------------------------------------------------------------


def report_to_body(report: GuestReport) -> _JsonObject:
    body: _JsonObject = {
        "agent": report.agent,
        "kernel": report.kernel,
        "vcpus": report.vcpus,
        "mem_total_kib": report.mem_total_kib,
        "hugepages": {
            str(size): {"total": pool.total, "free": pool.free} for size, pool in sorted(report.hugepages.items())
        },
        "cmdline": report.cmdline,
        "boot_ms": report.boot_ms,
    }
    if report.errors:
        body["errors"] = list(report.errors)
    if report.protocol != 1:
        body["protocol"] = report.protocol
    if report.hostname:
        body["hostname"] = report.hostname
    if report.nics:
        body["nics"] = [{"name": n.name, "mac": n.mac, "addresses": list(n.addresses), "up": n.up} for n in report.nics]
    if report.instance:
        body["instance"] = report.instance
    return body


def encode(msg: Message, version: int = VERSION) -> bytes:
    """One line (ending in ``\\n``) carrying ``msg`` as protocol ``version``."""
    obj: _JsonObject = {"v": version}
    if isinstance(msg, Hello):
        obj |= {"type": "hello", "body": report_to_body(msg.report)}
    elif isinstance(msg, Ack):
        obj["type"] = "ack"
    elif isinstance(msg, Request):
        if not msg.id or not msg.op:
            raise ProtocolError(f"cannot encode a request with an empty id or op: {msg!r}")
        obj |= {"type": "request", "id": msg.id, "op": msg.op}
        if msg.args:
            obj["args"] = dict(msg.args)
    elif isinstance(msg, Response):
        obj |= {"type": "response", "id": msg.id, "ok": msg.ok}
        if msg.ok:
            obj["body"] = dict(msg.body)
        else:
            obj["error"] = msg.error
            if msg.code:
                obj["code"] = msg.code
    else:  # pragma: no cover - exhaustiveness for callers outside mypy
        raise ProtocolError(f"not a protocol message: {msg!r}")
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


# ---- decoding -------------------------------------------------------------------------------------


def _field(obj: Mapping[str, object], key: str, kind: type, where: str) -> object:
    if key not in obj:
        raise ProtocolError(f"{where}: missing field {key!r}")
    value = obj[key]
    # bool is an int subclass in Python; JSON keeps them apart, so do we.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ProtocolError(f"{where}: field {key!r} must be {_JSON_NAMES[kind]}, got {_json_kind(value)}")
    return value


_JSON_NAMES: dict[type, str] = {
    str: "a string",
    int: "an integer",
    bool: "a boolean",
    dict: "an object",
    list: "an array",
}


def _json_kind(value: object) -> str:
    # json.loads yields only dict, list, str, int, float, bool and None.
    return "null" if value is None else _JSON_NAMES.get(type(value), "a number")


def _str(obj: Mapping[str, object], key: str, where: str) -> str:
    value = _field(obj, key, str, where)
    assert isinstance(value, str)
    return value


def _count(obj: Mapping[str, object], key: str, where: str, maximum: int = INT64_MAX) -> int:
    value = _field(obj, key, int, where)
    assert isinstance(value, int)
    if value < 0:
        raise ProtocolError(f"{where}: field {key!r} must not be negative, got {value}")
    if value > maximum:
        raise ProtocolError(f"{where}: field {key!r} must be at most {maximum}, got a {value.bit_length()}-bit number")
    return value


def _text(obj: Mapping[str, object], key: str, where: str, limit: int = _REPORT_TEXT_MAX) -> str:
    value = _str(obj, key, where)
    if len(value) > limit:
        raise ProtocolError(f"{where}: field {key!r} is longer than {limit} characters ({len(value)})")
    return value


def _texts(obj: Mapping[str, object], key: str, where: str, limit: int) -> tuple[str, ...]:
    """An optional array of strings, each at most ``limit`` characters, at most ``_REPORT_ITEMS_MAX`` of them."""
    if key not in obj:
        return ()
    raw = _field(obj, key, list, where)
    assert isinstance(raw, list)
    if not all(isinstance(e, str) for e in raw):
        raise ProtocolError(f"{where}: field {key!r} must be an array of strings")
    if len(raw) > _REPORT_ITEMS_MAX or any(len(e) > limit for e in raw):
        raise ProtocolError(
            f"{where}: field {key!r} may hold {_REPORT_ITEMS_MAX} strings of at most {limit} characters"
        )
    return tuple(raw)


def _object(obj: Mapping[str, object], key: str, where: str) -> _JsonObject:
    value = _field(obj, key, dict, where)
    assert isinstance(value, dict)
    return value


def report_from_body(body: Mapping[str, object], where: str = "report") -> GuestReport:
    """The GuestReport in a ``hello`` body or a ``report`` response body (it is kept in the sandbox's
    record, so every part of it is bounded)."""
    hugepages = _object(body, "hugepages", where)
    if len(hugepages) > _REPORT_ITEMS_MAX:
        raise ProtocolError(f"{where}: more than {_REPORT_ITEMS_MAX} hugepage sizes")
    pools: dict[int, HugePages] = {}
    for size, pool in hugepages.items():
        if not size.isdigit() or len(size) > 10 or int(size) == 0:
            raise ProtocolError(f"{where}: hugepage size {size[:20]!r} is not a positive KiB count")
        if not isinstance(pool, dict):
            raise ProtocolError(f"{where}: hugepages[{size!r}] must be an object")
        pool_where = f"{where}: hugepages[{size!r}]"
        pools[int(size)] = HugePages(total=_count(pool, "total", pool_where), free=_count(pool, "free", pool_where))
    vcpus = _count(body, "vcpus", where, INT32_MAX)
    if vcpus == 0:
        raise ProtocolError(f"{where}: field 'vcpus' must be at least 1")
    instance = _str(body, "instance", where) if "instance" in body else ""
    if instance and not _INSTANCE.fullmatch(instance):
        raise ProtocolError(f"{where}: field 'instance' must be 16 to 64 lowercase hex digits, got {_clip(instance)}")
    return GuestReport(
        agent=_text(body, "agent", where),
        kernel=_text(body, "kernel", where),
        vcpus=vcpus,
        mem_total_kib=_count(body, "mem_total_kib", where),
        hugepages=pools,
        cmdline=_text(body, "cmdline", where, _CMDLINE_MAX),
        boot_ms=_count(body, "boot_ms", where),
        errors=_texts(body, "errors", where, 1024),
        protocol=_count(body, "protocol", where, INT32_MAX) if "protocol" in body else 1,
        hostname=_text(body, "hostname", where) if "hostname" in body else "",
        nics=_nics(body, where),
        instance=instance,
    )


def _nics(body: Mapping[str, object], where: str) -> tuple[NicReport, ...]:
    if "nics" not in body:
        return ()
    raw = _field(body, "nics", list, where)
    assert isinstance(raw, list)
    if len(raw) > _REPORT_ITEMS_MAX:
        raise ProtocolError(f"{where}: more than {_REPORT_ITEMS_MAX} nics")
    out = []
    for i, item in enumerate(raw):
        at = f"{where}: nics[{i}]"
        if not isinstance(item, dict):
            raise ProtocolError(f"{at} must be an object")
        addresses = _texts(item, "addresses", at, 64)
        up = item.get("up", False)
        if not isinstance(up, bool):
            raise ProtocolError(f"{at}: field 'up' must be a boolean")
        out.append(NicReport(_text(item, "name", at, 64), _text(item, "mac", at, 64), addresses, up))
    return tuple(out)


# ---- bounds checked before parsing ----------------------------------------------------------------

_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)
"""A JSON string (an unterminated one runs to the end), so that brackets inside strings are skipped."""
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_OPENERS = frozenset(b"[{")


def nesting_depth(data: bytes, limit: int = MAX_DEPTH) -> int:
    """How deep arrays and objects nest in the JSON text ``data``, brackets inside strings not
    counted; the scan stops as soon as the depth passes ``limit`` (and returns it). Linear, and in C
    for the bulk: strings are dropped (a split on quotes when nothing is escaped, else a regex), then
    everything but brackets (``bytes.translate``); the brackets left are counted in Python
    (ProtocolError when there are more than ``MAX_BRACKETS``, which no legitimate line has)."""
    # without escapes (base64 output, most reports) strings are what lies between alternate quotes
    escaped = b"\\" in data
    outside = _JSON_STRING.sub(b"", data) if escaped else b"".join(data.split(b'"')[0::2])
    brackets = outside.translate(None, _NOT_BRACKETS)
    if len(brackets) > MAX_BRACKETS:
        raise ProtocolError(f"message holds more than {MAX_BRACKETS} arrays and objects")
    depth = deepest = 0
    for b in brackets:
        if b in _OPENERS:
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    break
        else:
            depth -= 1
    return deepest


def _no_constants(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


def decode(line: bytes) -> Message:
    """The message on one line (with or without its line ending); ProtocolError if invalid."""
    if len(line) > MAX_FRAME_BYTES:
        raise FrameTooLong(f"message is longer than {MAX_FRAME_BYTES} bytes ({len(line)})")
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProtocolError(f"message is not UTF-8: {e}") from None
    text = text.removesuffix("\n").removesuffix("\r")
    if not text.strip():
        raise ProtocolError("empty message line")
    if nesting_depth(line) > MAX_DEPTH:
        raise ProtocolError(f"message nests arrays and objects deeper than {MAX_DEPTH} levels ({_clip(text, 40)})")
    try:
        # ValueError also covers integers of more digits than Python converts (sys.get_int_max_str_digits)
        obj = json.loads(text, parse_constant=_no_constants)
    except (ValueError, RecursionError) as e:
        raise ProtocolError(f"message is not JSON: {_clip(str(e), 200)}: {_clip(text)}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"message is not a JSON object: {_clip(text)}")
    version = obj.get("v")
    if "v" not in obj:
        raise ProtocolError(f"message has no protocol version 'v': {_clip(text)}")
    if type(version) is not int or version not in READABLE_VERSIONS:
        readable = ", ".join(map(str, sorted(READABLE_VERSIONS)))
        raise ProtocolError(f"unsupported protocol version {repr(version)[:40]} (this host reads {readable})")
    kind = _str(obj, "type", "message")
    where = f"{kind} message"
    if kind == "hello":
        return Hello(report_from_body(_object(obj, "body", where), f"{where} body"))
    if kind == "ack":
        return Ack()
    if kind == "request":
        args = _object(obj, "args", where) if "args" in obj else {}
        request = Request(id=_str(obj, "id", where), op=_str(obj, "op", where), args=args)
        if not request.id or not request.op:
            raise ProtocolError(f"{where}: 'id' and 'op' must not be empty")
        return request
    if kind == "response":
        if "id" not in obj:
            raise ProtocolError(f"{where}: missing field 'id'")
        rid = None if obj["id"] is None else _str(obj, "id", where)
        ok = _field(obj, "ok", bool, where)
        if ok:
            return Response(id=rid, ok=True, body=_object(obj, "body", where))
        error = _str(obj, "error", where)
        if len(error) > MAX_ERROR_CHARS:
            error = error[:MAX_ERROR_CHARS] + f"...(+{len(error) - MAX_ERROR_CHARS} characters)"
        code = _text(obj, "code", where, 64) if "code" in obj else ""
        return Response(id=rid, ok=False, error=error, code=code)
    raise ProtocolError(f"unknown message type {kind[:40]!r}")


def _clip(text: str, limit: int = 120) -> str:
    """``text`` for a message: quoted, control characters escaped, cut after ``limit`` characters."""
    return validation.quote(text, limit)


# ---- the rate of messages nobody asked for --------------------------------------------------------

UNSOLICITED_BURST = 32
UNSOLICITED_PER_S = 4.0


@dataclass(frozen=True)
class UnsolicitedBudget:
    """A token bucket for the guest's unsolicited messages (responses to ids nobody waits for,
    hellos on a connection already acked, anything a guest never sends): ``UNSOLICITED_BURST`` at
    once, refilled at ``UNSOLICITED_PER_S``. A late answer to a request that timed out, or a hello
    that crossed the host's ack, costs one; a guest that floods runs out."""

    tokens: float = UNSOLICITED_BURST
    at: float = 0.0

    def spend(self, now: float) -> UnsolicitedBudget | None:
        """The budget after one more unsolicited message at ``now`` (monotonic seconds); None when spent."""
        tokens = (
            self.tokens if now <= self.at else min(UNSOLICITED_BURST, self.tokens + (now - self.at) * UNSOLICITED_PER_S)
        )
        if tokens < 1:
            return None
        return replace(self, tokens=tokens - 1, at=max(now, self.at))


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
    state = _str(body, "state", where)
    if state not in CONTAINER_STATES:
        raise ProtocolError(f"{where}: unknown container state {state[:40]!r}")
    oom = _field(body, "oom_killed", bool, where)
    assert isinstance(oom, bool)
    return ContainerState(
        id=_text(body, "id", where, 128),
        state=state,
        pid=_count(body, "pid", where, INT32_MAX),
        exit_code=_count(body, "exit_code", where, INT32_MAX),
        signal=_count(body, "signal", where, INT32_MAX),
        oom_killed=oom,
        created_at_ns=_count(body, "created_at_ns", where),
        started_at_ns=_count(body, "started_at_ns", where),
        finished_at_ns=_count(body, "finished_at_ns", where),
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
    value = body.get(key)
    if value is None:
        return b""
    if not isinstance(value, str):
        raise ProtocolError(f"{where}: field {key!r} must be base64 text")
    if len(value) > 4 * -(-EXEC_OUTPUT_MAX // 3):
        raise ProtocolError(f"{where}: field {key!r} holds more than {EXEC_OUTPUT_MAX} bytes")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ProtocolError(f"{where}: field {key!r} is not base64: {e}") from None


def exec_result_from_body(body: Mapping[str, object], where: str = "exec") -> ExecResult:
    timed_out = _field(body, "timed_out", bool, where)
    assert isinstance(timed_out, bool)
    return ExecResult(
        exit_code=_count(body, "exit_code", where, INT32_MAX),
        stdout=_b64(body, "stdout", where),
        stderr=_b64(body, "stderr", where),
        timed_out=timed_out,
        dropped_bytes=_count(body, "dropped_bytes", where),
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
    raw = _field(body, "io", list, where)
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
                major=_count(entry, "major", at, INT32_MAX),
                minor=_count(entry, "minor", at, INT32_MAX),
                rbytes=_count(entry, "rbytes", at),
                wbytes=_count(entry, "wbytes", at),
                rios=_count(entry, "rios", at),
                wios=_count(entry, "wios", at),
            )
        )
    return tuple(out)


def _hugetlb(body: Mapping[str, object], where: str) -> tuple[tuple[str, int], ...]:
    raw = _object(body, "hugetlb", where)
    if len(raw) > HUGETLB_SIZES_MAX:
        raise ProtocolError(f"{where}: field 'hugetlb' lists more than {HUGETLB_SIZES_MAX} page sizes")
    for size in raw:
        if not _HUGETLB_SIZE.fullmatch(size):
            raise ProtocolError(f"{where}: hugetlb page size {_clip(size, 20)} is not one the kernel names")
    return tuple(sorted((size, _count(raw, size, f"{where}: hugetlb")) for size in raw))


def readings_from_body(body: Mapping[str, object], where: str = "stats") -> CgroupReadings:
    """The optional readings of a stats body: each field present is checked, each absent is None."""
    counts = {name: _count(body, name, where) for name in _READING_COUNTS if name in body}
    return CgroupReadings(
        **counts,
        io=_io_devices(body, where) if "io" in body else None,
        hugetlb=_hugetlb(body, where) if "hugetlb" in body else None,
    )


def stats_from_body(body: Mapping[str, object], where: str = "stats") -> CgroupStats:
    return CgroupStats(
        timestamp_ns=_count(body, "timestamp_ns", where),
        cpu_usage_ns=_count(body, "cpu_usage_ns", where),
        memory_usage_bytes=_count(body, "memory_usage_bytes", where),
        memory_working_set_bytes=_count(body, "memory_working_set", where),
        memory_rss_bytes=_count(body, "memory_rss_bytes", where),
        page_faults=_count(body, "memory_page_faults", where),
        major_page_faults=_count(body, "memory_major_faults", where),
        pids=_count(body, "pids", where),
        writable_bytes=_count(body, "writable_bytes", where) if "writable_bytes" in body else 0,
        writable_inodes=_count(body, "writable_inodes", where) if "writable_inodes" in body else 0,
        oom_kills=_count(body, "oom_kills", where) if "oom_kills" in body else None,
        readings=readings_from_body(body, where),
    )


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
    offset = _count(body, "offset", where)
    if offset < asked:
        raise ProtocolError(f"{where}: answered from offset {offset}, before the {asked} asked for")
    value = _field(body, "data", str, where)
    assert isinstance(value, str)
    if len(value) > 4 * ((max_bytes + 2) // 3):  # checked before decoding: never decode more than asked
        raise ProtocolError(f"{where}: {len(value)} base64 characters for at most {max_bytes} bytes")
    data = _b64(body, "data", where)
    if len(data) > max_bytes:
        raise ProtocolError(f"{where}: {len(data)} bytes for at most {max_bytes}")
    eof = _field(body, "eof", bool, where)
    assert isinstance(eof, bool)
    return LogChunk(offset=offset, data=data, eof=eof)


PROC_READ_MAX = 64 << 10
"""Bytes of output the host asks one ``proc_read`` for (the agent buffers at most 256 KiB per stream)."""
PROC_WRITE_MAX = 32 << 10
"""Bytes of stdin one ``proc_write`` may carry: in base64 its request stays under the 64 KiB line
the agent reads."""


@dataclass(frozen=True)
class ProcOutput:
    """One ``proc_read`` answer: output taken from a streamed process, and its exit once it
    finished (exited and its output drained)."""

    stdout: bytes
    stderr: bytes
    done: bool
    exit_code: int | None


def proc_output_from_body(
    body: Mapping[str, object], where: str = "proc_read", limit: int = PROC_READ_MAX
) -> ProcOutput:
    done = _field(body, "done", bool, where)
    assert isinstance(done, bool)
    stdout, stderr = _b64(body, "stdout", where), _b64(body, "stderr", where)
    if len(stdout) + len(stderr) > limit:
        raise ProtocolError(f"{where}: {len(stdout) + len(stderr)} bytes of output (asked for at most {limit})")
    code = _count(body, "exit_code", where) if done else None
    return ProcOutput(stdout, stderr, done, code)


def proc_id_from_body(body: Mapping[str, object], where: str = "proc_start") -> str:
    proc = _str(body, "proc", where)
    if not proc.isdigit() or len(proc) > 20:
        raise ProtocolError(f"{where}: bad process id {_clip(proc)!r}")
    return proc
