"""The host <-> guest agent protocol: typed messages and their JSON Lines encoding (no IO).

One UTF-8 JSON object per line, each with a version ``"v"`` and a ``"type"``; the full description
is in ``images/README.md``. The guest speaks first (``hello``, repeated until the host sends
``ack``); the host sends ``request`` messages (an ``op`` and its ``args``), each answered by a
``response`` with the same ``id``, in any order. Unknown keys are ignored, so later agents can add
fields without breaking this host; missing or mistyped fields are errors. This host sends version
2 and reads 1 and 2 (version 1 has no ``args``).
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple, TypeAlias

from vmsandbox.errors import InfrastructureError

VERSION = 2
READABLE_VERSIONS = frozenset({1, 2})
CHANNEL_NAME = "io.vmsandbox.agent.0"
"""Name of the virtio-serial port the guest agent listens on."""
SHARED_TAG = "vmsandbox.shared"
"""Mount tag of the sandbox's shared directory (virtio-9p, read-write): logs, a container's files."""
IMAGES_TAG = "vmsandbox.images"
"""Mount tag of the host's unpacked image trees (virtio-9p, read-only): containers' lower layers."""


class ProtocolError(InfrastructureError):
    """A line from the other side is not a valid protocol message."""


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
    return body


def encode(msg: Message) -> bytes:
    """One line (ending in ``\\n``) carrying ``msg``."""
    obj: _JsonObject = {"v": VERSION}
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


def _count(obj: Mapping[str, object], key: str, where: str) -> int:
    value = _field(obj, key, int, where)
    assert isinstance(value, int)
    if value < 0:
        raise ProtocolError(f"{where}: field {key!r} must not be negative, got {value}")
    return value


def _object(obj: Mapping[str, object], key: str, where: str) -> _JsonObject:
    value = _field(obj, key, dict, where)
    assert isinstance(value, dict)
    return value


def report_from_body(body: Mapping[str, object], where: str = "report") -> GuestReport:
    """The GuestReport in a ``hello`` body or a ``report`` response body."""
    pools: dict[int, HugePages] = {}
    for size, pool in _object(body, "hugepages", where).items():
        if not size.isdigit() or int(size) == 0:
            raise ProtocolError(f"{where}: hugepage size {size!r} is not a positive KiB count")
        if not isinstance(pool, dict):
            raise ProtocolError(f"{where}: hugepages[{size!r}] must be an object")
        pool_where = f"{where}: hugepages[{size!r}]"
        pools[int(size)] = HugePages(total=_count(pool, "total", pool_where), free=_count(pool, "free", pool_where))
    errors: tuple[str, ...] = ()
    if "errors" in body:
        raw = _field(body, "errors", list, where)
        assert isinstance(raw, list)
        if not all(isinstance(e, str) for e in raw):
            raise ProtocolError(f"{where}: field 'errors' must be an array of strings")
        errors = tuple(raw)
    vcpus = _count(body, "vcpus", where)
    if vcpus == 0:
        raise ProtocolError(f"{where}: field 'vcpus' must be at least 1")
    return GuestReport(
        agent=_str(body, "agent", where),
        kernel=_str(body, "kernel", where),
        vcpus=vcpus,
        mem_total_kib=_count(body, "mem_total_kib", where),
        hugepages=pools,
        cmdline=_str(body, "cmdline", where),
        boot_ms=_count(body, "boot_ms", where),
        errors=errors,
        protocol=_count(body, "protocol", where) if "protocol" in body else 1,
        hostname=_str(body, "hostname", where) if "hostname" in body else "",
        nics=_nics(body, where),
    )


def _nics(body: Mapping[str, object], where: str) -> tuple[NicReport, ...]:
    if "nics" not in body:
        return ()
    raw = _field(body, "nics", list, where)
    assert isinstance(raw, list)
    out = []
    for i, item in enumerate(raw):
        at = f"{where}: nics[{i}]"
        if not isinstance(item, dict):
            raise ProtocolError(f"{at} must be an object")
        addresses = item.get("addresses", [])
        if not isinstance(addresses, list) or not all(isinstance(a, str) for a in addresses):
            raise ProtocolError(f"{at}: field 'addresses' must be an array of strings")
        up = item.get("up", False)
        if not isinstance(up, bool):
            raise ProtocolError(f"{at}: field 'up' must be a boolean")
        out.append(NicReport(_str(item, "name", at), _str(item, "mac", at), tuple(addresses), up))
    return tuple(out)


def decode(line: bytes) -> Message:
    """The message on one line (with or without its line ending); ProtocolError if invalid."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProtocolError(f"message is not UTF-8: {e}") from None
    text = text.removesuffix("\n").removesuffix("\r")
    if not text.strip():
        raise ProtocolError("empty message line")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProtocolError(f"message is not JSON: {e}: {_clip(text)}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"message is not a JSON object: {_clip(text)}")
    version = obj.get("v")
    if "v" not in obj:
        raise ProtocolError(f"message has no protocol version 'v': {_clip(text)}")
    if type(version) is not int or version not in READABLE_VERSIONS:
        readable = ", ".join(map(str, sorted(READABLE_VERSIONS)))
        raise ProtocolError(f"unsupported protocol version {version!r} (this host reads {readable})")
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
        return Response(id=rid, ok=False, error=_str(obj, "error", where))
    raise ProtocolError(f"unknown message type {kind!r}")


def _clip(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


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
        raise ProtocolError(f"{where}: unknown container state {state!r}")
    oom = _field(body, "oom_killed", bool, where)
    assert isinstance(oom, bool)
    return ContainerState(
        id=_str(body, "id", where),
        state=state,
        pid=_count(body, "pid", where),
        exit_code=_count(body, "exit_code", where),
        signal=_count(body, "signal", where),
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
    try:
        return base64.b64decode(value, validate=True)
    except binascii.Error as e:
        raise ProtocolError(f"{where}: field {key!r} is not base64: {e}") from None


def exec_result_from_body(body: Mapping[str, object], where: str = "exec") -> ExecResult:
    timed_out = _field(body, "timed_out", bool, where)
    assert isinstance(timed_out, bool)
    return ExecResult(
        exit_code=_count(body, "exit_code", where),
        stdout=_b64(body, "stdout", where),
        stderr=_b64(body, "stderr", where),
        timed_out=timed_out,
        dropped_bytes=_count(body, "dropped_bytes", where),
    )


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
    )


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
