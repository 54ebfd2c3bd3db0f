"""The Kubernetes streaming protocols' rules, no IO: what an Exec/Attach/PortForward request may
ask, which subprotocol a client gets, what the error stream carries, and the WebSocket channel
framing of remotecommand and port-forward (kubelet ``pkg/cri/streaming``, client-go
``tools/remotecommand`` and ``tools/portforward`` are the other ends).
"""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from vmsandbox.errors import InvalidArgument

# remotecommand subprotocols, best first (the server picks the first of its own list the client offers)
V5 = "v5.channel.k8s.io"
V4 = "v4.channel.k8s.io"
V3 = "v3.channel.k8s.io"
V2 = "v2.channel.k8s.io"
V1 = "channel.k8s.io"
REMOTECOMMAND_PROTOCOLS = (V5, V4, V3, V2, V1)
WS_REMOTECOMMAND_PROTOCOLS = (V5, V4, "v4.base64.channel.k8s.io", V3, V2, V1, "base64.channel.k8s.io")
PORTFORWARD_PROTOCOL = "portforward.k8s.io"
WS_PORTFORWARD_PROTOCOLS = (PORTFORWARD_PROTOCOL, "v4.channel.k8s.io", "v4.base64.channel.k8s.io")
"""Plain WebSocket port-forward (channel pairs): portforward.k8s.io and the kubelet's two,
v4.channel.k8s.io (binary, what the kubernetes Python client offers) and v4.base64.channel.k8s.io
(text messages: the channel as an ASCII digit, then the data in base64)."""
SPDY_OVER_WEBSOCKET_PREFIX = "SPDY/3.1+"
"""client-go tunnels SPDY port-forward inside a WebSocket with this subprotocol prefix."""

# stream types (the ``streamType`` header over SPDY) and their WebSocket channels
STDIN, STDOUT, STDERR, ERROR, RESIZE = "stdin", "stdout", "stderr", "error", "resize"
DATA = "data"
WS_CHANNELS = {STDIN: 0, STDOUT: 1, STDERR: 2, ERROR: 3, RESIZE: 4}
WS_CLOSE_CHANNEL = 255
"""v5: a message ``[255, channel]`` from the client closes that channel (stdin's EOF)."""

MAX_COMMAND_ARGS = 4096
MAX_COMMAND_BYTES = 1 << 20


@dataclass(frozen=True)
class StreamRequest:
    """What an Exec or Attach asked for (checked)."""

    container_id: str
    cmd: tuple[str, ...]  # empty for Attach
    tty: bool
    stdin: bool
    stdout: bool
    stderr: bool


def check_stream_request(
    kind: str, container_id: str, cmd: Sequence[str], *, tty: bool, stdin: bool, stdout: bool, stderr: bool
) -> StreamRequest:
    """The kubelet's and containerd's rules: at least one stream; a terminal merges stderr into
    stdout, so tty with stderr is refused; Exec needs a command."""
    if not (stdin or stdout or stderr):
        raise InvalidArgument(f"{kind}: one of stdin, stdout or stderr must be requested")
    if tty and stderr:
        raise InvalidArgument(f"{kind}: tty and stderr cannot both be true (a terminal has one output stream)")
    if kind == "Exec":
        if not cmd:
            raise InvalidArgument("Exec: cmd is empty")
        if len(cmd) > MAX_COMMAND_ARGS or sum(len(a.encode()) for a in cmd) > MAX_COMMAND_BYTES:
            raise InvalidArgument(f"Exec: cmd over {MAX_COMMAND_ARGS} arguments or {MAX_COMMAND_BYTES} bytes")
        if any("\0" in a for a in cmd):
            raise InvalidArgument("Exec: cmd holds a NUL character")
    return StreamRequest(container_id, tuple(cmd), tty, stdin, stdout, stderr)


def negotiate(offered: Iterable[str], supported: Sequence[str]) -> str | None:
    """The first of ``supported`` the client offered (None: nothing in common)."""
    have = {p.strip() for p in offered if p.strip()}
    return next((p for p in supported if p in have), None)


def split_header_list(values: Iterable[str]) -> list[str]:
    """Comma-separated header values (``Sec-WebSocket-Protocol``, ``X-Stream-Protocol-Version``)."""
    return [item.strip() for v in values for item in v.split(",") if item.strip()]


def expected_streams(req: StreamRequest, protocol: str) -> frozenset[str]:
    """The SPDY streams a client of ``protocol`` opens for this request (before it sends data)."""
    want = {ERROR}
    for name, on in ((STDIN, req.stdin), (STDOUT, req.stdout), (STDERR, req.stderr and not req.tty)):
        if on:
            want.add(name)
    if req.tty and protocol in (V5, V4, V3):
        want.add(RESIZE)
    return frozenset(want)


def exit_status(code: int, message: str = "") -> bytes:
    """What the v4/v5 error stream carries when the command finished: a ``metav1.Status``
    (Success for exit 0; else NonZeroExitCode with the code as the ``ExitCode`` cause)."""
    if code == 0 and not message:
        doc: dict[str, object] = {"metadata": {}, "status": "Success"}
    elif message:
        doc = {"metadata": {}, "status": "Failure", "message": message[:1024], "reason": "InternalError"}
    else:
        doc = {
            "metadata": {},
            "status": "Failure",
            "message": f"command terminated with non-zero exit code: exit status {code}",
            "reason": "NonZeroExitCode",
            "details": {"causes": [{"reason": "ExitCode", "message": str(code)}]},
        }
    return json.dumps(doc, separators=(",", ":")).encode()


def error_stream_payload(protocol: str, code: int, message: str = "") -> bytes:
    """v4/v5 send a Status document; older protocols send text, nothing on success."""
    if protocol in (V5, V4) or protocol.startswith("v4.") or protocol.startswith("v5."):
        return exit_status(code, message)
    if message:
        return message[:1024].encode()
    return b"" if code == 0 else f"command terminated with non-zero exit code: exit status {code}".encode()


@dataclass(frozen=True)
class TerminalSize:
    width: int
    height: int


def parse_resize(doc: bytes) -> TerminalSize:
    """One JSON ``TerminalSize`` (``{"Width":80,"Height":24}``)."""
    try:
        obj = json.loads(doc)
        w, h = obj["Width"], obj["Height"]
    except (ValueError, KeyError, TypeError):
        raise InvalidArgument(f"resize: not a TerminalSize document: {doc[:80]!r}") from None
    if not (isinstance(w, int) and isinstance(h, int)) or not (0 < w < 65536 and 0 < h < 65536):
        raise InvalidArgument(f"resize: bad size {w!r}x{h!r}")
    return TerminalSize(w, h)


class ResizeSplitter:
    """The resize stream is a sequence of JSON documents with no separator but their own braces;
    bounded: a document over 256 bytes is an error."""

    MAX = 256

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[TerminalSize]:
        self._buf += data
        out: list[TerminalSize] = []
        while True:
            start = self._buf.find(b"{")
            end = self._buf.find(b"}")
            if end < 0:
                if len(self._buf) > self.MAX:
                    raise InvalidArgument("resize: a document over 256 bytes")
                return out
            if start < 0 or start > end:
                raise InvalidArgument("resize: not a TerminalSize document")
            out.append(parse_resize(self._buf[start : end + 1]))
            self._buf = self._buf[end + 1 :]


# ---- WebSocket remotecommand framing ---------------------------------------------------------


def ws_is_base64(protocol: str) -> bool:
    return "base64" in protocol


def ws_encode(protocol: str, channel: int, data: bytes) -> bytes | str:
    """One WebSocket message for ``channel``: binary ``[channel] + data`` or, for the base64
    protocols, text ``'0'+channel`` followed by base64."""
    if ws_is_base64(protocol):
        return chr(ord("0") + channel) + base64.b64encode(data).decode()
    return bytes([channel]) + data


def ws_decode(protocol: str, message: bytes | str) -> tuple[int, bytes]:
    """(channel, data) of one client message."""
    if isinstance(message, str):
        if not ws_is_base64(protocol) or not message:
            raise InvalidArgument("websocket: unexpected text message")
        channel = ord(message[0]) - ord("0")
        try:
            return channel, base64.b64decode(message[1:], validate=True)
        except ValueError:
            raise InvalidArgument("websocket: bad base64 in a message") from None
    if not message:
        raise InvalidArgument("websocket: empty message (no channel byte)")
    return message[0], bytes(message[1:])


# ---- port-forward -----------------------------------------------------------------------------


def parse_port(value: str) -> int:
    """A ``port`` header (or query value): 1..65535."""
    if not value.isdigit() or len(value) > 5 or not 0 < int(value) < 65536:
        raise InvalidArgument(f"port-forward: bad port {value[:20]!r}")
    return int(value)


def ws_port_prefix(port: int) -> bytes:
    """Port-forward over plain WebSocket: each channel's first message starts with the port,
    two bytes little-endian."""
    return struct.pack("<H", port)


def query_ports(query: Mapping[str, Sequence[str]]) -> list[int]:
    return [parse_port(p) for v in query.get("port", ()) for p in v.split(",")]
