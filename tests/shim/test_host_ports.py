"""Tests of shim.host_ports: the node ports of host-network VM pods, relayed into the guest.

The guest end here is a TCP echo server on 127.0.0.1 reached by the ``dial`` the shim gives
HostPorts (in the shim, the agent's relay into the guest); the node end is real sockets."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from shim.host_ports import HostPorts, node_address
from tests.ports import quiet_port
from vmsandbox.errors import AlreadyExists, InfrastructureError, InvalidArgument
from vmsandbox.network import NamespaceOptions, NodePort, PortMapping, node_ports

SID = "a" * 64
NODE = NamespaceOptions(network="NODE")


def free_port() -> int:
    return quiet_port()


@pytest.fixture
def echo() -> Iterator[int]:
    """A guest-side server: echoes each connection's bytes in upper case."""
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            with c:
                while data := c.recv(4096):
                    c.sendall(data.upper())

    threading.Thread(target=serve, daemon=True).start()
    yield srv.getsockname()[1]
    srv.close()


def dial_to(guest_port: int, seen: list[tuple[str, int]]):  # type: ignore[no-untyped-def]
    def dial(sandbox_id: str, port: int) -> socket.socket:
        seen.append((sandbox_id, port))
        return socket.create_connection(("127.0.0.1", guest_port), timeout=5)

    return dial


def talk(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
        c.sendall(data)
        c.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := c.recv(4096):
            out += chunk
        return out


@pytest.mark.parametrize(
    ("mapping", "want"),
    [
        (PortMapping("tcp", 8080), ("0.0.0.0", 8080)),
        (PortMapping("tcp", 8080, 9090), ("0.0.0.0", 9090)),
        (PortMapping("tcp", 8080, 0, "127.0.0.1"), ("127.0.0.1", 8080)),
    ],
)
def test_node_address(mapping: PortMapping, want: tuple[str, int]) -> None:
    assert node_address(mapping) == want


def test_a_node_port_reaches_the_guest_port_both_ways(echo: int) -> None:
    seen: list[tuple[str, int]] = []
    ports = HostPorts(dial_to(echo, seen))
    node = free_port()
    assert ports.open(SID, NODE, (PortMapping("tcp", 7000, node, "127.0.0.1"),)) == [("127.0.0.1", node)]
    try:
        assert talk(node, b"hello" * 10_000) == b"HELLO" * 10_000
        assert talk(node, b"again") == b"AGAIN"
        assert seen == [(SID, 7000), (SID, 7000)]  # the guest's port, not the node's
    finally:
        ports.close(SID)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", node), timeout=5)
    assert ports.sandboxes() == set()


def test_a_taken_port_refuses_the_pod_and_leaves_nothing_listening(echo: int) -> None:
    ports = HostPorts(dial_to(echo, []))
    free, taken = free_port(), socket.create_server(("127.0.0.1", 0))
    try:
        mappings = (
            PortMapping("tcp", 1, free, "127.0.0.1"),
            PortMapping("tcp", 2, taken.getsockname()[1], "127.0.0.1"),
        )
        with pytest.raises(AlreadyExists, match=f"port {taken.getsockname()[1]} on 127.0.0.1 of the node is taken"):
            ports.open(SID, NODE, mappings)
    finally:
        taken.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", free), timeout=5)
    assert ports.sandboxes() == set()


def test_udp_is_not_relayed_and_a_refused_dial_closes_the_client() -> None:
    def dial(_sid: str, _port: int) -> socket.socket:
        raise InfrastructureError("the guest refused")

    ports = HostPorts(dial)
    node = free_port()
    listened = ports.open(
        SID, NODE, (PortMapping("udp", 53, node, "127.0.0.1"), PortMapping("tcp", 80, node, "127.0.0.1"))
    )
    try:
        assert listened == [("127.0.0.1", node)]
        with socket.create_connection(("127.0.0.1", node), timeout=5) as c:
            assert c.recv(16) == b""  # accepted, then closed: the guest end could not be had
    finally:
        ports.close(SID)


def test_close_cuts_relayed_connections(echo: int) -> None:
    ports = HostPorts(dial_to(echo, []))
    node = free_port()
    ports.open(SID, NODE, (PortMapping("tcp", 1, node, "127.0.0.1"),))
    c = socket.create_connection(("127.0.0.1", node), timeout=5)
    try:
        c.sendall(b"ping")
        assert c.recv(16) == b"PING"
        ports.close(SID)
        assert c.recv(16) == b""
    finally:
        c.close()


def test_a_pod_with_its_own_network_gets_no_node_port(echo: int) -> None:
    ports = HostPorts(dial_to(echo, []))
    node = free_port()
    assert ports.open(SID, NamespaceOptions(), (PortMapping("tcp", 1, node, "127.0.0.1"),)) == []
    assert ports.sandboxes() == set()


@pytest.mark.parametrize(
    ("mapping", "want"),
    [
        (PortMapping("tcp", 8080), NodePort("0.0.0.0", 8080, 8080, False)),
        (PortMapping("tcp", 80), NodePort("0.0.0.0", 80, 80, True)),
        (PortMapping("tcp", 8080, 443, "10.0.0.5"), NodePort("10.0.0.5", 443, 8080, True)),
        (PortMapping("tcp", 80, 1024, "127.0.0.1"), NodePort("127.0.0.1", 1024, 80, False)),  # loopback: as runc
        (PortMapping("tcp", 22, 0, "::1"), NodePort("::1", 22, 22, True)),
        (PortMapping("tcp", 80, 0, "224.0.0.1"), "not a unicast address of the node"),
        (PortMapping("tcp", 80, 0, "ff02::1"), "not a unicast address of the node"),
        (PortMapping("tcp", 80, 0, "255.255.255.255"), "not a unicast address of the node"),
        (PortMapping("tcp", 80, 0, "fe80::1%eth0"), "not a unicast address of the node"),
        (PortMapping("tcp", 80, 0, "localhost"), "is not an IP address"),
    ],
)
def test_node_ports_follow_what_a_runc_host_network_container_could_listen_on(
    mapping: PortMapping, want: NodePort | str
) -> None:
    if isinstance(want, str):
        with pytest.raises(InvalidArgument, match=want) as e:
            node_ports((mapping,), 1024)
        assert (len(str(e.value)) < 300 and "host_ip empty" in str(e.value)) or "give one" in str(e.value)
    else:
        assert node_ports((mapping,), 1024) == (want,)


def test_a_privileged_port_waits_for_a_container_with_net_bind_service(echo: int) -> None:
    """Every port counts as privileged here (as if the node's first unprivileged port were 65536)."""
    ports = HostPorts(dial_to(echo, []), first_unprivileged=lambda: 65536)
    node = free_port()
    try:
        assert ports.open(SID, NODE, (PortMapping("tcp", 1, node, "127.0.0.1"),)) == []
        assert ports.sandboxes() == {SID}
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", node), timeout=5)
        assert ports.grant_privileged(SID) == [("127.0.0.1", node)]
        assert talk(node, b"now") == b"NOW"
        assert ports.grant_privileged(SID) == []  # once
    finally:
        ports.close(SID)
    assert ports.grant_privileged(SID) == []  # a closed pod opens nothing


def test_a_grant_withdrawn_holds_its_ports_back_again(echo: int) -> None:
    """The undo of a grant (the create of the container that opened them failed): the ports it
    opened stop listening, and the next container holding the capability opens them again."""
    node = free_port()
    ports = HostPorts(dial_to(echo, []), lambda: 65536)
    try:
        ports.open(SID, NODE, (PortMapping("tcp", 1, node, "127.0.0.1"),))
        granted = ports.grant_privileged(SID)
        assert talk(node, b"up") == b"UP"
        ports.withdraw(SID, granted)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", node), timeout=5)
        ports.withdraw(SID, granted)  # once is enough: nothing more goes
        assert ports.grant_privileged(SID) == granted
        assert talk(node, b"again") == b"AGAIN"
    finally:
        ports.close(SID)


def test_an_address_the_node_lacks_is_refused_as_invalid(echo: int) -> None:
    ports = HostPorts(dial_to(echo, []))
    with pytest.raises(InvalidArgument, match=r"192\.0\.2\.1 .* is not an address of this node"):
        ports.open(SID, NODE, (PortMapping("tcp", 8080, free_port(), "192.0.2.1"),))
    assert ports.sandboxes() == set()


def test_a_connection_dialled_while_the_pod_closes_is_dropped_without_a_deadlock(echo: int) -> None:
    """The guest end is dialled outside the lock; a pod closed meanwhile drops both ends and leaves
    the lock free (it once took it twice, hanging close and every later RunPodSandbox)."""
    dialling, closed = threading.Event(), threading.Event()

    def slow_dial(sandbox_id: str, port: int) -> socket.socket:
        dialling.set()
        closed.wait(10)
        return socket.create_connection(("127.0.0.1", echo), timeout=5)

    hp = HostPorts(slow_dial)
    port = free_port()
    hp.open(SID, NODE, (PortMapping("tcp", port, port),))
    client = socket.create_connection(("127.0.0.1", port), timeout=5)
    assert dialling.wait(10)
    hp.close(SID)
    closed.set()
    done = threading.Event()

    def open_again() -> None:
        hp.open(SID, NODE, (PortMapping("tcp", port, port),))
        done.set()

    threading.Thread(target=open_again, daemon=True).start()
    assert done.wait(10), "the lock stayed taken"
    assert client.recv(1) == b""  # dropped
    client.close()
    hp.close(SID)
