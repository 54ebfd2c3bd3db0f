"""Streaming Exec and PortForward into real guests through the real socket: over SPDY with the
real ``crictl`` (skipped without $CRICTL or crictl on PATH), over WebSocket with an independent
client (``websocket-client``), and the streaming server's refusals (used, unknown tokens).

One shim with a CNI bridge network of the test's own (so the pod has an address to forward to),
one pod, one long-running container."""

from __future__ import annotations

import base64
import contextlib
import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import websocket  # websocket-client

from gen.cri.runtime.v1 import api_pb2 as pb
from tests.integration.cluster_support import built_crictl
from tests.integration.cni_kit import cni_env
from tests.ports import answer_when_listening, quiet_port
from tests.registry_kit import Layout, Registry, busybox_entries, push
from tests.shim_kit import Shim, container, pod, q, require_host, running_shim
from vmsandbox import spdy

pytestmark = [pytest.mark.slow, pytest.mark.integration]

CRICTL = built_crictl()
SMALL = q({"cpu": "250m", "memory": "32Mi"})
TINY = q({"cpu": "50m", "memory": "32Mi"})
"""The tty containers': the streaming pod keeps to one host CPU, leaving the other to the host-network pod."""
SERVER_PORT = 8080
APPLETS = ("sh", "echo", "cat", "sleep", "nc", "tty", "stty", "head", "wc", "true")


@dataclass
class Env:
    shim: Shim
    sandbox: str
    container: str
    tmp: Path
    image: str
    config: pb.PodSandboxConfig

    def exec_url(self, cmd: list[str], **kw: bool) -> str:
        req = pb.ExecRequest(container_id=self.container, cmd=cmd, **kw)
        return str(self.shim.runtime.Exec(req, timeout=30).url)

    def crictl(self, *args: str, stdin: bytes = b"", timeout: float = 120) -> subprocess.CompletedProcess[bytes]:
        assert CRICTL is not None
        sock = f"unix://{self.shim.socket}"
        argv = [CRICTL, "--runtime-endpoint", sock, "--image-endpoint", sock, "--timeout", "60s", *args]
        return subprocess.run(argv, input=stdin, capture_output=True, timeout=timeout)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    require_host()
    tmp = tmp_path_factory.mktemp("streaming")
    registry = Registry(tmp / "registry").start()
    try:
        layout = Layout(tmp / "layout")
        layout.tag("bb", layout.image([layout.layer(busybox_entries(APPLETS))]))
        ref = f"{registry.host}/test/busybox:streaming"
        push(layout, "bb", ref)
        with cni_env(tmp, bridge="vmsbr-strm0", subnet="10.233.0.0/24") as cni:
            (tmp / "shim").mkdir()
            with running_shim(tmp / "shim", extra_config=cni.shim_config(), pull_busybox=False) as shim:
                shim.images.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image=ref)), timeout=120)
                tiny = ("tty", "tty-sh", "tty-once", "tty-crictl")
                config = pod("streamer", containers=[(n, SMALL) for n in ("c", "attached")] + [(n, TINY) for n in tiny])
                config.log_directory = str(tmp / "logs")
                sid = shim.runtime.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=300).pod_sandbox_id
                c = container("c", SMALL)
                c.image.image = ref
                # a server for port-forward: each connection gets "pong:" and its first line back
                script = f"while true; do nc -l -p {SERVER_PORT} -e sh -c 'read l; echo pong:$l'; done"
                c.command[:] = ["sh", "-c", script]
                c.log_path = "c.log"
                cid = shim.runtime.CreateContainer(
                    pb.CreateContainerRequest(pod_sandbox_id=sid, config=c, sandbox_config=config), timeout=120
                ).container_id
                shim.runtime.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=120)
                yield Env(shim, sid, cid, tmp, ref, config)
    finally:
        registry.stop()


# ---- WebSocket (an independent client) ------------------------------------------------------------


def _ws_exec(
    url: str, stdin: bytes = b"", protocol: str = "v5.channel.k8s.io"
) -> tuple[bytes, bytes, dict[str, object]]:
    ws = websocket.create_connection(url.replace("http://", "ws://"), subprotocols=[protocol], timeout=120)
    try:
        assert ws.getsubprotocol() == protocol
        if stdin:
            ws.send_binary(b"\x00" + stdin)
            ws.send_binary(bytes([255, 0]))  # v5: close stdin
        out, err, status = b"", b"", {}
        while True:
            try:
                opcode, data = ws.recv_data()
            except websocket.WebSocketConnectionClosedException:
                break
            if opcode == websocket.ABNF.OPCODE_CLOSE:
                break
            channel, payload = data[0], data[1:]
            if channel == 1:
                out += payload
            elif channel == 2:
                err += payload
            elif channel == 3:
                status = json.loads(payload)
        return out, err, status
    finally:
        ws.close()


def test_websocket_exec_echo_prints_exactly_hello(env: Env) -> None:
    out, err, status = _ws_exec(env.exec_url(["echo", "-n", "hello"], stdout=True, stderr=True))
    assert (out, err, status["status"]) == (b"hello", b"", "Success"), f"{out!r} {err!r} {status}"


def test_websocket_exec_stdin_and_exit_code(env: Env) -> None:
    url = env.exec_url(["sh", "-c", "wc -c; echo oops >&2; exit 3"], stdin=True, stdout=True, stderr=True)
    out, err, status = _ws_exec(url, stdin=b"x" * 100_000)
    assert out.strip() == b"100000", env.shim.log_text()[-3000:]
    assert err == b"oops\n"
    assert status["reason"] == "NonZeroExitCode"
    assert status["details"] == {"causes": [{"reason": "ExitCode", "message": "3"}]}


def test_websocket_exec_with_a_terminal(env: Env) -> None:
    url = env.exec_url(["sh", "-c", "tty; stty size"], stdin=True, stdout=True, tty=True)
    ws = websocket.create_connection(url.replace("http://", "ws://"), subprotocols=["v5.channel.k8s.io"], timeout=120)
    out = b""
    try:
        while True:
            opcode, data = ws.recv_data()
            if opcode == websocket.ABNF.OPCODE_CLOSE:
                break
            if data[0] == 1:
                out += data[1:]
    except websocket.WebSocketConnectionClosedException:
        pass
    finally:
        ws.close()
    assert b"/dev/pts/" in out, out


def test_websocket_attach_to_a_container_with_stdin_once(env: Env) -> None:
    """A container created with stdin and stdin_once: Attach writes to its shell, reads its
    output, and closing stdin ends the shell (and so the container)."""
    rt = env.shim.runtime
    c = container("attached", SMALL)
    c.image.image = env.image
    c.command[:] = ["sh"]
    c.stdin, c.stdin_once = True, True
    c.log_path = "attached.log"
    cid = rt.CreateContainer(
        pb.CreateContainerRequest(pod_sandbox_id=env.sandbox, config=c, sandbox_config=env.config), timeout=120
    ).container_id
    rt.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=120)
    url = rt.Attach(pb.AttachRequest(container_id=cid, stdin=True, stdout=True, stderr=True), timeout=30).url
    ws = websocket.create_connection(url.replace("http://", "ws://"), subprotocols=["v5.channel.k8s.io"], timeout=60)
    try:
        # output without a newline reaches the client while the shell still runs
        ws.send_binary(b"\x00echo -n hello\n")
        assert ws.recv_data()[1] == b"\x01hello"
        ws.send_binary(b"\x00echo to-stderr >&2\n")
        assert ws.recv_data()[1] == b"\x02to-stderr\n"
        ws.send_binary(bytes([255, 0]))  # close stdin: stdin_once ends the shell
        _, data = ws.recv_data()
        assert json.loads(data[1:])["status"] == "Success"
    finally:
        ws.close()
    deadline = time.monotonic() + 60
    while (
        rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid), timeout=30).status.state != pb.CONTAINER_EXITED
    ):
        assert time.monotonic() < deadline, "stdin_once did not end the shell"
        time.sleep(0.3)
    log = (Path(env.config.log_directory) / "attached.log").read_text()
    assert (" stdout P hello" in log or " stdout F hello" in log) and " stderr F to-stderr" in log, log


def _start(env: Env, name: str, cmd: list[str], *, tty: bool = False, stdin: bool = False, once: bool = False) -> str:
    rt = env.shim.runtime
    c = container(name, TINY)
    c.image.image = env.image
    c.command[:] = cmd
    c.tty, c.stdin, c.stdin_once = tty, stdin, once
    c.log_path = f"{name}.log"
    cid = rt.CreateContainer(
        pb.CreateContainerRequest(pod_sandbox_id=env.sandbox, config=c, sandbox_config=env.config), timeout=120
    ).container_id
    rt.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=120)
    return str(cid)


def _wait_exited(env: Env, cid: str, why: str) -> pb.ContainerStatus:
    deadline = time.monotonic() + 60
    while True:
        status = env.shim.runtime.ContainerStatus(pb.ContainerStatusRequest(container_id=cid), timeout=30).status
        if status.state == pb.CONTAINER_EXITED:
            return status
        assert time.monotonic() < deadline, why
        time.sleep(0.3)


def _log_lines(env: Env, name: str) -> list[tuple[str, str, str]]:
    """(stream, tag, text) of each record of the container's CRI log."""
    text = (Path(env.config.log_directory) / f"{name}.log").read_bytes().decode()
    out = []
    for record in text.split("\n")[:-1]:
        _ts, stream, tag, body = record.split(" ", 3)
        out.append((stream, tag, body))
    return out


def test_a_tty_container_has_a_terminal_and_is_logged_as_containerd_logs_it(env: Env) -> None:
    """A container created with tty runs on a terminal; its one output stream is logged as stdout,
    each line's terminal newline (\\r\\n) ending a record, a last unended line as a P record."""
    cid = _start(env, "tty", ["sh", "-c", "tty; echo to-out; echo to-err >&2; printf unended"], tty=True)
    _wait_exited(env, cid, "the tty container did not exit")
    assert _log_lines(env, "tty") == [
        ("stdout", "F", "/dev/pts/0"),
        ("stdout", "F", "to-out"),
        ("stdout", "F", "to-err"),
        ("stdout", "P", "unended"),
    ]


class _WsTerminal:
    """A v5 WebSocket attach with a terminal: channel 0 stdin, 1 output, 3 status, 4 resize."""

    def __init__(self, url: str) -> None:
        self.ws = websocket.create_connection(
            url.replace("http://", "ws://"), subprotocols=["v5.channel.k8s.io"], timeout=60
        )
        self.out = b""
        self.status: dict[str, object] = {}

    def send(self, data: bytes) -> None:
        self.ws.send_binary(b"\x00" + data)

    def resize(self, cols: int, rows: int) -> None:
        self.ws.send_binary(b"\x04" + json.dumps({"Width": cols, "Height": rows}).encode())

    def close_stdin(self) -> None:
        self.ws.send_binary(bytes([255, 0]))

    def read_until(self, want: bytes, timeout: float = 60) -> bytes:
        deadline = time.monotonic() + timeout
        while want not in self.out:
            assert time.monotonic() < deadline, f"{want!r} never came: {self.out[-2000:]!r}"
            opcode, data = self.ws.recv_data()
            if opcode == websocket.ABNF.OPCODE_CLOSE:
                raise AssertionError(f"closed before {want!r}: {self.out[-2000:]!r}")
            if data[:1] == b"\x01":
                self.out += data[1:]
            elif data[:1] == b"\x03":
                self.status = json.loads(data[1:])
        return self.out

    def read_to_end(self) -> bytes:
        with contextlib.suppress(websocket.WebSocketConnectionClosedException):
            while True:
                opcode, data = self.ws.recv_data()
                if opcode == websocket.ABNF.OPCODE_CLOSE:
                    break
                if data[:1] == b"\x01":
                    self.out += data[1:]
                elif data[:1] == b"\x03":
                    self.status = json.loads(data[1:])
        return self.out

    def close(self) -> None:
        self.ws.close()


def test_websocket_attach_with_a_terminal_follows_resizes(env: Env) -> None:
    """Attach with tty joins the container's own terminal (its shell, /dev/pts/0); a resize sets
    the terminal's size, which stty reads; two attaches share the terminal."""
    rt = env.shim.runtime
    cid = _start(env, "tty-sh", ["sh"], tty=True, stdin=True)
    attach = pb.AttachRequest(container_id=cid, stdin=True, stdout=True, tty=True)
    first = _WsTerminal(rt.Attach(attach, timeout=30).url)
    second = _WsTerminal(rt.Attach(attach, timeout=30).url)
    try:
        first.resize(100, 30)
        first.send(b"tty; stty size; echo mark-$((6*7))\n")
        out = first.read_until(b"mark-42")
        assert b"/dev/pts/0" in out and b"30 100" in out, out
        assert b"mark-42" in second.read_until(b"mark-42")  # the other attach sees the same terminal
        second.resize(120, 40)
        second.send(b"stty size; echo mark-$((7*7))\n")
        assert b"40 120" in first.read_until(b"mark-49")
    finally:
        first.close()
        second.close()
    rt.StopContainer(pb.StopContainerRequest(container_id=cid, timeout=5), timeout=60)


def test_attach_with_a_terminal_and_stdin_once_gives_end_of_file(env: Env) -> None:
    """stdin_once: when the first attach's stdin ends, the process on the terminal reads
    end-of-file (cat ends, the shell goes on), and its output still reaches the log."""
    rt = env.shim.runtime
    cid = _start(env, "tty-once", ["sh", "-c", "cat; echo after-eof"], tty=True, stdin=True, once=True)
    url = rt.Attach(pb.AttachRequest(container_id=cid, stdin=True, stdout=True, tty=True), timeout=30).url
    term = _WsTerminal(url)
    try:
        term.send(b"typed\n")
        term.read_until(b"typed\r\ntyped\r\n")  # the terminal's echo, then cat's copy
        term.send(b"unended")  # a line left unended: its ^D ends the line, another one the input
        term.close_stdin()
        assert b"after-eof" in term.read_to_end()
    finally:
        term.close()
    status = _wait_exited(env, cid, "stdin_once did not end cat")
    assert status.exit_code == 0
    # the echo of the unended line, cat's copy of it, then the shell going on after cat's end
    assert _log_lines(env, "tty-once") == [
        ("stdout", "F", "typed"),
        ("stdout", "F", "typed"),
        ("stdout", "F", "unendedunendedafter-eof"),
    ]
    import grpc

    with pytest.raises(grpc.RpcError) as e:  # a container without a terminal is not attached to with one
        rt.Attach(pb.AttachRequest(container_id=env.container, stdin=True, stdout=True, tty=True), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_websocket_port_forward_base64(env: Env) -> None:
    """v4.base64.channel.k8s.io: text messages, the channel as a digit, then base64."""
    url = env.shim.runtime.PortForward(pb.PortForwardRequest(pod_sandbox_id=env.sandbox, port=[SERVER_PORT])).url
    ws = websocket.create_connection(
        url.replace("http://", "ws://") + f"?port={SERVER_PORT}", subprotocols=["v4.base64.channel.k8s.io"], timeout=60
    )
    try:
        prefix = base64.b64encode(SERVER_PORT.to_bytes(2, "little")).decode()
        assert {ws.recv(), ws.recv()} == {"0" + prefix, "1" + prefix}
        ws.send("0" + base64.b64encode(b"b64\n").decode())
        got = b""
        while b"pong:b64" not in got:
            msg = ws.recv()
            assert isinstance(msg, str) and msg[:1] == "0", msg
            got += base64.b64decode(msg[1:])
    finally:
        ws.close()


def _processes(env: Env) -> bytes:
    req = pb.ExecSyncRequest(container_id=env.container, cmd=["sh", "-c", "cat /proc/[0-9]*/cmdline"], timeout=30)
    return bytes(env.shim.runtime.ExecSync(req, timeout=60).stdout)


def test_a_client_that_vanishes_leaves_no_process_in_the_guest(env: Env) -> None:
    for tty in (False, True):
        url = env.exec_url(["sleep", "301"], stdin=True, stdout=True, tty=tty)
        ws = websocket.create_connection(url.replace("http://", "ws://"), subprotocols=["v5.channel.k8s.io"])
        deadline = time.monotonic() + 30
        while b"sleep\x00301" not in _processes(env):
            assert time.monotonic() < deadline, "the exec'd process never started"
            time.sleep(0.3)
        assert ws.sock is not None
        ws.sock.close()  # no close frame: the client is simply gone
        deadline = time.monotonic() + 30
        while b"sleep\x00301" in _processes(env):
            assert time.monotonic() < deadline, f"the process outlived its client (tty={tty})"
            time.sleep(0.5)


# ---- the server's refusals ----------------------------------------------------------------------


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_a_token_is_single_use_and_unknown_ones_are_refused(env: Env) -> None:
    url = env.exec_url(["true"], stdout=True)
    _out, _, status = _ws_exec(url)
    assert status["status"] == "Success"
    code, text = _get(url)
    assert code == 404 and "unknown, used or expired" in text
    code, _ = _get(url.rsplit("/", 1)[0] + "/not-a-token")
    assert code == 404


def test_exec_refuses_tty_with_stderr_and_no_streams(env: Env) -> None:
    import grpc

    for kw in ({"tty": True, "stderr": True, "stdout": True}, {}):
        with pytest.raises(grpc.RpcError) as e:
            env.exec_url(["true"], **kw)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# ---- SPDY with the real crictl ------------------------------------------------------------------

needs_crictl = pytest.mark.skipif(CRICTL is None, reason="crictl not found (set CRICTL)")


@needs_crictl
def test_crictl_exec_prints_exactly_hello(env: Env) -> None:
    done = env.crictl("exec", env.container, "echo", "-n", "hello")
    assert (done.returncode, done.stdout) == (0, b"hello"), done


@needs_crictl
def test_crictl_exec_with_stdin(env: Env) -> None:
    done = env.crictl(
        "exec", "-i", env.container, "sh", "-c", "read l; echo got:$l; cat | wc -c", stdin=b"abc\n" + b"y" * 300_000
    )
    assert done.stdout == b"got:abc\n300000\n", done


@needs_crictl
@pytest.mark.skipif(shutil.which("script") is None, reason="util-linux script (a terminal for crictl -t) not found")
def test_crictl_exec_with_stdin_and_a_terminal(env: Env) -> None:
    assert CRICTL is not None
    sock = f"unix://{env.shim.socket}"
    inner = f"{CRICTL} --runtime-endpoint {sock} exec -i -t {env.container} sh -c 'read l; echo got:$l; tty'"
    done = subprocess.run(["script", "-qec", inner, "/dev/null"], input=b"abc\n", capture_output=True, timeout=120)
    assert b"got:abc" in done.stdout, done
    assert b"/dev/pts/" in done.stdout, done


@needs_crictl
def test_crictl_exec_passes_the_exit_code(env: Env) -> None:
    done = env.crictl("exec", env.container, "sh", "-c", "exit 5")
    assert done.returncode != 0 and b"exit code 5" in done.stderr, done


@needs_crictl
def test_crictl_port_forward_reaches_a_server_in_the_guest(env: Env) -> None:
    local = quiet_port()
    assert CRICTL is not None
    sock = f"unix://{env.shim.socket}"
    proc = subprocess.Popen(
        [CRICTL, "--runtime-endpoint", sock, "port-forward", env.sandbox, f"{local}:{SERVER_PORT}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        answer = answer_when_listening(local, b"ping\n", 60)  # once the container's server listens
        assert answer == b"pong:ping\n", (answer, env.shim.log_text()[-2000:])
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _spdy_port_forward(url: str, port: int, send: bytes) -> bytes:
    """One forwarded connection over SPDY (this project's framing as the client): sends ``send``,
    returns what comes back until the pod's side closes."""
    host, _, rest = url.removeprefix("http://").partition("/")
    h, p = host.rsplit(":", 1)
    with socket.create_connection((h, int(p)), timeout=60) as sock:
        sock.sendall(
            f"POST /{rest} HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: SPDY/3.1\r\n"
            "X-Stream-Protocol-Version: portforward.k8s.io\r\n\r\n".encode()
        )
        head = b""
        while b"\r\n\r\n" not in head:
            head += sock.recv(1)
        assert head.startswith(b"HTTP/1.1 101"), head
        codec = spdy.HeaderCodec()
        for sid, kind in ((1, "error"), (3, "data")):
            sock.sendall(spdy.encode_syn_stream(codec, sid, {"streamtype": kind, "port": str(port), "requestid": "0"}))
        sock.sendall(spdy.encode_data(3, send))
        parser = spdy.FrameParser(spdy.HeaderCodec())
        got, errors = b"", b""
        while chunk := sock.recv(65536):
            for f in parser.feed(chunk):
                if isinstance(f, spdy.Data) and f.stream_id == 3:
                    got += f.data
                    if f.fin:
                        return got
                elif isinstance(f, spdy.Data) and f.stream_id == 1:
                    errors += f.data
            assert not errors, errors
        return got


def _host_network_server(env: Env, name: str, *mappings: pb.PortMapping) -> str:
    """A host-network pod whose container answers "pong:<line>" on SERVER_PORT; its sandbox id."""
    rt = env.shim.runtime
    config = pod(name, containers=[("c", SMALL)])
    config.log_directory = str(env.tmp / f"logs-{name}")
    config.linux.security_context.namespace_options.network = pb.NODE
    config.port_mappings.extend(mappings)
    sid = rt.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=300).pod_sandbox_id
    c = container("c", SMALL)
    c.image.image = env.image
    c.command[:] = ["sh", "-c", f"while true; do nc -l -p {SERVER_PORT} -e sh -c 'read l; echo pong:$l'; done"]
    c.log_path = "c.log"
    try:
        cid = rt.CreateContainer(
            pb.CreateContainerRequest(pod_sandbox_id=sid, config=c, sandbox_config=config), timeout=120
        ).container_id
        rt.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=120)
    except BaseException:
        rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=120)
        rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=120)
        raise
    return sid


def test_port_forward_into_a_host_network_pod_is_relayed_by_the_agent(env: Env) -> None:
    """A host-network pod's guest has QEMU's user-mode network: nothing on the node can connect
    to it, so the agent connects to the port on the guest's loopback and relays."""
    rt = env.shim.runtime
    sid = _host_network_server(env, "hostnet")
    try:
        deadline = time.monotonic() + 60
        answer = b""
        while answer != b"pong:ping\n" and time.monotonic() < deadline:
            url = rt.PortForward(pb.PortForwardRequest(pod_sandbox_id=sid), timeout=30).url
            with contextlib.suppress(AssertionError, OSError):
                answer = _spdy_port_forward(url, SERVER_PORT, b"ping\n")
            time.sleep(0.5)
        assert answer == b"pong:ping\n", env.shim.log_text()[-2000:]
    finally:
        rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=120)
        rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=120)


def _node_port() -> int:
    return quiet_port()


def _ask_node(port: int, line: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        c.sendall(line)
        out = b""
        while chunk := c.recv(4096):
            out += chunk
        return out


def test_a_host_network_pods_declared_port_is_served_on_the_node(env: Env) -> None:
    """As under runc, a server in a host-network pod answers on the node at the port the pod
    declared (critest's "portforward in host network" fetches it there first): the shim listens on
    the node and the agent relays each connection to the guest's port. Stopping the pod frees it."""
    rt = env.shim.runtime
    node = _node_port()
    mapping = pb.PortMapping(container_port=SERVER_PORT, host_port=node, host_ip="127.0.0.1")
    sid = _host_network_server(env, "hostnet-ports", mapping)
    try:
        deadline = time.monotonic() + 60
        answer = b""
        while answer != b"pong:node\n" and time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                answer = _ask_node(node, b"node\n")
            time.sleep(0.5)
        assert answer == b"pong:node\n", env.shim.log_text()[-2000:]
    finally:
        rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=120)
        rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=120)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", node), timeout=10)


@needs_crictl
@pytest.mark.skipif(shutil.which("script") is None, reason="util-linux script (a terminal for crictl -t) not found")
def test_crictl_exec_and_attach_with_a_terminal_on_a_tty_container(env: Env) -> None:
    """`crictl exec -it` and `crictl attach -it` (SPDY) on a container created with tty and stdin."""
    assert CRICTL is not None
    cid = _start(env, "tty-crictl", ["sh"], tty=True, stdin=True)
    crictl = f"{CRICTL} --runtime-endpoint unix://{env.shim.socket} --timeout 60s"

    def in_terminal(cmd: str, stdin: bytes) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(["script", "-qec", cmd, "/dev/null"], input=stdin, capture_output=True, timeout=120)

    done = in_terminal(f"{crictl} exec -i -t {cid} sh -c 'tty; echo exec-$((3*14))'", b"")
    assert b"exec-42" in done.stdout and b"/dev/pts/" in done.stdout, done
    done = in_terminal(f"{crictl} attach -i -t {cid}", b"tty; echo attach-$((6*7))\nexit\n")
    assert b"attach-42" in done.stdout and b"/dev/pts/0" in done.stdout, done
    _wait_exited(env, cid, "exit typed through crictl attach did not end the shell")
