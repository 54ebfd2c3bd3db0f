"""The streaming server (``shim.streaming``) over real sockets, without guests: its sessions run
host processes (``LocalProcess`` has the guest process's interface) and forward to a local TCP
server, so refusals, bad frames, caps, vanishing clients and back-pressure are checked fast."""

from __future__ import annotations

import base64
import contextlib
import json
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import websocket

from shim.config import ShimConfig
from shim.streaming.server import StreamingServer, Target
from vmsandbox import spdy, stream_rules
from vmsandbox.agent_ops import StreamOutput
from vmsandbox.errors import InvalidArgument
from vmsandbox.stream_rules import StreamRequest


class LocalProcess:
    """A host process behind the interface the sessions use for a guest one."""

    def __init__(self, argv: list[str]) -> None:
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.lock = threading.Condition()
        self.out: list[bytearray] = [bytearray(), bytearray()]
        self.eof = [False, False]
        self.released = threading.Event()
        for i, f in enumerate((self.p.stdout, self.p.stderr)):
            threading.Thread(target=self._pump, args=(i, f), daemon=True).start()

    def _pump(self, i: int, f: object) -> None:
        assert hasattr(f, "read1")
        while chunk := f.read1(65536):
            with self.lock:
                while len(self.out[i]) > 256 << 10:
                    self.lock.wait()
                self.out[i] += chunk
                self.lock.notify_all()
        with self.lock:
            self.eof[i] = True
            self.lock.notify_all()

    def read(self, max_bytes: int, timeout_s: float) -> StreamOutput:
        with self.lock:
            self.lock.wait_for(lambda: self.out[0] or self.out[1] or all(self.eof), timeout_s)
            o, e = bytes(self.out[0][:max_bytes]), bytes(self.out[1][: max_bytes // 2])
            del self.out[0][: len(o)], self.out[1][: len(e)]
            self.lock.notify_all()
            done = all(self.eof) and not self.out[0] and not self.out[1]
        code = self.p.wait() if done else None
        return StreamOutput(o, e, done, code)

    def write(self, data: bytes) -> bool:
        assert self.p.stdin is not None
        try:
            self.p.stdin.write(data)
            self.p.stdin.flush()
        except BrokenPipeError:
            return False
        return True

    def close_input(self) -> None:
        assert self.p.stdin is not None
        self.p.stdin.close()

    def resize(self, rows: int, cols: int) -> None:
        raise InvalidArgument("resize: the process has no terminal")

    def release(self) -> None:
        self.released.set()
        with contextlib.suppress(ProcessLookupError):
            self.p.kill()
        self.p.wait()


class Backends:
    def __init__(self) -> None:
        self.procs: list[LocalProcess] = []
        self.port = 0

    def start_process(self, req: StreamRequest) -> LocalProcess:
        proc = LocalProcess(list(req.cmd))
        self.procs.append(proc)
        return proc

    def dial(self, sandbox_id: str, port: int) -> socket.socket:
        return socket.create_connection(("127.0.0.1", port), timeout=5)


@pytest.fixture
def server() -> Iterator[tuple[StreamingServer, Backends]]:
    backends = Backends()
    config = replace(ShimConfig(), streaming_max_streams=3, streaming_max_streams_per_pod=2)
    s = StreamingServer(config, backends)
    s.start()
    try:
        yield s, backends
    finally:
        s.stop()


def _exec(s: StreamingServer, cmd: list[str], *, stdin: bool = False, sid: str = "pod1") -> str:
    req = stream_rules.check_stream_request("Exec", "c1", cmd, tty=False, stdin=stdin, stdout=True, stderr=True)
    return s.url(Target("exec", sid, req))


def _raw(url: str, head: bytes) -> bytes:
    host = url.split("/")[2]
    h, p = host.rsplit(":", 1)
    with socket.create_connection((h, int(p)), timeout=10) as sock:
        sock.sendall(head)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
        return out


def _ws(url: str) -> websocket.WebSocket:
    return websocket.create_connection(url.replace("http://", "ws://"), subprotocols=["v5.channel.k8s.io"], timeout=10)


def _drain(ws: websocket.WebSocket) -> tuple[bytes, bytes, dict[str, object]]:
    out, err, status = b"", b"", {}
    while True:
        try:
            op, data = ws.recv_data()
        except websocket.WebSocketConnectionClosedException:
            break
        if op == websocket.ABNF.OPCODE_CLOSE:
            break
        if data[0] == 1:
            out += data[1:]
        elif data[0] == 2:
            err += data[1:]
        elif data[0] == 3:
            status = json.loads(data[1:])
    return out, err, status


def test_unknown_used_and_malformed_requests(server: tuple[StreamingServer, Backends]) -> None:
    s, _ = server
    url = _exec(s, ["true"])
    path = "/" + url.split("/", 3)[3]
    assert _raw(url, f"GET {path}x HTTP/1.1\r\n\r\n".encode()).startswith(b"HTTP/1.1 404")
    assert _raw(url, b"GET /nothing/here HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 404")
    assert _raw(url, b"GET / HTTP/1.1\r\nX: " + b"a" * 20000 + b"\r\n\r\n").startswith(b"HTTP/1.1 431")
    assert _raw(url, b"garbage\r\n\r\n").startswith(b"HTTP/1.1 400")
    # no upgrade asked: refused, and the token is spent
    assert b"expected an upgrade" in _raw(url, f"GET {path} HTTP/1.1\r\n\r\n".encode())
    assert b"unknown, used or expired" in _raw(url, f"GET {path} HTTP/1.1\r\n\r\n".encode())


def test_websocket_exec_with_10_mb_of_stdin(server: tuple[StreamingServer, Backends]) -> None:
    s, backends = server
    ws = _ws(_exec(s, ["sh", "-c", "wc -c; echo err >&2; exit 4"], stdin=True))
    payload = b"z" * (10 << 20)
    for i in range(0, len(payload), 512 << 10):  # the server takes messages up to 1 MiB
        ws.send_binary(b"\x00" + payload[i : i + (512 << 10)])
    ws.send_binary(bytes([255, 0]))
    out, err, status = _drain(ws)
    assert (out.strip(), err) == (str(10 << 20).encode(), b"err\n")
    assert status["details"] == {"causes": [{"reason": "ExitCode", "message": "4"}]}
    assert backends.procs[0].released.wait(5)


def test_a_message_over_the_limit_closes_the_connection(server: tuple[StreamingServer, Backends]) -> None:
    s, backends = server
    ws = _ws(_exec(s, ["cat"], stdin=True))
    with contextlib.suppress(OSError):  # the server may close while the message is still being sent
        ws.send_binary(b"\x00" + b"x" * (2 << 20))
        _drain(ws)
    assert backends.procs[0].released.wait(5)


def test_a_client_that_vanishes_releases_its_process(server: tuple[StreamingServer, Backends]) -> None:
    s, backends = server
    ws = _ws(_exec(s, ["sleep", "60"]))
    time.sleep(0.3)
    assert ws.sock is not None
    ws.sock.close()
    assert backends.procs[0].released.wait(5)
    deadline = time.monotonic() + 5
    while s.live_count() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert s.live_count() == 0


def test_connections_are_capped_per_pod_and_in_all(server: tuple[StreamingServer, Backends]) -> None:
    s, _ = server
    held = [_ws(_exec(s, ["sleep", "30"])) for _ in range(2)]
    time.sleep(0.3)
    url = _exec(s, ["true"])
    with pytest.raises(websocket.WebSocketBadStatusException) as e:
        _ws(url)
    assert e.value.status_code == 429
    other = _ws(_exec(s, ["sleep", "30"], sid="pod2"))  # another pod: room in the total
    with pytest.raises(websocket.WebSocketBadStatusException):
        _ws(_exec(s, ["true"], sid="pod3"))  # the total (3) is reached
    for w in [*held, other]:
        w.close()


def _address(s: StreamingServer) -> tuple[str, int]:
    host, port = s.base_url.split("/")[2].rsplit(":", 1)
    return host, int(port)


def _closed_within(sock: socket.socket, seconds: float) -> bytes | None:
    """What the server sent before it closed ``sock`` within ``seconds``; None if it did not."""
    sock.settimeout(0.05)
    got, deadline = b"", time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(4096)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return got
        if not chunk:
            return got
        got += chunk
    return None


def test_a_client_trickling_its_head_is_cut_at_the_deadline_not_per_read(
    server: tuple[StreamingServer, Backends],
) -> None:
    """A byte every 0.2 s keeps a per-read timeout waiting for ever; the deadline counts from
    the accept to a valid token."""
    s, _ = server
    s.head_deadline_s = 1.0
    path = "/" + _exec(s, ["true"]).split("/", 3)[3]
    head = f"GET {path} HTTP/1.1\r\nUpgrade: websocket\r\n".encode() + b"X-Slow: " + b"a" * 100
    start = time.monotonic()
    with socket.create_connection(_address(s), timeout=5) as sock:
        sock.settimeout(0.2)
        closed = False
        for byte in head:
            try:
                sock.sendall(bytes([byte]))
                if sock.recv(4096) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except OSError:
                closed = True
                break
            closed = True  # it answered (408) and closes
            break
        assert closed, "the trickling client kept its connection"
    assert time.monotonic() - start < 3


def test_connections_before_their_token_are_capped_and_refused_at_once(
    server: tuple[StreamingServer, Backends],
) -> None:
    s, _ = server
    s.max_pending = 4
    idle = [socket.create_connection(_address(s), timeout=5) for _ in range(4)]
    try:
        deadline = time.monotonic() + 5
        while sum(t.name == "streaming-conn" for t in threading.enumerate()) < 4:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with socket.create_connection(_address(s), timeout=5) as fifth:
            answer = _closed_within(fifth, 1.0)
        assert answer is not None and answer.startswith(b"HTTP/1.1 503"), answer
        assert sum(t.name == "streaming-conn" for t in threading.enumerate()) == 4  # no thread for it
    finally:
        for c in idle:
            c.close()
    deadline = time.monotonic() + 5
    while True:  # the idle ones gone, a client with a token is served again
        ws = None
        with contextlib.suppress(websocket.WebSocketBadStatusException, ConnectionResetError):
            ws = _ws(_exec(s, ["echo", "again"]))
        if ws is not None:
            break
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert _drain(ws)[0] == b"again\n"


def _spdy_connect(url: str, protocol: str) -> socket.socket:
    host = url.split("/")[2]
    h, p = host.rsplit(":", 1)
    sock = socket.create_connection((h, int(p)), timeout=10)
    path = "/" + url.split("/", 3)[3]
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: SPDY/3.1\r\n"
        f"X-Stream-Protocol-Version: {protocol}\r\n\r\n".encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)
    assert head.startswith(b"HTTP/1.1 101"), head
    return sock


def _read_frames(
    sock: socket.socket, until: type, parser: spdy.FrameParser | None = None, timeout: float = 10
) -> list[spdy.Frame]:
    parser = parser or spdy.FrameParser(spdy.HeaderCodec())
    frames: list[spdy.Frame] = []
    sock.settimeout(timeout)
    while not any(isinstance(f, until) for f in frames):
        chunk = sock.recv(65536)
        if not chunk:
            break
        frames += parser.feed(chunk)
    return frames


def test_malformed_spdy_gets_goaway_and_releases(server: tuple[StreamingServer, Backends]) -> None:
    s, _ = server
    sock = _spdy_connect(_exec(s, ["true"]), stream_rules.V4)
    sock.sendall(struct_frame := b"\x80\x03\x00\x01\x00\x00\x00\x04" + b"\x00\x00\x00\x01")  # SYN_STREAM too short
    assert struct_frame
    frames = _read_frames(sock, spdy.GoAway)
    assert any(isinstance(f, spdy.GoAway) and f.status == spdy.PROTOCOL_ERROR for f in frames)
    sock.close()


def test_spdy_exec_and_port_forward(server: tuple[StreamingServer, Backends]) -> None:
    s, backends = server
    # exec: error, stdout, stderr streams, then the output, FINs and the Status
    sock = _spdy_connect(_exec(s, ["echo", "hi"]), stream_rules.V4)
    codec = spdy.HeaderCodec()
    for sid, kind in ((1, "error"), (3, "stdout"), (5, "stderr")):
        sock.sendall(spdy.encode_syn_stream(codec, sid, {"streamtype": kind}))
    frames = _read_frames(sock, spdy.GoAway)
    data = {sid: b"".join(f.data for f in frames if isinstance(f, spdy.Data) and f.stream_id == sid) for sid in (1, 3)}
    assert data[3] == b"hi\n"
    assert json.loads(data[1]) == {"metadata": {}, "status": "Success"}
    sock.close()
    # port-forward to a local echo server; a port nobody listens on gets a message on its error stream
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]

    def echo() -> None:
        c, _ = listener.accept()
        with c:
            c.sendall(c.recv(100).upper())

    threading.Thread(target=echo, daemon=True).start()
    sock = _spdy_connect(s.url(Target("portforward", "pod1")), stream_rules.PORTFORWARD_PROTOCOL)
    codec = spdy.HeaderCodec()
    sock.sendall(spdy.encode_syn_stream(codec, 1, {"streamtype": "error", "port": str(port), "requestid": "0"}))
    sock.sendall(spdy.encode_syn_stream(codec, 3, {"streamtype": "data", "port": str(port), "requestid": "0"}))
    sock.sendall(spdy.encode_data(3, b"ping"))
    parser = spdy.FrameParser(spdy.HeaderCodec())
    frames = _read_frames(sock, spdy.Data, parser)
    while not any(isinstance(f, spdy.Data) and f.stream_id == 3 and f.data for f in frames):
        frames += _read_frames(sock, spdy.Data, parser)
    assert b"".join(f.data for f in frames if isinstance(f, spdy.Data) and f.stream_id == 3) == b"PING"
    listener.close()
    sock.sendall(spdy.encode_syn_stream(codec, 5, {"streamtype": "error", "port": str(port), "requestid": "1"}))
    sock.sendall(spdy.encode_syn_stream(codec, 7, {"streamtype": "data", "port": str(port), "requestid": "1"}))
    frames = []
    while not any(isinstance(f, spdy.Data) and f.stream_id == 5 and f.data for f in frames):
        frames += _read_frames(sock, spdy.Data, parser)
    assert b"error forwarding port" in b"".join(f.data for f in frames if isinstance(f, spdy.Data))
    sock.close()
    assert backends.procs[0].released.wait(5)


def test_a_port_the_request_did_not_name_is_refused(server: tuple[StreamingServer, Backends]) -> None:
    s, _ = server
    sock = _spdy_connect(s.url(Target("portforward", "pod1", ports=(80,))), stream_rules.PORTFORWARD_PROTOCOL)
    codec = spdy.HeaderCodec()
    sock.sendall(spdy.encode_syn_stream(codec, 1, {"streamtype": "error", "port": "81", "requestid": "0"}))
    parser = spdy.FrameParser(spdy.HeaderCodec())
    frames: list[spdy.Frame] = []
    while not any(isinstance(f, spdy.Data) and f.fin for f in frames):
        frames += _read_frames(sock, spdy.Data, parser)
    assert b"port 81 was not named" in b"".join(f.data for f in frames if isinstance(f, spdy.Data))
    sock.close()


def test_tls(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-days", "1",
         "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    config = replace(ShimConfig(), streaming_tls_cert=str(cert), streaming_tls_key=str(key))
    s = StreamingServer(config, Backends())
    s.start()
    try:
        url = _exec(s, ["echo", "over tls"])
        assert url.startswith("https://127.0.0.1:")
        ws = websocket.create_connection(
            url.replace("https://", "wss://"),
            subprotocols=["v5.channel.k8s.io"],
            sslopt={"cert_reqs": ssl.CERT_REQUIRED, "ca_certs": str(cert)},
            timeout=10,
        )
        out, _, status = _drain(ws)
        assert (out, status["status"]) == (b"over tls\n", "Success")
        try:  # plain HTTP on the TLS port gets no HTTP answer
            answer = _raw(url.replace("https://", "http://"), b"GET / HTTP/1.1\r\n\r\n")
        except OSError:
            answer = b""
        assert not answer.startswith(b"HTTP/1.1")
    finally:
        s.stop()


def test_plain_websocket_port_forward(server: tuple[StreamingServer, Backends]) -> None:
    s, _ = server
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]

    def echo() -> None:
        c, _ = listener.accept()
        with c:
            c.sendall(c.recv(100).upper())

    threading.Thread(target=echo, daemon=True).start()
    url = s.url(Target("portforward", "pod1")).replace("http://", "ws://") + f"?port={port}"
    ws = websocket.create_connection(url, subprotocols=["v4.channel.k8s.io"], timeout=10)
    prefix = port.to_bytes(2, "little")
    assert [ws.recv_data()[1], ws.recv_data()[1]] == [b"\x00" + prefix, b"\x01" + prefix]
    ws.send_binary(b"\x00ping")
    assert ws.recv_data()[1] == b"\x00PING"
    assert ws.recv_data()[0] == websocket.ABNF.OPCODE_CLOSE  # the pod's side closed: the forward ends
    ws.close()
    listener.close()
    # a port nobody listens on: its error channel says so
    url = s.url(Target("portforward", "pod1")).replace("http://", "ws://") + f"?port={port}"
    ws = websocket.create_connection(url, timeout=10)
    ws.recv_data(), ws.recv_data()
    assert b"error forwarding port" in ws.recv_data()[1]
    ws.close()


def test_base64_websocket_port_forward(server: tuple[StreamingServer, Backends]) -> None:
    """v4.base64.channel.k8s.io, the kubelet's text variant: the channel as an ASCII digit, then base64."""
    s, _ = server
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]

    def echo() -> None:
        c, _ = listener.accept()
        with c:
            c.sendall(c.recv(100).upper())

    threading.Thread(target=echo, daemon=True).start()
    url = s.url(Target("portforward", "pod1")).replace("http://", "ws://") + f"?port={port}"
    ws = websocket.create_connection(url, subprotocols=["v4.base64.channel.k8s.io"], timeout=10)
    assert ws.getsubprotocol() == "v4.base64.channel.k8s.io"
    prefix = base64.b64encode(port.to_bytes(2, "little")).decode()
    first = [ws.recv_data(), ws.recv_data()]
    assert first == [
        (websocket.ABNF.OPCODE_TEXT, f"0{prefix}".encode()),
        (websocket.ABNF.OPCODE_TEXT, f"1{prefix}".encode()),
    ]
    ws.send("0" + base64.b64encode(b"ping\x00\xff").decode())
    assert ws.recv_data() == (websocket.ABNF.OPCODE_TEXT, b"0" + base64.b64encode(b"PING\x00\xff"))
    assert ws.recv_data()[0] == websocket.ABNF.OPCODE_CLOSE
    ws.close()
    listener.close()


def test_spdy_tunnelled_in_a_websocket(server: tuple[StreamingServer, Backends]) -> None:
    """kubectl's and crictl's port-forward over WebSocket: SPDY frames inside binary messages."""
    s, _ = server
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]

    def echo() -> None:
        c, _ = listener.accept()
        with c:
            c.sendall(c.recv(100).upper())

    threading.Thread(target=echo, daemon=True).start()
    url = s.url(Target("portforward", "pod1")).replace("http://", "ws://")
    ws = websocket.create_connection(url, subprotocols=["SPDY/3.1+portforward.k8s.io"], timeout=10)
    assert (ws.getsubprotocol() or "").lower() == "spdy/3.1+portforward.k8s.io"  # this client lower-cases it
    codec = spdy.HeaderCodec()
    ws.send_binary(spdy.encode_syn_stream(codec, 1, {"streamtype": "error", "port": str(port), "requestid": "0"}))
    ws.send_binary(spdy.encode_syn_stream(codec, 3, {"streamtype": "data", "port": str(port), "requestid": "0"}))
    ws.send_binary(spdy.encode_data(3, b"ping"))
    parser = spdy.FrameParser(spdy.HeaderCodec())
    got = b""
    while got != b"PING":
        for f in parser.feed(ws.recv_data()[1]):
            if isinstance(f, spdy.Data) and f.stream_id == 3:
                got += f.data
    ws.close()
    listener.close()
