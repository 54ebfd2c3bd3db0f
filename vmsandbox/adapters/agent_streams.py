"""``AgentStream``: the host's handle on one stream session in a guest agent, a streamed process
(the CRI's streaming Exec), an attach session on a container's own stdio (Attach) or a TCP
connection from the guest to its own loopback (PortForward into a host-network pod).

The three kinds have the same ops under their own names (``vmsandbox.agent_ops.StreamKind``); a
handle knows its kind and its id, and is bound to the ``AgentClient`` connection that opened it:
the id means nothing to another connection, as the agent releases a host's sessions when it
leaves. ``proc_start``, ``attach_open`` and ``tcp_connect`` open one.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from typing import Protocol

from vmsandbox.adapters.agent_client import RESPONSE_SLACK_S
from vmsandbox.agent_ops import (
    ATTACH,
    PROC,
    STREAM_WRITE_MAX,
    TCP,
    StreamKind,
    StreamOutput,
    stream_id_from_body,
    stream_output_from_body,
    written_from_body,
)
from vmsandbox.errors import InvalidArgument

_OP_TIMEOUT_S = 30.0
"""How long an op that does not wait in the guest may take."""


class AgentRequests(Protocol):
    """What a handle needs of its connection (``vmsandbox.adapters.agent_client.AgentClient``)."""

    label: str

    def request(self, op: str, args: Mapping[str, object], timeout_s: float) -> Mapping[str, object]: ...


class AgentStream:
    """One stream session in the guest, read and written through the connection that opened it."""

    def __init__(self, client: AgentRequests, kind: StreamKind, sid: str) -> None:
        self.client = client
        self.kind = kind
        self.id = sid

    @classmethod
    def open(cls, client: AgentRequests, kind: StreamKind, args: dict[str, object], timeout_s: float) -> AgentStream:
        body = client.request(kind.open_op, args, timeout_s)
        return cls(client, kind, stream_id_from_body(kind, body, f"{client.label}: {kind.open_op} response"))

    def _args(self, **more: object) -> dict[str, object]:
        return {self.kind.id_field: self.id, **more}

    def read(self, max_bytes: int, timeout_s: float) -> StreamOutput:
        """Output waiting in the guest: a long poll that answers early once there is some, or the
        session finished."""
        op = self.kind.read_op
        args = self._args(max_bytes=max_bytes, timeout_ms=int(timeout_s * 1000))
        body = self.client.request(op, args, timeout_s + RESPONSE_SLACK_S)
        return stream_output_from_body(self.kind, body, f"{self.client.label}: {op} response", max_bytes)

    def write_some(self, data: bytes, timeout_s: float = 10) -> tuple[int, bool]:
        """(bytes written, input closed for good) for one piece of at most ``STREAM_WRITE_MAX``
        bytes; fewer than given when the reader did not take them within ``timeout_s``."""
        op = self.kind.write_op
        args = self._args(data=base64.b64encode(data).decode(), timeout_ms=int(timeout_s * 1000))
        body = self.client.request(op, args, timeout_s + RESPONSE_SLACK_S)
        return written_from_body(body, len(data), f"{self.client.label}: {op} response")

    def write(self, data: bytes) -> bool:
        """Writes all of ``data`` in pieces, waiting while the reader does not take them; False
        once the input is closed for good."""
        view = memoryview(data)
        while view:
            n, closed = self.write_some(bytes(view[:STREAM_WRITE_MAX]))
            if closed:
                return False
            view = view[n:]
        return True

    def close_input(self) -> None:
        """The end of the host's input: a pipe closed, ^D on a terminal, a TCP half-close."""
        self.client.request(self.kind.close_input_op, self._args(), _OP_TIMEOUT_S)

    def resize(self, rows: int, cols: int) -> None:
        """Sets the size of the session's terminal; a kind without one is refused here, one
        without a terminal by the guest."""
        if self.kind.resize_op is None:
            raise InvalidArgument(f"{self.kind.open_op}: a session of this kind has no terminal to resize")
        self.client.request(self.kind.resize_op, self._args(rows=rows, cols=cols), _OP_TIMEOUT_S)

    def release(self) -> None:
        """The host is done: the guest lets go of the session (a process gets SIGHUP or EOF, then
        SIGKILL after a grace) and forgets its id. Releasing twice is no error."""
        self.client.request(self.kind.release_op, self._args(), _OP_TIMEOUT_S)


def proc_start(
    client: AgentRequests, cid: str, argv: Sequence[str], *, tty: bool, stdin: bool, rows: int = 0, cols: int = 0
) -> AgentStream:
    """Starts ``argv`` in running container ``cid`` with pipes or a terminal (of ``rows`` x ``cols``, 0: unset)."""
    args: dict[str, object] = {"id": cid, "argv": list(argv), "tty": tty, "stdin": stdin, "rows": rows, "cols": cols}
    return AgentStream.open(client, PROC, args, 60)


def attach_open(client: AgentRequests, cid: str) -> AgentStream:
    """A session on running container ``cid``'s own stdio."""
    return AgentStream.open(client, ATTACH, {"id": cid}, _OP_TIMEOUT_S)


def tcp_connect(client: AgentRequests, port: int) -> AgentStream:
    """A connection from the guest to its own loopback ``port``."""
    return AgentStream.open(client, TCP, {"port": port}, _OP_TIMEOUT_S)
