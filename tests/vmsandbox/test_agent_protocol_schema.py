"""The host side of the agent protocol against its schema (proto/agent/agent-protocol.schema.json):
every request the host encodes is valid for its op, every op is the host's or listed as the agent's
alone, the schema's example answers are read by the host's readers, and an answer that breaks a
bound of the schema is refused by them (a table, and generated bodies whose validity must agree).
The agent's side is tested against the same file by images/agent/protocol_schema_test.go."""

from __future__ import annotations

import base64
import copy
import dataclasses
import json
import queue
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vmsandbox import agent_ops, agent_protocol, kubelet_volumes
from vmsandbox.adapters import agent_streams
from vmsandbox.adapters.agent_client import AgentClient
from vmsandbox.adapters.guest_channel import GuestChannelClosed, GuestChannelTimeout
from vmsandbox.agent_protocol import (
    INT32_MAX,
    INT64_MAX,
    Ack,
    GuestReport,
    Message,
    ProtocolError,
    Request,
    Response,
    decode,
    encode,
    report_from_body,
)
from vmsandbox.network import GuestNic, Route
from vmsandbox.snapshot_rules import personalize_args

REPO = Path(__file__).resolve().parents[2]
SCHEMA_PATH = REPO / "proto" / "agent" / "agent-protocol.schema.json"
SCHEMA: dict[str, Any] = json.loads(SCHEMA_PATH.read_text())
DEFS: dict[str, Any] = SCHEMA["$defs"]
OPS: list[str] = DEFS["request"]["properties"]["op"]["enum"]
AGENT_ONLY: list[str] = SCHEMA["x-agent-only-ops"]
CID = "0f" * 32


# ---- validation -----------------------------------------------------------------------------------


def _ecma_pattern(validator: Any, pattern: str, instance: object, schema: object) -> Iterator[Any]:
    """``pattern`` as ECMA-262 (and the agent's Go regexp) read it: a final ``$`` is the end of the
    text, where Python's ``$`` would also match before a last newline."""
    if not validator.is_type(instance, "string"):
        return
    assert isinstance(instance, str)
    regex = pattern[:-1] + r"\Z" if pattern.endswith("$") and not pattern.endswith("\\$") else pattern
    if not re.search(regex, instance):
        yield jsonschema.ValidationError(f"{instance[:80]!r} does not match {pattern!r}")


_Validator = jsonschema.validators.extend(  # type: ignore[no-untyped-call]
    jsonschema.Draft202012Validator, {"pattern": _ecma_pattern}
)


def _closed(node: object) -> object:
    """The schema with every object shape closed (no field it does not declare): what the host sends
    must use declared fields only, although readers ignore unknown ones."""
    if isinstance(node, list):
        return [_closed(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _closed(v) for k, v in node.items()}
    if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _validator(name: str, schema: Mapping[str, Any] = SCHEMA) -> Any:
    return _Validator({"$ref": f"#/$defs/{name}", "$defs": schema["$defs"]})


_VALIDATORS: dict[tuple[str, bool], Any] = {}


def problems(name: str, instance: object, *, closed: bool = False) -> list[str]:
    """Why ``instance`` is not a valid ``$defs/name`` (empty when it is)."""
    key = (name, closed)
    if key not in _VALIDATORS:
        _VALIDATORS[key] = _validator(name, _closed(SCHEMA) if closed else SCHEMA)  # type: ignore[arg-type]
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in _VALIDATORS[key].iter_errors(instance)]


def valid(name: str, instance: object) -> bool:
    return not problems(name, instance)


def examples(name: str) -> list[Any]:
    """The examples of ``$defs/name``, or of the definition it refers to."""
    node = DEFS[name]
    while "examples" not in node and "$ref" in node:
        node = DEFS[node["$ref"].rsplit("/", 1)[1]]
    return list(node.get("examples", []))


def test_the_schema_is_a_valid_draft_2020_12_schema_and_its_examples_are_valid() -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    assert SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    checked = 0
    for name, node in DEFS.items():
        for example in node.get("examples", []):
            assert problems(name, example, closed=True) == [], (name, example)
            checked += 1
    assert checked >= 40
    for op in OPS:
        assert f"args.{op}" in DEFS and f"result.{op}" in DEFS, op
        assert examples(f"result.{op}"), f"result.{op} has no example answer"


# ---- a client on a recording channel ----------------------------------------------------------------


class _Connection:
    """The host's end of a channel whose guest answers each request from ``answers``: records every
    line the host writes."""

    label = "recorded channel"

    def __init__(self, version: int, answers: Callable[[Request], Mapping[str, object]]) -> None:
        self.version = version
        self.lines: list[bytes] = []
        self._answers = answers
        self._inbox: queue.Queue[Message | None] = queue.Queue()

    def send(self, msg: Ack | Request) -> None:
        self.lines.append(encode(msg, self.version))
        if isinstance(msg, Request):
            self._inbox.put(Response(id=msg.id, ok=True, body=self._answers(msg)))

    def read(self, deadline: float, what: str) -> Message:
        try:
            msg = self._inbox.get(timeout=5)
        except queue.Empty:
            raise GuestChannelTimeout(what) from None
        if msg is None:
            raise GuestChannelClosed("closed")
        return msg

    def close(self) -> None:
        self._inbox.put(None)


class _Channel:
    def __init__(self, conn: _Connection, report: GuestReport) -> None:
        self.report = report
        self._conn = conn

    def take_connection(self) -> _Connection:
        return self._conn


REPORT = report_from_body(examples("report")[0])


def _example_answer(request: Request) -> Mapping[str, object]:
    """The first example answer of the op, fitted to what the request asked where a reader checks it."""
    body = dict(examples(f"result.{request.op}")[0])
    if request.op == "log_read":
        body["offset"] = request.args["offset"]
    for output in ("data", "stdout", "stderr"):
        if request.op.endswith("_read") and output in body:
            body[output] = ""
    return body


def recording_client(
    answers: Callable[[Request], Mapping[str, object]] = _example_answer,
) -> tuple[AgentClient, _Connection]:
    conn = _Connection(agent_protocol.VERSION, answers)
    return AgentClient(_Channel(conn, REPORT)), conn  # type: ignore[arg-type]


def sent(conn: _Connection) -> list[dict[str, Any]]:
    return [json.loads(line) for line in conn.lines]


VOLUME = kubelet_volumes.volume_id("/var/lib/kubelet/pods/u/volumes/kubernetes.io~configmap/cfg")
TREE = kubelet_volumes.VolumeTree(
    "..2026_01_01_00_00_00.123",
    kubelet_volumes.Meta(0o1777, 0, 0),
    kubelet_volumes.Meta(0o2755, 0, 2000),
    (
        kubelet_volumes.Entry("nested", "dir", kubelet_volumes.Meta(0o2755, 0, 2000)),
        kubelet_volumes.Entry("nested/key", "file", kubelet_volumes.Meta(0o440, 0, 2000), b"n1\n"),
        kubelet_volumes.Entry(
            "big", "file", kubelet_volumes.Meta(0o644, 0, 0), b"x" * (kubelet_volumes.CHUNK_BYTES + 5)
        ),
    ),
)


def _each(call: Callable[[Mapping[str, object]], None], batches: Iterator[dict[str, object]]) -> None:
    for batch in batches:
        call(batch)


CALLS: dict[str, Callable[[AgentClient], object]] = {
    "create": lambda c: c.create(
        CID,
        lower="disks/i0c0ffee",
        spec={"process": {"args": ["sh"]}, "mounts": [{"destination": "/v", "type": "bind", "source": "/x"}]},
        stdin=True,
        tty=True,
        image_mounts=(agent_protocol.ImageMount("/v", "0d15ea5e", "etc/x"),),
    ),
    "log_read": lambda c: c.log_read(CID, 0, 65536, 0.5),
    "start": lambda c: c.start(CID),
    "kill": lambda c: c.kill(CID, "TERM"),
    "wait": lambda c: c.wait(CID, 2.5),
    "status": lambda c: c.status(CID),
    "list": lambda c: c.list(),
    "delete": lambda c: c.delete(CID),
    "exec": lambda c: c.exec(CID, ["sh", "-c", "echo hi"], timeout_s=0),
    "stats": lambda c: (c.stats(CID), c.stats()),
    "update": lambda c: c.update(CID, {"memory.max": "268435456", "cpu.max": "50000 100000", "cpu.weight": "39"}),
    "volume_begin": lambda c: c.volume_begin(VOLUME, TREE.version),
    "volume_write": lambda c: _each(c.volume_write, kubelet_volumes.write_batches(VOLUME, TREE)),
    "volume_commit": lambda c: c.volume_commit(kubelet_volumes.commit_args(VOLUME, TREE)),
    "volume_remove": lambda c: c.volume_remove(VOLUME),
    "cpus_online": lambda c: c.cpus_online(2),
    "proc_start": lambda c: agent_streams.proc_start(c, CID, ["sh"], tty=True, stdin=True, rows=24, cols=80),
    "proc_read": lambda c: _stream(c, agent_ops.PROC).read(agent_ops.STREAM_READ_MAX, 1),
    "proc_write": lambda c: _stream(c, agent_ops.PROC).write_some(b"hello\n"),
    "proc_close_stdin": lambda c: _stream(c, agent_ops.PROC).close_input(),
    "proc_resize": lambda c: _stream(c, agent_ops.PROC).resize(40, 120),
    "proc_release": lambda c: _stream(c, agent_ops.PROC).release(),
    "attach_open": lambda c: agent_streams.attach_open(c, CID),
    "attach_read": lambda c: _stream(c, agent_ops.ATTACH).read(65536, 1),
    "attach_write": lambda c: _stream(c, agent_ops.ATTACH).write_some(b"input\n"),
    "attach_resize": lambda c: _stream(c, agent_ops.ATTACH).resize(40, 120),
    "attach_close_stdin": lambda c: _stream(c, agent_ops.ATTACH).close_input(),
    "attach_release": lambda c: _stream(c, agent_ops.ATTACH).release(),
    "tcp_connect": lambda c: agent_streams.tcp_connect(c, 8080),
    "tcp_read": lambda c: _stream(c, agent_ops.TCP).read(65536, 1),
    "tcp_write": lambda c: _stream(c, agent_ops.TCP).write_some(b"GET / HTTP/1.1\r\n\r\n"),
    "tcp_close_write": lambda c: _stream(c, agent_ops.TCP).close_input(),
    "tcp_close": lambda c: _stream(c, agent_ops.TCP).release(),
}
"""One call of each op the host sends, through AgentClient or a stream session's handle
(``vmsandbox.adapters.agent_streams``), with the arguments the shim gives it."""

STREAM_KINDS = (agent_ops.PROC, agent_ops.ATTACH, agent_ops.TCP)


def _stream(client: AgentClient, kind: agent_ops.StreamKind) -> agent_streams.AgentStream:
    """A handle on session "1" of ``kind``, as its open op returns one."""
    return agent_streams.AgentStream(client, kind, "1")


def _stream_ops(kind: agent_ops.StreamKind) -> set[str]:
    ops = {kind.open_op, kind.read_op, kind.write_op, kind.close_input_op, kind.release_op, kind.resize_op}
    return {op for op in ops if op is not None}


POD_NIC = GuestNic(
    "0A:58:0A:58:00:05", ("10.88.0.5/16", "fd00::5/64"), (Route("0.0.0.0/0", "10.88.0.1"), Route("10.0.0.0/8")), 1450
)


def _personalize(nic: GuestNic | None, time_ns: int) -> bytes:
    args = personalize_args(nic, "web-0", seed=bytes(32), time_ns=time_ns)
    return encode(Request(id="1", op="personalize", args=args))


OTHER_SENDERS: dict[str, Callable[[], list[bytes]]] = {
    # GuestChannel.open greets every guest with this request, as version 1, before it knows the guest's
    "report": lambda: [encode(Request(id="0", op="report"), 1), encode(Request(id="3", op="report"))],
    # shim.snapshots asks a restored guest to become the pod's
    "personalize": lambda: [_personalize(None, 1767225600000000000), _personalize(POD_NIC, 0)],
}


@pytest.mark.parametrize("op", sorted(CALLS))
def test_each_request_the_client_sends_is_valid_for_its_op(op: str) -> None:
    client, conn = recording_client()
    with client:
        CALLS[op](client)
    requests = sent(conn)
    assert requests and all(r["op"] == op for r in requests)
    for request in requests:
        assert problems("hostMessage", request, closed=True) == [], request
    assert max(map(len, conn.lines)) <= SCHEMA["x-lines"]["host-to-guest-max-bytes"]


@pytest.mark.parametrize("op", sorted(OTHER_SENDERS))
def test_the_greeting_and_personalize_requests_are_valid(op: str) -> None:
    for line in OTHER_SENDERS[op]():
        request = json.loads(line)
        assert request["op"] == op
        assert problems("hostMessage", request, closed=True) == [], request


def test_a_request_longer_than_the_agent_reads_is_not_sent() -> None:
    client, conn = recording_client()
    with client:
        spec = {"process": {"args": ["sh"], "env": ["X=" + "x" * SCHEMA["x-lines"]["host-to-guest-max-bytes"]]}}
        with pytest.raises(ProtocolError, match="longer than the agent reads"):
            client.create(CID, lower="disks/i0c0ffee", spec=spec)
        assert conn.lines == [] and not client._pending
        client.status(CID)  # the connection is still good
    assert [r["op"] for r in sent(conn)] == ["status"]


def test_an_ack_of_each_version_is_valid() -> None:
    for version in agent_protocol.READABLE_VERSIONS:
        assert problems("hostMessage", json.loads(encode(Ack(), version)), closed=True) == []


_CLIENT_NOT_OPS = {"request", "open", "close", "closed"}


def test_every_op_is_the_hosts_or_listed_as_the_agents_alone() -> None:
    typed = {name for name in vars(AgentClient) if not name.startswith("_")} - _CLIENT_NOT_OPS
    streamed = set().union(*map(_stream_ops, STREAM_KINDS))
    assert typed | streamed == set(CALLS), "each typed op of AgentClient and each stream op has a call above"
    sources = [*REPO.glob("vmsandbox/**/*.py"), *REPO.glob("shim/**/*.py"), *REPO.glob("bench/*.py")]
    in_source = {
        m.group(1) for p in sources for m in re.finditer(r"""\.request\(\s*["'](\w+)["']""", p.read_text())
    } | {"report"}  # GuestChannel's greeting builds its Request itself
    used = set(CALLS) | set(OTHER_SENDERS)
    assert in_source <= used, f"ops requested in the sources but not tested here: {in_source - used}"
    assert not set(AGENT_ONLY) & used, "an op the host uses is listed as the agent's alone"
    assert sorted(used | set(AGENT_ONLY)) == sorted(OPS), "the schema's ops are those the host uses and the agent's own"


def test_the_schema_states_the_versions_and_bounds_the_host_uses() -> None:
    proto = SCHEMA["x-protocol"]
    assert proto["version"] == agent_protocol.VERSION == DEFS["version"]["maximum"]
    assert set(proto["readable"]) == agent_protocol.READABLE_VERSIONS
    since = {op: DEFS[f"args.{op}"]["x-since"] for op in OPS}
    assert since["log_read"] == 3
    assert since["attach_resize"] == agent_protocol.TTY_VERSION
    assert since["personalize"] == agent_protocol.PERSONALIZE_VERSION
    assert since["cpus_online"] == agent_protocol.CPUS_ONLINE_VERSION
    assert {op for op, v in since.items() if v == agent_protocol.VOLUMES_VERSION} == {
        "volume_begin",
        "volume_write",
        "volume_commit",
        "volume_remove",
    }
    fields_since = {
        (op, name): field["x-since"]
        for op in OPS
        for name, field in DEFS[f"args.{op}"].get("properties", {}).items()
        if "x-since" in field
    }
    assert fields_since == {("create", "image_mounts"): agent_protocol.IMAGE_MOUNTS_VERSION}
    # each version adds an op, a field or changes one (x-changed: the newest version that changed it)
    changed = {op: DEFS[f"args.{op}"]["x-changed"] for op in OPS if "x-changed" in DEFS[f"args.{op}"]}
    assert changed == {"create": agent_protocol.USERNS_VERSION}
    assert max([*since.values(), *fields_since.values(), *changed.values()]) == agent_protocol.VERSION
    lines = SCHEMA["x-lines"]
    assert lines["guest-to-host-max-bytes"] == agent_protocol.MAX_FRAME_BYTES
    assert lines["host-to-guest-max-bytes"] == agent_protocol.MAX_REQUEST_BYTES
    assert lines["max-depth"] == agent_protocol.MAX_DEPTH
    assert lines["max-arrays-and-objects"] == agent_protocol.MAX_BRACKETS
    assert lines["unsolicited"] == {
        "burst": agent_protocol.UNSOLICITED_BURST,
        "per-second": agent_protocol.UNSOLICITED_PER_S,
    }
    assert agent_protocol.UNKNOWN_CONTAINER in DEFS["response"]["properties"]["code"]["examples"]
    assert set(DEFS["containerState"]["properties"]["state"]["enum"]) == agent_ops.CONTAINER_STATES
    exec_out = DEFS["result.exec"]["properties"]["stdout"]["maxLength"]
    assert exec_out == 4 * -(-agent_protocol.EXEC_OUTPUT_MAX // 3)
    assert DEFS["args.exec"]["properties"]["max_bytes"]["maximum"] == agent_protocol.EXEC_OUTPUT_MAX
    write = DEFS["args.proc_write"]["properties"]["data"]["maxLength"]
    assert write == 4 * -(-agent_ops.STREAM_WRITE_MAX // 3)
    stats = DEFS["result.stats"]["properties"]
    assert stats["io"]["maxItems"] == agent_ops.IO_DEVICES_MAX
    assert stats["hugetlb"]["maxProperties"] == agent_ops.HUGETLB_SIZES_MAX
    read_by_host = {f.name for f in dataclasses.fields(agent_ops.CgroupReadings)}
    assert read_by_host <= set(stats), "every reading the host takes is in the schema"


# ---- answers: the schema's examples are read, what breaks its bounds is refused ----------------------


def _read(op: str, body: Mapping[str, object]) -> object:
    """What the host makes of ``body`` as the answer to ``op`` (through its client, as in use)."""
    if op in ("report", "personalize"):
        return report_from_body(body)
    client, _ = recording_client(lambda _request: body)
    with client:
        return CALLS[op](client)


@pytest.mark.parametrize("op", sorted(set(OPS) - set(AGENT_ONLY)))
def test_each_example_answer_is_read_by_the_host(op: str) -> None:
    for body in examples(f"result.{op}"):
        _read(op, body)


@pytest.mark.parametrize("name", ["ack", "request", "hello", "response"])
def test_each_example_message_decodes(name: str) -> None:
    for message in examples(name):
        decode(json.dumps(message).encode() + b"\n")


def _changed(body: Mapping[str, Any], path: str, value: object) -> dict[str, Any]:
    """A deep copy of ``body`` with the field at ``path`` (keys and indexes joined by '/') set to
    ``value``, or removed when ``value`` is ``MISSING``."""
    out = copy.deepcopy(dict(body))
    *parents, last = path.split("/")
    node: Any = out
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if value is MISSING:
        del node[last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return out


MISSING = object()
REPORT_BODY = examples("report")[0]
STATE = examples("containerState")[0]
STATS = examples("result.stats")[0]
EXEC = examples("result.exec")[0]

REFUSED: list[tuple[str, Mapping[str, Any], str, object]] = [
    # (op whose answer it is, a valid answer, the field changed, its value breaking the schema)
    ("report", REPORT_BODY, "vcpus", 0),
    ("report", REPORT_BODY, "vcpus", INT32_MAX + 1),
    ("report", REPORT_BODY, "agent", "a" * 257),
    ("report", REPORT_BODY, "cmdline", "c" * 4097),
    ("report", REPORT_BODY, "hostname", "h" * 257),
    ("report", REPORT_BODY, "mem_total_kib", -1),
    ("report", REPORT_BODY, "boot_ms", INT64_MAX + 1),
    ("report", REPORT_BODY, "hugepages", {str(1 << i): {"total": 0, "free": 0} for i in range(65)}),
    ("report", REPORT_BODY, "hugepages", {"0": {"total": 0, "free": 0}}),
    ("report", REPORT_BODY, "hugepages", {"12345678901": {"total": 0, "free": 0}}),
    ("report", REPORT_BODY, "hugepages", {"\u00b2": {"total": 0, "free": 0}}),
    ("report", REPORT_BODY, "hugepages", {"\u0663": {"total": 0, "free": 0}}),
    ("report", REPORT_BODY, "hugepages/2048/free", -1),
    ("report", REPORT_BODY, "hugepages/2048/total", MISSING),
    ("report", REPORT_BODY, "errors", ["e"] * 65),
    ("report", REPORT_BODY, "errors", ["e" * 1025]),
    ("report", REPORT_BODY, "nics", [REPORT_BODY["nics"][0]] * 65),
    ("report", REPORT_BODY, "nics/0/name", "n" * 65),
    ("report", REPORT_BODY, "nics/0/addresses", ["a" * 65]),
    ("report", REPORT_BODY, "nics/0/up", "yes"),
    ("report", REPORT_BODY, "instance", "9F0C4E2A7B1D3C5E8A6F4B2D0C9E7A15"),
    ("report", REPORT_BODY, "instance", "0123456789abcde"),
    ("report", REPORT_BODY, "instance", ""),
    ("report", REPORT_BODY, "protocol", 0),
    ("report", REPORT_BODY, "protocol", INT32_MAX + 1),
    ("status", STATE, "state", "creating"),
    ("status", STATE, "pid", -1),
    ("status", STATE, "exit_code", INT32_MAX + 1),
    ("status", STATE, "id", "c" * 129),
    ("status", STATE, "oom_killed", 1),
    ("status", STATE, "created_at_ns", INT64_MAX + 1),
    ("status", STATE, "signal", MISSING),
    ("list", {"containers": [STATE]}, "containers", {"0": STATE}),
    ("list", {"containers": [STATE]}, "containers", [1]),
    ("list", {"containers": [STATE]}, "containers/0/state", "paused"),
    ("exec", EXEC, "exit_code", -1),
    ("exec", EXEC, "stdout", "@@@@"),
    ("exec", EXEC, "stderr", "aGVsbG8"),
    ("exec", EXEC, "stdout", "A" * (DEFS["result.exec"]["properties"]["stdout"]["maxLength"] + 4)),
    ("exec", EXEC, "timed_out", MISSING),
    ("exec", EXEC, "dropped_bytes", INT64_MAX + 1),
    ("stats", STATS, "pids", -1),
    ("stats", STATS, "memory_working_set", MISSING),
    ("stats", STATS, "memory_max", -1),
    ("stats", STATS, "writable_bytes", "4096"),
    ("stats", STATS, "io", [STATS["io"][0]] * 33),
    ("stats", STATS, "io/0/major", INT32_MAX + 1),
    ("stats", STATS, "io/0/wios", MISSING),
    ("stats", STATS, "hugetlb", {f"{1 << i}KB": 0 for i in range(9)}),
    ("stats", STATS, "hugetlb", {"2mB": 0}),
    ("stats", STATS, "hugetlb", {"2MB": -1}),
    ("log_read", examples("result.log_read")[0], "offset", -1),
    ("log_read", examples("result.log_read")[0], "data", MISSING),
    ("log_read", examples("result.log_read")[0], "data", "not base64"),
    ("log_read", examples("result.log_read")[0], "eof", "false"),
    ("log_read", examples("result.log_read")[0], "data", "A" * (4 * (512 << 10) // 3 + 4)),
    ("proc_read", examples("result.proc_read")[1], "exit_code", MISSING),
    ("proc_read", examples("result.proc_read")[1], "exit_code", -1),
    ("proc_read", examples("result.proc_read")[0], "done", MISSING),
    ("proc_read", examples("result.proc_read")[0], "stdout", "A" * (4 * (256 << 10) // 3 + 4)),
    ("proc_start", {"proc": "1"}, "proc", ""),
    ("proc_start", {"proc": "1"}, "proc", "p1"),
    ("proc_start", {"proc": "1"}, "proc", "1" * 21),
    ("proc_start", {"proc": "1"}, "proc", "\u0663"),
    ("attach_open", {"attach": "1"}, "attach", MISSING),
    ("tcp_connect", {"conn": "1"}, "conn", 1),
    ("proc_write", {"written": 6}, "written", -1),
    ("proc_write", {"written": 6}, "written", "6"),
    ("proc_write", {"written": 6}, "written", True),
    ("proc_write", {"written": 6}, "closed", "yes"),
    ("attach_write", {"written": 6}, "written", MISSING),
    ("tcp_write", {"written": 6}, "written", 1.5),
    ("attach_read", examples("result.attach_read")[0], "done", MISSING),
    ("attach_read", examples("result.attach_read")[0], "stdout", 5),
    ("tcp_read", examples("result.tcp_read")[0], "eof", MISSING),
    ("tcp_read", examples("result.tcp_read")[0], "data", "%%"),
    ("volume_begin", {"current": False}, "current", "false"),
    ("volume_begin", {"current": False}, "current", MISSING),
]


@pytest.mark.parametrize(
    ("op", "body", "path", "value"), REFUSED, ids=[f"{op}-{path}-{str(v)[:16]}" for op, _, path, v in REFUSED]
)
def test_an_answer_that_breaks_the_schema_is_refused(
    op: str, body: Mapping[str, Any], path: str, value: object
) -> None:
    bad = _changed(body, path, value)
    assert valid(f"result.{op}", body)
    assert not valid(f"result.{op}", bad), "the schema takes it"
    with pytest.raises(ProtocolError):
        _read(op, bad)


ENVELOPE_REFUSED: list[tuple[str, str, object]] = [
    ("hello", "v", agent_protocol.VERSION + 1),
    ("hello", "v", 0),
    ("hello", "v", "6"),
    ("hello", "type", MISSING),
    ("hello", "body", MISSING),
    ("hello", "body/vcpus", 0),
    ("response", "id", 7),
    ("response", "id", MISSING),
    ("response", "ok", "true"),
    ("response", "code", "c" * 65),
]


@pytest.mark.parametrize(("name", "path", "value"), ENVELOPE_REFUSED)
def test_a_message_that_breaks_the_schema_is_refused(name: str, path: str, value: object) -> None:
    message = examples(name)[0] if name == "hello" else examples(name)[1]
    bad = _changed(message, path, value)
    assert not valid("guestMessage", bad)
    with pytest.raises(ProtocolError):
        decode(json.dumps(bad).encode())


def test_a_response_without_its_body_or_error_is_refused() -> None:
    for message, drop in [(examples("response")[0], "body"), (examples("response")[1], "error")]:
        bad = _changed(message, drop, MISSING)
        assert not valid("guestMessage", bad)
        with pytest.raises(ProtocolError):
            decode(json.dumps(bad).encode())


# ---- generated answers: the schema and the host's readers agree on each -------------------------------


def _near(*bounds: int) -> st.SearchStrategy[int]:
    return st.sampled_from(sorted({b + d for b in bounds for d in (-1, 0, 1)})) | st.integers()


def _text(*lengths: int) -> st.SearchStrategy[str]:
    return st.sampled_from(sorted({n + d for n in lengths for d in (-1, 0, 1)})).map(lambda n: "x" * n) | st.text(
        max_size=8
    )


_ANY: st.SearchStrategy[object] = (
    st.none() | st.booleans() | st.integers() | st.text(max_size=4) | st.lists(st.integers(), max_size=2)
)
_COUNT = _near(0, INT32_MAX, INT64_MAX)


def _field(strategy: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
    """A field's value: mostly from ``strategy`` (values near its bounds), else anything, or absent."""
    return st.one_of(strategy, strategy, _ANY, st.just(MISSING))


def _one_off(
    base: Mapping[str, Any], fields: Mapping[str, st.SearchStrategy[Any]]
) -> st.SearchStrategy[dict[str, Any]]:
    """``base`` (a valid body) with one or two of ``fields`` changed or left out: where the schema and
    a reader disagree on one field, the others do not hide it."""

    def change(changes: dict[str, object]) -> dict[str, Any]:
        out = copy.deepcopy(dict(base))
        for key, value in changes.items():
            if value is MISSING:
                out.pop(key, None)
            else:
                out[key] = value
        return out

    keys = st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=2, unique=True)
    return keys.flatmap(lambda ks: st.fixed_dictionaries({k: _field(fields[k]) for k in ks})).map(change)


_NIC = _one_off(REPORT_BODY["nics"][0], {
    "name": _text(64),
    "mac": _text(64),
    "addresses": st.lists(_text(64), max_size=66) | st.lists(_ANY, max_size=2),
    "up": st.booleans(),
})  # fmt: skip
_POOL = _one_off({"total": 8, "free": 8}, {"total": _COUNT, "free": _COUNT})
_REPORTS = _one_off(REPORT_BODY, {
    "agent": _text(256),
    "kernel": _text(256),
    "vcpus": _COUNT,
    "mem_total_kib": _COUNT,
    "hugepages": st.dictionaries(
        st.from_regex(r"\A0*[0-9]{1,11}\Z") | st.text(max_size=3), _POOL | _ANY, max_size=3
    ) | st.dictionaries(st.integers(1, 1 << 20).map(str), _POOL, min_size=63, max_size=66),
    "cmdline": _text(4096),
    "boot_ms": _COUNT,
    "errors": st.lists(_text(1024), max_size=3) | st.lists(st.just("e"), min_size=63, max_size=66),
    "protocol": _COUNT,
    "hostname": _text(256),
    "nics": st.lists(_NIC, max_size=3) | st.lists(st.just(REPORT_BODY["nics"][0]), min_size=63, max_size=66),
    "instance": st.text("0123456789abcdefA", max_size=66),
})  # fmt: skip
_STATES = _one_off(STATE, {
    "id": _text(128),
    "state": st.sampled_from(["created", "running", "exited", "creating", ""]),
    **{k: _COUNT for k in ("pid", "exit_code", "signal", "created_at_ns", "started_at_ns", "finished_at_ns")},
    "oom_killed": st.booleans(),
})  # fmt: skip
_B64 = st.binary(max_size=12).map(lambda b: base64.b64encode(b).decode()) | st.text("AB=+/", max_size=9)
_EXECS = _one_off(
    EXEC, {"exit_code": _COUNT, "stdout": _B64, "stderr": _B64, "timed_out": st.booleans(), "dropped_bytes": _COUNT}
)
_IO = _one_off(STATS["io"][0], {k: _COUNT for k in ("major", "minor", "rbytes", "wbytes", "rios", "wios")})
_STATS = _one_off(STATS, {
    # agent_rss_bytes is the bench's, not read by the host's stats reader
    **{k: _COUNT for k, v in DEFS["result.stats"]["properties"].items() if "$ref" in v and k != "agent_rss_bytes"},
    "io": st.lists(_IO, max_size=3) | st.lists(st.just(STATS["io"][0]), min_size=31, max_size=34),
    "hugetlb": st.dictionaries(st.from_regex(r"\A[0-9]{1,7}[KMGk]B\Z") | st.text(max_size=3), _COUNT, max_size=9),
})  # fmt: skip


def _agree(op: str, body: dict[str, object]) -> None:
    accepted = True
    try:
        _read(op, body)
    except ProtocolError:
        accepted = False
    assert accepted == valid(f"result.{op}", body), (problems(f"result.{op}", body), body)


@settings(max_examples=300, deadline=None)
@given(_REPORTS)
def test_the_report_reader_takes_exactly_what_the_schema_does(body: dict[str, object]) -> None:
    _agree("report", body)


@settings(max_examples=200, deadline=None)
@given(_STATES)
def test_the_container_state_reader_takes_exactly_what_the_schema_does(body: dict[str, object]) -> None:
    _agree("status", body)


@settings(max_examples=200, deadline=None)
@given(_EXECS)
def test_the_exec_reader_takes_exactly_what_the_schema_does(body: dict[str, object]) -> None:
    _agree("exec", body)


@settings(max_examples=200, deadline=None)
@given(_STATS)
def test_the_stats_reader_takes_exactly_what_the_schema_does(body: dict[str, object]) -> None:
    _agree("stats", body)


# ---- generated requests: valid for their op whatever the shim passes --------------------------------

_CIDS = st.from_regex(r"\A[0-9a-f]{64}\Z")
_ARGV = st.lists(st.text(max_size=20), min_size=1, max_size=5)
_TIMEOUT = st.floats(min_value=0, max_value=3600, allow_nan=False)


@settings(max_examples=100, deadline=None)
@given(
    cid=_CIDS,
    argv=_ARGV,
    timeout=_TIMEOUT,
    data=st.binary(max_size=agent_ops.STREAM_WRITE_MAX),
    tty=st.booleans(),
    stdin=st.booleans(),
    size=st.tuples(st.integers(1, 65535), st.integers(1, 65535)),
    port=st.integers(1, 65535),
    offset=st.integers(0, INT64_MAX),
    max_bytes=st.integers(1, agent_ops.STREAM_READ_MAX),
)
def test_generated_requests_are_valid_for_their_op(
    cid: str,
    argv: list[str],
    timeout: float,
    data: bytes,
    tty: bool,
    stdin: bool,
    size: tuple[int, int],
    port: int,
    offset: int,
    max_bytes: int,
) -> None:
    rows, cols = size

    def answers(request: Request) -> Mapping[str, object]:
        if request.op in ("proc_write", "attach_write", "tcp_write"):
            return {"written": len(data)}
        return _example_answer(request)

    client, conn = recording_client(answers)
    with client:
        client.create(cid, lower="disks/i0c0ffee", spec={"process": {"args": argv}}, stdin=stdin, tty=tty)
        client.exec(cid, argv, timeout_s=timeout)
        client.wait(cid, timeout)
        client.log_read(cid, offset, max_bytes, timeout)
        proc = agent_streams.proc_start(client, cid, argv, tty=tty, stdin=stdin, rows=rows, cols=cols)
        proc.read(max_bytes, timeout)
        proc.write_some(data, timeout)
        proc.resize(rows, cols)
        attach = agent_streams.AgentStream(client, agent_ops.ATTACH, "7")
        attach.write_some(data, timeout)
        attach.resize(rows, cols)
        agent_streams.tcp_connect(client, port).write_some(data, timeout)
    for request in sent(conn):
        assert problems("hostMessage", request, closed=True) == [], request


@settings(max_examples=60, deadline=None)
@given(
    st.dictionaries(
        st.from_regex(r"\A[a-z][a-z0-9._-]{0,20}(/[a-z][a-z0-9._-]{0,20}){0,3}\Z"), st.binary(max_size=2000), min_size=1
    ),
    st.integers(min_value=1, max_value=4096),
)
def test_volume_batches_are_valid_requests(files: dict[str, bytes], chunk: int) -> None:
    paths = sorted(files)
    files = {p: d for p, d in files.items() if not any(q.startswith(p + "/") for q in paths)}
    meta = kubelet_volumes.Meta(0o644, 1000, 2000)
    dirs = sorted({"/".join(p.split("/")[:i]) for p in files for i in range(1, p.count("/") + 1)})
    entries = [kubelet_volumes.Entry(d, "dir", kubelet_volumes.Meta(0o2755, 0, 2000)) for d in dirs]
    entries += [kubelet_volumes.Entry(p, "file", meta, data) for p, data in sorted(files.items())]
    tree = kubelet_volumes.VolumeTree("..v1", meta, meta, tuple(entries))
    client, conn = recording_client()
    with client:
        for batch in kubelet_volumes.write_batches(VOLUME, tree, chunk):
            client.volume_write(batch)
        client.volume_commit(kubelet_volumes.commit_args(VOLUME, tree))
    for request in sent(conn):
        assert problems("hostMessage", request, closed=True) == [], request
