"""The host <-> guest agent protocol: typed messages and their JSON Lines encoding (no IO).

One UTF-8 JSON object per line, each with a version ``"v"`` and a ``"type"``; the full description
is in ``images/README.md``. The guest speaks first (``hello``, repeated until the host sends
``ack``); the host sends ``request`` messages (an ``op`` and its ``args``), each answered by a
``response`` with the same ``id``, in any order. Unknown keys are ignored, so later agents can add
fields without breaking this host; missing or mistyped fields are errors. This host reads versions
1 to 9 (version 1 has no ``args``, version 3 adds ``log_read``, version 4 gives a container created
with ``tty`` a terminal and adds ``attach_resize``, version 5 adds ``personalize``, version 6 the
kubelet volume copies, ``volume_begin`` to ``volume_remove``, version 7 ``create``'s
``image_mounts``, version 8 the idmapped root of a container in a user namespace, version 9
``cpus_online``) and sends the highest version both sides speak.

Everything here reads what an untrusted guest wrote, so it is bounded before it is parsed: a line
is at most ``MAX_FRAME_BYTES``, its arrays and objects nest at most ``MAX_DEPTH`` deep (checked by a
linear scan before ``json.loads`` recurses), numbers fit the fields they fill, and what the host
keeps of a body (a report in the sandbox's record, an error in a message) has bounded size.
``UnsolicitedBudget`` bounds the rate of messages nobody asked for. The other way, a request line
is at most ``MAX_REQUEST_BYTES``, the agent's bound. The bodies of the container
ops' responses are read by ``vmsandbox.agent_ops``, with the field readers defined here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import NamedTuple, TypeAlias

from vmsandbox import validation
from vmsandbox.errors import InfrastructureError

VERSION = 9
READABLE_VERSIONS = frozenset({1, 2, 3, 4, 5, 6, 7, 8, 9})
TTY_VERSION = 4
"""The first protocol whose agents give a container created with ``tty`` a terminal (older ones
only joined its stderr to its stdout)."""
PERSONALIZE_VERSION = 5
"""The first protocol version with the ``personalize`` op (a guest restored from a snapshot)."""
VOLUMES_VERSION = 6
"""The first protocol version with the ``volume_*`` ops (copies of the kubelet's atomic-writer
volumes: ``vmsandbox.kubelet_volumes``)."""
IMAGE_MOUNTS_VERSION = 7
"""The first protocol version whose ``create`` takes ``image_mounts`` (image volumes, KEP-4639)."""
USERNS_VERSION = 8
"""The first protocol whose agents give a container whose spec has a user namespace an idmapped
root file system (``create``; older ones would leave its image's files unmapped)."""
CPUS_ONLINE_VERSION = 9
"""The first protocol version with the ``cpus_online`` op (a resize into the pod's vCPU headroom:
the guest booted its pod's vCPUs alone and onlines the headroom's present ones)."""
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
MAX_REQUEST_BYTES = 1 << 20
"""The longest line the agent reads (its line end included): a longer request is refused here,
before it is sent, since the agent could only answer it with a failure that names no request."""
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


@dataclass(frozen=True)
class ImageMount:
    """An image volume of a ``create``: the spec's bind mount at ``destination`` gets, as its
    source, ``sub_path`` of the image disk whose serial is ``serial``, resolved by the agent
    inside that disk's tree (symlinks never lead out of it)."""

    destination: str
    serial: str
    sub_path: str = ""

    def to_arg(self) -> dict[str, str]:
        return {"destination": self.destination, "serial": self.serial, "sub_path": self.sub_path}


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
        line = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
        if len(line) > MAX_REQUEST_BYTES:
            raise ProtocolError(
                f"a {msg.op!r} request of {len(line)} bytes is longer than the agent reads ({MAX_REQUEST_BYTES})"
            )
        return line
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


def read_field(obj: Mapping[str, object], key: str, kind: type, where: str) -> object:
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


def read_str(obj: Mapping[str, object], key: str, where: str) -> str:
    value = read_field(obj, key, str, where)
    assert isinstance(value, str)
    return value


def read_count(obj: Mapping[str, object], key: str, where: str, maximum: int = INT64_MAX) -> int:
    value = read_field(obj, key, int, where)
    assert isinstance(value, int)
    if value < 0:
        raise ProtocolError(f"{where}: field {key!r} must not be negative, got {value}")
    if value > maximum:
        raise ProtocolError(f"{where}: field {key!r} must be at most {maximum}, got a {value.bit_length()}-bit number")
    return value


def read_text(obj: Mapping[str, object], key: str, where: str, limit: int = _REPORT_TEXT_MAX) -> str:
    value = read_str(obj, key, where)
    if len(value) > limit:
        raise ProtocolError(f"{where}: field {key!r} is longer than {limit} characters ({len(value)})")
    return value


def _texts(obj: Mapping[str, object], key: str, where: str, limit: int) -> tuple[str, ...]:
    """An optional array of strings, each at most ``limit`` characters, at most ``_REPORT_ITEMS_MAX`` of them."""
    if key not in obj:
        return ()
    raw = read_field(obj, key, list, where)
    assert isinstance(raw, list)
    if not all(isinstance(e, str) for e in raw):
        raise ProtocolError(f"{where}: field {key!r} must be an array of strings")
    if len(raw) > _REPORT_ITEMS_MAX or any(len(e) > limit for e in raw):
        raise ProtocolError(
            f"{where}: field {key!r} may hold {_REPORT_ITEMS_MAX} strings of at most {limit} characters"
        )
    return tuple(raw)


def read_object(obj: Mapping[str, object], key: str, where: str) -> _JsonObject:
    value = read_field(obj, key, dict, where)
    assert isinstance(value, dict)
    return value


def report_from_body(body: Mapping[str, object], where: str = "report") -> GuestReport:
    """The GuestReport in a ``hello`` body or a ``report`` response body (it is kept in the sandbox's
    record, so every part of it is bounded)."""
    hugepages = read_object(body, "hugepages", where)
    if len(hugepages) > _REPORT_ITEMS_MAX:
        raise ProtocolError(f"{where}: more than {_REPORT_ITEMS_MAX} hugepage sizes")
    pools: dict[int, HugePages] = {}
    for size, pool in hugepages.items():
        if not (size.isascii() and size.isdigit()) or len(size) > 10 or int(size) == 0:
            raise ProtocolError(f"{where}: hugepage size {size[:20]!r} is not a positive KiB count")
        if not isinstance(pool, dict):
            raise ProtocolError(f"{where}: hugepages[{size!r}] must be an object")
        pool_where = f"{where}: hugepages[{size!r}]"
        pools[int(size)] = HugePages(
            total=read_count(pool, "total", pool_where), free=read_count(pool, "free", pool_where)
        )
    vcpus = read_count(body, "vcpus", where, INT32_MAX)
    if vcpus == 0:
        raise ProtocolError(f"{where}: field 'vcpus' must be at least 1")
    protocol = read_count(body, "protocol", where, INT32_MAX) if "protocol" in body else 1
    if protocol == 0:
        raise ProtocolError(f"{where}: field 'protocol' must be at least 1")
    instance = read_str(body, "instance", where) if "instance" in body else ""
    if "instance" in body and not _INSTANCE.fullmatch(instance):
        raise ProtocolError(f"{where}: field 'instance' must be 16 to 64 lowercase hex digits, got {clip(instance)}")
    return GuestReport(
        agent=read_text(body, "agent", where),
        kernel=read_text(body, "kernel", where),
        vcpus=vcpus,
        mem_total_kib=read_count(body, "mem_total_kib", where),
        hugepages=pools,
        cmdline=read_text(body, "cmdline", where, _CMDLINE_MAX),
        boot_ms=read_count(body, "boot_ms", where),
        errors=_texts(body, "errors", where, 1024),
        protocol=protocol,
        hostname=read_text(body, "hostname", where) if "hostname" in body else "",
        nics=_nics(body, where),
        instance=instance,
    )


def _nics(body: Mapping[str, object], where: str) -> tuple[NicReport, ...]:
    if "nics" not in body:
        return ()
    raw = read_field(body, "nics", list, where)
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
        out.append(NicReport(read_text(item, "name", at, 64), read_text(item, "mac", at, 64), addresses, up))
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
        raise ProtocolError(f"message nests arrays and objects deeper than {MAX_DEPTH} levels ({clip(text, 40)})")
    try:
        # ValueError also covers integers of more digits than Python converts (sys.get_int_max_str_digits)
        obj = json.loads(text, parse_constant=_no_constants)
    except (ValueError, RecursionError) as e:
        raise ProtocolError(f"message is not JSON: {clip(str(e), 200)}: {clip(text)}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"message is not a JSON object: {clip(text)}")
    version = obj.get("v")
    if "v" not in obj:
        raise ProtocolError(f"message has no protocol version 'v': {clip(text)}")
    if type(version) is not int or version not in READABLE_VERSIONS:
        readable = ", ".join(map(str, sorted(READABLE_VERSIONS)))
        raise ProtocolError(f"unsupported protocol version {repr(version)[:40]} (this host reads {readable})")
    kind = read_str(obj, "type", "message")
    where = f"{kind} message"
    if kind == "hello":
        return Hello(report_from_body(read_object(obj, "body", where), f"{where} body"))
    if kind == "ack":
        return Ack()
    if kind == "request":
        args = read_object(obj, "args", where) if "args" in obj else {}
        request = Request(id=read_str(obj, "id", where), op=read_str(obj, "op", where), args=args)
        if not request.id or not request.op:
            raise ProtocolError(f"{where}: 'id' and 'op' must not be empty")
        return request
    if kind == "response":
        if "id" not in obj:
            raise ProtocolError(f"{where}: missing field 'id'")
        rid = None if obj["id"] is None else read_str(obj, "id", where)
        ok = read_field(obj, "ok", bool, where)
        if ok:
            return Response(id=rid, ok=True, body=read_object(obj, "body", where))
        error = read_str(obj, "error", where)
        if len(error) > MAX_ERROR_CHARS:
            error = error[:MAX_ERROR_CHARS] + f"...(+{len(error) - MAX_ERROR_CHARS} characters)"
        code = read_text(obj, "code", where, 64) if "code" in obj else ""
        return Response(id=rid, ok=False, error=error, code=code)
    raise ProtocolError(f"unknown message type {kind[:40]!r}")


def clip(text: str, limit: int = 120) -> str:
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
