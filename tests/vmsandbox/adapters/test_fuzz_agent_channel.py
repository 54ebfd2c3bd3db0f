"""Hostile guests fed to the real host side of the agent channel.

Each example is a stream a guest could write: random bytes, lines longer than the limit, deep
nesting, messages with fields of the wrong type, numbers far too large, responses to ids nobody
asked for, hellos of any instance, floods of unsolicited messages. The stream goes through a
socketpair to the real reader (``guest_channel._Connection`` under ``AgentClient``) while the host
sends a request, which the guest then answers properly. Asserted: the request either gets an answer
(the good frame after the garbage was handled) or fails with one of the typed errors and the
connection is closed; nothing else escapes; the reader never buffers more than the line limit; and
every line, given to the real decoder and body parsers, raises nothing but ProtocolError.

The line limit is lowered to 4 KiB here so that over-long lines are cheap to make (the real limit
is tested in tests/vmsandbox/test_agent_bounds.py). ``VMSANDBOX_FUZZ_EXAMPLES`` sets the examples
(default 150), ``VMSANDBOX_FUZZ_LONG=1`` runs 2,500.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
from collections.abc import Iterator
from unittest import mock

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests import fake_guest as fg
from vmsandbox.adapters import guest_channel
from vmsandbox.adapters.agent_client import AgentClient, AgentLost
from vmsandbox.adapters.guest_channel import GuestChannel, GuestChannelClosed, GuestRequestFailed, _Connection
from vmsandbox.agent_ops import container_state_from_body, exec_result_from_body, stats_from_body
from vmsandbox.agent_protocol import ProtocolError, Response, decode, report_from_body

EXAMPLES = 2500 if os.environ.get("VMSANDBOX_FUZZ_LONG") else int(os.environ.get("VMSANDBOX_FUZZ_EXAMPLES", "150"))
LIMIT = 4096
TYPED = (ProtocolError, AgentLost, GuestChannelClosed, GuestRequestFailed)

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=False),
    st.text(max_size=40),
)
_json = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)
_ids = st.one_of(st.none(), st.sampled_from(["0", "1", "2"]), st.text(max_size=8), st.integers())


def _dumps(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


@st.composite
def _message(draw: st.DrawFn) -> bytes:
    """A message-shaped line with fields drawn from anywhere."""
    kind = draw(st.sampled_from(["response", "hello", "ack", "request", "bye", 7, None]))
    msg: dict[str, object] = {"v": draw(st.sampled_from([1, 2, 2, 3, "2", None])), "type": kind}
    if kind == "response":
        msg["id"] = draw(_ids)
        msg["ok"] = draw(st.one_of(st.booleans(), _scalars))
        if draw(st.booleans()):
            body = draw(
                st.one_of(
                    st.just(fg.state("c")),
                    st.just(fg.report_body()),
                    st.dictionaries(st.text(max_size=12), _json, max_size=6),
                )
            )
            if isinstance(body, dict) and body and draw(st.booleans()):
                body = {**body, draw(st.sampled_from(sorted(body))): draw(_json)}  # one field of the wrong kind
            msg["body"] = body
        else:
            msg["error"] = draw(st.one_of(st.text(max_size=60), _scalars))
            if draw(st.booleans()):
                msg["code"] = draw(st.one_of(st.just("unknown_container"), _scalars))
    elif kind == "hello":
        instance = draw(st.sampled_from([fg.INSTANCE, fg.OTHER_INSTANCE, "", "nothex"]))
        msg["body"] = draw(st.one_of(st.just(fg.report_body(instance)), _json))
    return _dumps(msg)


_garbage_line = st.one_of(
    st.binary(max_size=300),
    _message(),
    st.integers(0, 3000).map(lambda n: b"[" * n + b"]" * (n // 2) + b"\n"),
    st.integers(0, 3000).map(lambda n: b'{"a":' * n + b"\n"),
    st.integers(1, 6000).map(lambda n: b'{"v":2,"type":"ack","n":' + b"7" * n + b"}\n"),
    st.integers(LIMIT - 8, LIMIT * 3).map(lambda n: b"x" * n + b"\n"),
    st.integers(0, 60).map(lambda n: b"".join(fg.ok(f"u{i}", {}) for i in range(n))),
    st.integers(0, 60).map(lambda n: fg.hello() * n),
    st.just(fg.hello(fg.OTHER_INSTANCE)),
)


_benign_line = st.one_of(
    st.text(max_size=8).map(lambda rid: fg.ok(f"late-{rid}", {})),  # answers to requests that timed out
    st.just(fg.hello()),  # a hello that crossed the host's ack
    st.text(max_size=30).map(lambda e: fg.refused(None, e)),  # the agent could not read something
)


def _guest(sock: socket.socket, garbage: bytes) -> None:
    """Write the garbage, then answer the host's requests properly until it hangs up."""
    with contextlib.suppress(OSError):
        sock.sendall(garbage)
        with sock.makefile("rb") as f:
            for raw in f:
                with contextlib.suppress(ValueError):
                    msg = json.loads(raw)
                    if isinstance(msg, dict) and msg.get("type") == "request":
                        sock.sendall(fg.ok(msg.get("id"), {}))


@contextlib.contextmanager
def _thread_errors() -> Iterator[list[BaseException]]:
    """Exceptions that end a thread uncaught (the reader's, the guest's) while the block runs."""
    seen: list[BaseException] = []
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_value is not None:
            seen.append(args.exc_value)

    threading.excepthook = hook
    try:
        yield seen
    finally:
        threading.excepthook = previous


def _parse_everything(data: bytes) -> None:
    """Every line through the real decoder and every body parser: ProtocolError or a value."""
    for raw in data.split(b"\n"):
        try:
            msg = decode(raw)
        except ProtocolError:
            continue
        if isinstance(msg, Response) and msg.ok:
            for parse in (container_state_from_body, exec_result_from_body, stats_from_body, report_from_body):
                with contextlib.suppress(ProtocolError):
                    parse(msg.body)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(lines=st.one_of(st.lists(_garbage_line, max_size=6), st.lists(_benign_line, max_size=12)), tail=st.booleans())
def test_hostile_guest_streams_meet_only_typed_errors(lines: list[bytes], tail: bool) -> None:
    garbage = b"".join(lines)
    if tail:
        garbage += b'{"v":2,"type":"resp'  # a line left unfinished: the good answer lands in it
    _parse_everything(garbage)
    host, guest = socket.socketpair()
    lost: list[str] = []
    feeder = threading.Thread(target=_guest, args=(guest, garbage), daemon=True)
    with mock.patch.object(guest_channel, "MAX_FRAME_BYTES", LIMIT), _thread_errors() as uncaught:
        conn = _Connection(host, "fuzz", "sandbox fuzz")
        report = report_from_body(fg.report_body())
        client = AgentClient(GuestChannel(conn, report), on_lost=lost.append)
        feeder.start()
        try:
            body = client.request("ping", {}, 10)
            assert isinstance(body, dict)
            event("answered")
        except TYPED as exc:
            event(type(exc).__name__)
            assert str(exc).startswith(("no response", "'ping' not sent", "sandbox fuzz"))
            assert len(str(exc)) < 4096
            if not isinstance(exc, GuestRequestFailed):
                assert client.closed
        finally:
            assert conn.buffered <= LIMIT + 1
            client.close()
            guest.close()
            feeder.join(timeout=10)
    assert not feeder.is_alive()
    assert not uncaught, f"a thread died of {uncaught[0]!r}"


def test_a_good_frame_after_garbage_lines_is_answered() -> None:
    """Garbage the reader can skip (unsolicited, within budget) leaves the connection usable."""
    host, guest = socket.socketpair()
    garbage = fg.ok("nobody", {}) + fg.hello() + fg.ok(None, {"x": 1})
    feeder = threading.Thread(target=_guest, args=(guest, garbage), daemon=True)
    client = AgentClient(GuestChannel(_Connection(host, "fuzz", "sandbox fuzz"), report_from_body(fg.report_body())))
    feeder.start()
    try:
        assert client.request("ping", {}, 10) == {}
        assert not client.closed
    finally:
        client.close()
        guest.close()
        feeder.join(timeout=10)
