"""shim.loopback_forwards in a real network namespace (``ip netns add``, as containerd gives one),
with a stand-in for the guest: what is dialled on the namespace's loopback, on any port, reaches
that port "in the guest"; the connections are bounded; a guest that cannot connect resets the
dialler; ``close`` leaves no rule and no listener; a failure half-way leaves nothing either."""

from __future__ import annotations

import ctypes
import os
import secrets
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from shim.loopback_forwards import LoopbackForwards
from vmsandbox.adapters.netns import NetnsError
from vmsandbox.errors import InvalidArgument, WrongState
from vmsandbox.loopback_forward import MAX_CONNECTIONS_PER_POD, iptables_argv

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root"),
]

SANDBOX = "f" * 64
_libc = ctypes.CDLL(None, use_errno=True)


class Guest:
    """Stands in for the guest's agent: each connection answers ``port N`` and then echoes."""

    def __init__(self) -> None:
        self.refuse: set[int] = set()
        self.live = 0
        self.lock = threading.Lock()

    def connect(self, sandbox_id: str, port: int) -> Any:
        assert sandbox_id == SANDBOX
        if port in self.refuse:
            raise WrongState(f"tcp_connect: connection refused on port {port}")
        return port

    def splice(self, port: Any, sock: socket.socket, on_end: Callable[[], None]) -> None:
        def serve() -> None:
            with self.lock:
                self.live += 1
            try:
                sock.sendall(f"port {port}\n".encode())
                while data := sock.recv(4096):
                    sock.sendall(data)
            except OSError:
                pass
            finally:
                sock.close()
                with self.lock:
                    self.live -= 1
                on_end()

        threading.Thread(target=serve, daemon=True).start()


@pytest.fixture
def ns() -> Iterator[str]:
    name = f"vmslf-{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def in_ns(name: str, fn: Callable[[], Any]) -> Any:
    """``fn()`` run by a thread in the namespace ``name``."""
    out: list[Any] = []

    def inside() -> None:
        fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
        try:
            assert _libc.setns(fd, 0x40000000) == 0, os.strerror(ctypes.get_errno())
        finally:
            os.close(fd)
        try:
            out.append(fn())
        except BaseException as exc:
            out.append(exc)

    t = threading.Thread(target=inside)
    t.start()
    t.join(30)
    return out[0]


def dial(name: str, port: int) -> socket.socket | BaseException:
    return in_ns(name, lambda: socket.create_connection(("127.0.0.1", port), timeout=10))  # type: ignore[no-any-return]


def line(sock: socket.socket) -> bytes:
    got = b""
    while not got.endswith(b"\n"):
        chunk = sock.recv(100)
        if not chunk:
            break
        got += chunk
    return got


def assert_reset(dialled: socket.socket | BaseException) -> None:
    """The connection was reset: seen by the connect itself when the reset came before it checked
    the socket's error (a connect with a timeout), else by the first read."""
    if isinstance(dialled, socket.socket):
        with dialled, pytest.raises(ConnectionResetError):
            dialled.recv(10)
    else:
        assert isinstance(dialled, ConnectionResetError), dialled


def rule_there(name: str, port: int) -> bool:
    argv = ["ip", "netns", "exec", name, *iptables_argv("-C", port)]
    return subprocess.run(argv, capture_output=True, check=False).returncode == 0


def listening(name: str) -> str:
    return subprocess.run(["ip", "netns", "exec", name, "ss", "-Hltn"], capture_output=True, text=True).stdout


def test_any_loopback_port_reaches_that_port_of_the_guest_until_closed(ns: str) -> None:
    guest = Guest()
    forwards = LoopbackForwards(guest.connect, guest.splice)
    listen_port = forwards.open(SANDBOX, f"/run/netns/{ns}")
    assert rule_there(ns, listen_port)
    assert f"127.0.0.1:{listen_port}" in listening(ns)
    for port in (80, 8080, 5432, 65535, listen_port):
        sock = dial(ns, port)
        assert isinstance(sock, socket.socket), sock
        with sock:
            assert line(sock) == f"port {port}\n".encode()
            sock.sendall(b"hello\n")
            assert line(sock) == b"hello\n"
    assert forwards.sandboxes() == {SANDBOX}

    held = dial(ns, 9000)
    assert isinstance(held, socket.socket)
    assert line(held) == b"port 9000\n"
    forwards.close(SANDBOX)
    assert held.recv(10) == b""  # the relayed connection was cut
    held.close()
    assert not rule_there(ns, listen_port)
    assert listening(ns).strip() == ""
    refused = dial(ns, 9000)
    assert isinstance(refused, ConnectionRefusedError), refused
    forwards.close(SANDBOX)  # again: nothing there is fine
    assert forwards.sandboxes() == set()


def test_connections_beyond_the_cap_are_reset_and_a_refusing_guest_resets_its_dialler(ns: str) -> None:
    guest = Guest()
    guest.refuse.add(7)
    forwards = LoopbackForwards(guest.connect, guest.splice)
    forwards.open(SANDBOX, f"/run/netns/{ns}")
    try:
        assert_reset(dial(ns, 7))
        held = []
        for i in range(MAX_CONNECTIONS_PER_POD):
            s = dial(ns, 1000 + i)
            assert isinstance(s, socket.socket), s
            assert line(s) == f"port {1000 + i}\n".encode()
            held.append(s)
        assert_reset(dial(ns, 2000))
        held.pop().close()  # one ends: there is room for one more
        deadline = time.monotonic() + 10
        while guest.live >= MAX_CONNECTIONS_PER_POD and time.monotonic() < deadline:
            time.sleep(0.05)
        again = dial(ns, 2001)
        assert isinstance(again, socket.socket)
        with again:
            assert line(again) == b"port 2001\n"
        for s in held:
            s.close()
    finally:
        forwards.close(SANDBOX)


def test_a_failure_half_way_leaves_nothing(ns: str, tmp_path: Any) -> None:
    guest = Guest()
    forwards = LoopbackForwards(guest.connect, guest.splice, iptables=str(tmp_path / "no-iptables"))
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(NetnsError, match=r"redirecting TCP to 127\.0\.0\.1"):
        forwards.open(SANDBOX, f"/run/netns/{ns}")
    assert listening(ns).strip() == ""
    assert forwards.sandboxes() == set()
    assert len(os.listdir("/proc/self/fd")) == fds
    with pytest.raises(InvalidArgument, match="no such file"):
        forwards.open(SANDBOX, f"/run/netns/{ns}-gone")
