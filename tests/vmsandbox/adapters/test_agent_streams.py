"""vmsandbox.adapters.agent_streams: one handle for the three kinds of stream session sends each
kind's own wire messages (images/README.md's op table) and reads each kind's answers, refusing
answers an untrusted guest got wrong."""

from __future__ import annotations

import base64
from collections.abc import Callable, Mapping

import pytest

from vmsandbox.adapters import agent_streams
from vmsandbox.adapters.agent_client import RESPONSE_SLACK_S
from vmsandbox.adapters.agent_streams import AgentStream
from vmsandbox.agent_ops import ATTACH, PROC, STREAM_WRITE_MAX, TCP, StreamKind, StreamOutput
from vmsandbox.agent_protocol import ProtocolError
from vmsandbox.errors import InvalidArgument


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


class FakeAgent:
    """Answers each request with the next body of ``answers`` and records what was sent."""

    label = "sandbox 0123456789ab"

    def __init__(self, *answers: Mapping[str, object]) -> None:
        self.answers = list(answers)
        self.sent: list[tuple[str, dict[str, object], float]] = []

    def request(self, op: str, args: Mapping[str, object], timeout_s: float) -> Mapping[str, object]:
        self.sent.append((op, dict(args), timeout_s))
        return self.answers.pop(0) if self.answers else {}


OPENS: list[tuple[str, Callable[[FakeAgent], AgentStream], str, dict[str, object], Mapping[str, object]]] = [
    (
        "proc",
        lambda a: agent_streams.proc_start(a, "c1", ["sh", "-c", "true"], tty=True, stdin=False, rows=24, cols=80),
        "proc_start",
        {"id": "c1", "argv": ["sh", "-c", "true"], "tty": True, "stdin": False, "rows": 24, "cols": 80},
        {"proc": "7"},
    ),
    ("attach", lambda a: agent_streams.attach_open(a, "c1"), "attach_open", {"id": "c1"}, {"attach": "7"}),
    ("tcp", lambda a: agent_streams.tcp_connect(a, 8080), "tcp_connect", {"port": 8080}, {"conn": "7"}),
]


@pytest.mark.parametrize(("opener", "op", "args", "answer"), [o[1:] for o in OPENS], ids=[o[0] for o in OPENS])
def test_each_kind_opens_with_its_op_and_reads_its_id_field(
    opener: Callable[[FakeAgent], AgentStream], op: str, args: dict[str, object], answer: Mapping[str, object]
) -> None:
    agent = FakeAgent(answer)
    stream = opener(agent)
    assert stream.id == "7"
    assert [(o, a) for o, a, _ in agent.sent] == [(op, args)]


# (kind, what the handle does, the request it sends, the answer, what the handle returns)
CALLS: list[
    tuple[StreamKind, Callable[[AgentStream], object], tuple[str, dict[str, object]], Mapping[str, object], object]
] = [
    (
        PROC,
        lambda s: s.read(1024, 5),
        ("proc_read", {"proc": "7", "max_bytes": 1024, "timeout_ms": 5000}),
        {"stdout": b64(b"out"), "stderr": b64(b"err"), "done": True, "exit_code": 3},
        StreamOutput(b"out", b"err", True, 3),
    ),
    (
        ATTACH,
        lambda s: s.read(1024, 5),
        ("attach_read", {"attach": "7", "max_bytes": 1024, "timeout_ms": 5000}),
        {"stdout": b64(b"out"), "stderr": None, "done": False, "dropped_bytes": 0},
        StreamOutput(b"out", b"", False, None),
    ),
    (
        ATTACH,
        lambda s: s.read(1024, 5),
        ("attach_read", {"attach": "7", "max_bytes": 1024, "timeout_ms": 5000}),
        {"stdout": "", "stderr": "", "done": True, "dropped_bytes": 10},
        StreamOutput(b"", b"", True, 0),
    ),
    (
        TCP,
        lambda s: s.read(1024, 5),
        ("tcp_read", {"conn": "7", "max_bytes": 1024, "timeout_ms": 5000}),
        {"data": b64(b"reply"), "eof": True},
        StreamOutput(b"reply", b"", True, 0),
    ),
    (
        PROC,
        lambda s: s.write_some(b"hi", 2),
        ("proc_write", {"proc": "7", "data": b64(b"hi"), "timeout_ms": 2000}),
        {"written": 2},
        (2, False),
    ),
    (
        ATTACH,
        lambda s: s.write_some(b"hi", 2),
        ("attach_write", {"attach": "7", "data": b64(b"hi"), "timeout_ms": 2000}),
        {"written": 0, "closed": True},
        (0, True),
    ),
    (
        TCP,
        lambda s: s.write_some(b"hi", 2),
        ("tcp_write", {"conn": "7", "data": b64(b"hi"), "timeout_ms": 2000}),
        {"written": 1},
        (1, False),
    ),
    (PROC, lambda s: s.close_input(), ("proc_close_stdin", {"proc": "7"}), {}, None),
    (ATTACH, lambda s: s.close_input(), ("attach_close_stdin", {"attach": "7"}), {}, None),
    (TCP, lambda s: s.close_input(), ("tcp_close_write", {"conn": "7"}), {}, None),
    (PROC, lambda s: s.resize(30, 100), ("proc_resize", {"proc": "7", "rows": 30, "cols": 100}), {}, None),
    (ATTACH, lambda s: s.resize(30, 100), ("attach_resize", {"attach": "7", "rows": 30, "cols": 100}), {}, None),
    (PROC, lambda s: s.release(), ("proc_release", {"proc": "7"}), {}, None),
    (ATTACH, lambda s: s.release(), ("attach_release", {"attach": "7"}), {}, None),
    (TCP, lambda s: s.release(), ("tcp_close", {"conn": "7"}), {}, None),
]


@pytest.mark.parametrize(
    ("kind", "call", "sent", "answer", "result"), CALLS, ids=[f"{c[0].open_op}-{c[2][0]}" for c in CALLS]
)
def test_each_op_sends_the_kinds_message_and_reads_its_answer(
    kind: StreamKind,
    call: Callable[[AgentStream], object],
    sent: tuple[str, dict[str, object]],
    answer: Mapping[str, object],
    result: object,
) -> None:
    agent = FakeAgent(answer)
    assert call(AgentStream(agent, kind, "7")) == result
    assert [(o, a) for o, a, _ in agent.sent] == [sent]


def test_a_long_poll_gets_the_round_trip_over_its_own_wait() -> None:
    agent = FakeAgent({"data": "", "eof": False})
    AgentStream(agent, TCP, "7").read(1024, 5)
    assert agent.sent[0][2] == 5 + RESPONSE_SLACK_S


def test_write_sends_all_in_pieces_until_the_input_closes() -> None:
    data = bytes(range(256)) * (STREAM_WRITE_MAX // 128 + 1)  # two pieces and a bit
    half = STREAM_WRITE_MAX // 2
    agent = FakeAgent({"written": half}, {"written": half}, {"written": 0, "closed": True})
    assert AgentStream(agent, PROC, "7").write(data) is False
    pieces = [base64.b64decode(str(args["data"])) for _, args, _ in agent.sent]
    assert pieces == [data[i : i + STREAM_WRITE_MAX] for i in (0, half, 2 * half)]  # each from where the last was taken

    agent = FakeAgent({"written": STREAM_WRITE_MAX}, {"written": STREAM_WRITE_MAX}, {"written": 256})
    assert AgentStream(agent, TCP, "7").write(data) is True
    assert [len(base64.b64decode(str(a["data"]))) for _, a, _ in agent.sent] == [
        STREAM_WRITE_MAX,
        STREAM_WRITE_MAX,
        256,
    ]


def test_a_forwarded_connection_has_no_terminal() -> None:
    agent = FakeAgent()
    with pytest.raises(InvalidArgument, match="no terminal"):
        AgentStream(agent, TCP, "7").resize(30, 100)
    assert agent.sent == []


@pytest.mark.parametrize(
    ("kind", "answer", "error"),
    [
        (PROC, {"stdout": "", "stderr": ""}, "missing field 'done'"),
        (PROC, {"stdout": "", "stderr": "", "done": True}, "missing field 'exit_code'"),
        (PROC, {"stdout": b64(b"x" * 600), "stderr": b64(b"x" * 600), "done": False}, "1200 bytes of output"),
        (ATTACH, {"stdout": 5, "done": False}, "field 'stdout' must be base64 text"),
        (TCP, {"data": "", "done": True}, "missing field 'eof'"),
        (TCP, {"data": "!!", "eof": False}, "field 'data' is not base64"),
    ],
)
def test_a_read_answer_the_guest_got_wrong_is_refused(
    kind: StreamKind, answer: Mapping[str, object], error: str
) -> None:
    with pytest.raises(ProtocolError, match=error):
        AgentStream(FakeAgent(answer), kind, "7").read(1024, 1)


@pytest.mark.parametrize("written", [-1, 3, "2", True, None])
def test_a_write_answer_counting_other_than_the_bytes_sent_is_refused(written: object) -> None:
    with pytest.raises(ProtocolError, match="'written' must"):
        AgentStream(FakeAgent({"written": written}), ATTACH, "7").write_some(b"hi")


@pytest.mark.parametrize(
    ("kind", "answer"), [(PROC, {"proc": "x1"}), (ATTACH, {"proc": "1"}), (TCP, {"conn": "1" * 21})]
)
def test_an_open_answer_without_a_good_id_is_refused(kind: StreamKind, answer: Mapping[str, object]) -> None:
    with pytest.raises(ProtocolError, match=kind.id_field):
        AgentStream.open(FakeAgent(answer), kind, {}, 5)
