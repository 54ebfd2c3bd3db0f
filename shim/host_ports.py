"""The node ports of host-network VM pods: it owns their listening sockets and relayed connections.

A container in a host-network pod under runc listens on the node itself. A VM pod cannot: its guest
has its own network stack (QEMU's user-mode NIC, which nothing outside can connect into). So for
each TCP port mapping such a pod declares (the kubelet sends one per container port, with the host
port equal to the container port), the shim listens on the node, at the mapping's ``host_ip`` (all
addresses when empty) and its ``host_port`` (the container port when 0), and relays every
connection to the same port inside the guest through the agent, as PortForward does for these pods
(``shim.streaming.backends``). Nothing else of the node is exposed: the node port is one the pod
declared, as a ``hostPort`` would be. UDP and SCTP mappings are not relayed (logged).

The shim listens as root, so it grants only what a runc container of the same pod could take on
the node's network (``vmsandbox.network.node_ports``): an address of the node's or the wildcard
(another is refused, ``InvalidArgument``); a port below the node's
``net.ipv4.ip_unprivileged_port_start`` only once a container of the pod holding
``CAP_NET_BIND_SERVICE`` is created (``grant_privileged``; the default capability set has it),
held back until then; once opened, it stays open while the pod runs.

A port another process holds refuses the RunPodSandbox that asks for it (``AlreadyExists``), with
nothing left listening; ``close`` stops listening and cuts the pod's relayed connections.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from vmsandbox.errors import AlreadyExists, InfrastructureError, InvalidArgument, VmSandboxError
from vmsandbox.network import NamespaceOptions, NodePort, PortMapping, node_ports

MAX_CONNECTIONS_PER_POD = 32  # relayed at once; more are closed as they come
CHUNK = 64 << 10

log = logging.getLogger(__name__)

Dial = Callable[[str, int], socket.socket]
UNPRIVILEGED_PORT_START = "/proc/sys/net/ipv4/ip_unprivileged_port_start"


def unprivileged_port_start() -> int:
    """The node's first port a process without CAP_NET_BIND_SERVICE may bind (1024 if unreadable)."""
    try:
        with open(UNPRIVILEGED_PORT_START) as f:
            return int(f.read(16))
    except (OSError, ValueError):
        return 1024


@dataclass
class _Pod:
    listeners: list[socket.socket] = field(default_factory=list)
    connections: set[socket.socket] = field(default_factory=set)
    held: list[NodePort] = field(default_factory=list)  # privileged ports not yet granted
    granted: list[tuple[socket.socket, NodePort]] = field(default_factory=list)  # and those granted since
    closed: bool = False


def node_address(m: PortMapping) -> tuple[str, int]:
    """Where the node listens for a host-network pod's mapping."""
    return (m.host_ip or "0.0.0.0", m.host_port or m.container_port)


def _listen(p: NodePort) -> socket.socket:
    """A listener at ``p``; AlreadyExists when another holds it, InvalidArgument when the node has
    no such address."""
    sock = socket.socket(socket.AF_INET6 if ":" in p.address else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((p.address, p.port))
        sock.listen(16)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise AlreadyExists(
                f"host-network pod: port {p.port} on {p.address} of the node is taken ({exc.strerror})"
            ) from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise InvalidArgument(
                f"port_mappings: host_ip {p.address} (port {p.port}) is not an address of this node: a "
                "host-network pod listens only on the node's own addresses (leave host_ip empty for all of them)"
            ) from None
        raise InfrastructureError(
            f"host-network pod: cannot listen on {p.address} port {p.port}: {exc.strerror}"
        ) from None
    return sock


class HostPorts:
    def __init__(self, dial: Dial, first_unprivileged: Callable[[], int] = unprivileged_port_start) -> None:
        self._dial = dial
        self._first_unprivileged = first_unprivileged
        self._lock = threading.Lock()
        self._pods: dict[str, _Pod] = {}

    def open(
        self,
        sandbox_id: str,
        namespaces: NamespaceOptions,
        mappings: tuple[PortMapping, ...],
        *,
        privileged: bool = False,
    ) -> list[tuple[str, int]]:
        """Listen on the node for each TCP mapping of ``sandbox_id`` when it is a host-network pod
        (other pods' mappings are CNI's); the addresses listened on. A privileged port is held
        back for ``grant_privileged`` unless ``privileged`` (a container of the pod holds
        CAP_NET_BIND_SERVICE already). Raises, with nothing left listening, InvalidArgument for an
        address no host-network pod could listen on, AlreadyExists when one is taken."""
        if not namespaces.host_network or not mappings:
            return []
        for m in mappings:
            if m.protocol != "tcp":
                log.warning(
                    "sandbox %s: %s port %d of a host-network VM pod is not reachable on the node (TCP only)",
                    sandbox_id[:12],
                    m.protocol,
                    m.container_port,
                )
        pod = _Pod()
        now: list[NodePort] = []
        for p in node_ports(mappings, self._first_unprivileged()):
            (now if privileged or not p.privileged else pod.held).append(p)
        bound: list[tuple[socket.socket, NodePort]] = []
        try:
            for p in now:
                bound.append((_listen(p), p))
        except BaseException:
            for sock, _ in bound:
                sock.close()
            raise
        with self._lock:
            pod.listeners.extend(sock for sock, _ in bound)
            self._pods[sandbox_id] = pod
        self._serve_all(sandbox_id, pod, bound)
        if pod.held:
            log.info("sandbox %s: node ports %s wait for a container with CAP_NET_BIND_SERVICE",
                     sandbox_id[:12], sorted(p.port for p in pod.held))  # fmt: skip
        return sorted((p.address, p.port) for _, p in bound)

    def grant_privileged(self, sandbox_id: str) -> list[tuple[str, int]]:
        """A container of the pod holding CAP_NET_BIND_SERVICE was created: listen on the ports
        held back; the addresses listened on now. One that is taken, or no address of the node's,
        stays held (logged), as such a container's own bind would have failed."""
        with self._lock:
            pod = self._pods.get(sandbox_id)
            held = [] if pod is None or pod.closed else list(pod.held)
        if pod is None:
            return []
        bound: list[tuple[socket.socket, NodePort]] = []
        for p in held:
            try:
                bound.append((_listen(p), p))
            except VmSandboxError as exc:
                log.warning("sandbox %s: node port not relayed: %s", sandbox_id[:12], exc)
        with self._lock:
            if pod.closed:
                for sock, _ in bound:
                    sock.close()
                return []
            pod.listeners.extend(sock for sock, _ in bound)
            pod.granted.extend(bound)
            for _, p in bound:
                pod.held.remove(p)
        self._serve_all(sandbox_id, pod, bound)
        return sorted((p.address, p.port) for _, p in bound)

    def withdraw(self, sandbox_id: str, granted: list[tuple[str, int]]) -> None:
        """Undo of ``grant_privileged`` (the create of the container that opened them failed): the
        node ports ``granted`` then stop listening and are held back again."""
        with self._lock:
            pod = self._pods.get(sandbox_id)
            if pod is None or pod.closed:
                return
            taken = [(s, p) for s, p in pod.granted if (p.address, p.port) in granted]
            for s, p in taken:
                pod.granted.remove((s, p))
                pod.listeners.remove(s)
                pod.held.append(p)
        for s, _ in taken:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        if taken:
            log.info("sandbox %s: node ports %s held back again", sandbox_id[:12], sorted(p.port for _, p in taken))

    def _serve_all(self, sandbox_id: str, pod: _Pod, bound: list[tuple[socket.socket, NodePort]]) -> None:
        for sock, p in bound:
            threading.Thread(
                target=self._accept, args=(sandbox_id, pod, sock, p.guest_port), name="host-port", daemon=True
            ).start()
        if bound:
            log.info(
                "sandbox %s: node ports %s relayed into the guest", sandbox_id[:12], sorted(p.port for _, p in bound)
            )

    def close(self, sandbox_id: str) -> None:
        with self._lock:
            pod = self._pods.pop(sandbox_id, None)
            if pod is None:
                return
            pod.closed = True
            socks = [*pod.listeners, *pod.connections]
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def sandboxes(self) -> set[str]:
        with self._lock:
            return set(self._pods)

    def _accept(self, sandbox_id: str, pod: _Pod, listener: socket.socket, port: int) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                full = pod.closed or len(pod.connections) >= 2 * MAX_CONNECTIONS_PER_POD  # two sockets each
                if not full:
                    pod.connections.add(client)
            if full:
                client.close()
                continue
            threading.Thread(
                target=self._serve, args=(sandbox_id, pod, client, port), name="host-port-conn", daemon=True
            ).start()

    def _serve(self, sandbox_id: str, pod: _Pod, client: socket.socket, port: int) -> None:
        try:
            guest = self._dial(sandbox_id, port)
        except (OSError, VmSandboxError) as exc:
            log.info("sandbox %s: node port connection to guest port %d refused: %s", sandbox_id[:12], port, exc)
            self._drop(pod, client)
            return
        with self._lock:
            closed = pod.closed
            if not closed:
                pod.connections.add(guest)
        if closed:  # the pod's ports closed while the guest was dialled (outside the lock: _drop takes it)
            guest.close()
            self._drop(pod, client)
            return
        done = threading.Event()

        def pump(src: socket.socket, dst: socket.socket) -> None:
            try:
                while data := src.recv(CHUNK):
                    dst.sendall(data)
                with contextlib.suppress(OSError):
                    dst.shutdown(socket.SHUT_WR)
            except OSError:
                with contextlib.suppress(OSError):
                    dst.shutdown(socket.SHUT_RDWR)
            finally:
                if done.is_set():
                    self._drop(pod, client)
                    self._drop(pod, guest)
                done.set()

        threading.Thread(target=pump, args=(guest, client), name="host-port-out", daemon=True).start()
        pump(client, guest)

    def _drop(self, pod: _Pod, s: socket.socket) -> None:
        with self._lock:
            pod.connections.discard(s)
        s.close()
