"""The node ports of host-network VM pods: it owns their listening sockets and relayed connections.

A container in a host-network pod under runc listens on the node itself. A VM pod cannot: its guest
has its own network stack (QEMU's user-mode NIC, which nothing outside can connect into). So for
each TCP port mapping such a pod declares (the kubelet sends one per container port, with the host
port equal to the container port), the shim listens on the node, at the mapping's ``host_ip`` (all
addresses when empty) and its ``host_port`` (the container port when 0), and relays every
connection to the same port inside the guest through the agent, as PortForward does for these pods
(``shim.streaming.backends``). Nothing else of the node is exposed: the node port is one the pod
declared, as a ``hostPort`` would be. UDP and SCTP mappings are not relayed (logged).

A port another process holds refuses the RunPodSandbox that asks for it (``AlreadyExists``), with
nothing left listening; ``close`` stops listening and cuts the pod's relayed connections.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from vmsandbox.errors import AlreadyExists, VmSandboxError
from vmsandbox.network import NamespaceOptions, PortMapping

MAX_CONNECTIONS_PER_POD = 32  # relayed at once; more are closed as they come
CHUNK = 64 << 10

log = logging.getLogger(__name__)

Dial = Callable[[str, int], socket.socket]


@dataclass
class _Pod:
    listeners: list[socket.socket] = field(default_factory=list)
    connections: set[socket.socket] = field(default_factory=set)
    closed: bool = False


def node_address(m: PortMapping) -> tuple[str, int]:
    """Where the node listens for a host-network pod's mapping."""
    return (m.host_ip or "0.0.0.0", m.host_port or m.container_port)


class HostPorts:
    def __init__(self, dial: Dial) -> None:
        self._dial = dial
        self._lock = threading.Lock()
        self._pods: dict[str, _Pod] = {}

    def open(
        self, sandbox_id: str, namespaces: NamespaceOptions, mappings: tuple[PortMapping, ...]
    ) -> list[tuple[str, int]]:
        """Listen on the node for each TCP mapping of ``sandbox_id`` when it is a host-network pod
        (other pods' mappings are CNI's); the addresses listened on. Raises AlreadyExists (nothing
        left listening) when one of them is taken."""
        if not namespaces.host_network or not mappings:
            return []
        pod = _Pod()
        seen: set[tuple[str, int]] = set()
        bound: list[tuple[socket.socket, int]] = []  # listener, guest port
        try:
            for m in mappings:
                if m.protocol != "tcp":
                    log.warning(
                        "sandbox %s: %s port %d of a host-network VM pod is not reachable on the node (TCP only)",
                        sandbox_id[:12],
                        m.protocol,
                        m.container_port,
                    )
                    continue
                where = node_address(m)
                if where in seen:
                    continue
                seen.add(where)
                sock = socket.socket(socket.AF_INET6 if ":" in where[0] else socket.AF_INET, socket.SOCK_STREAM)
                pod.listeners.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    sock.bind(where)
                except OSError as exc:
                    raise AlreadyExists(
                        f"host-network pod: port {where[1]} on {where[0]} of the node is taken ({exc.strerror})"
                    ) from None
                sock.listen(16)
                bound.append((sock, m.container_port))
        except BaseException:
            for s in pod.listeners:
                s.close()
            raise
        with self._lock:
            self._pods[sandbox_id] = pod
        for sock, port in bound:
            threading.Thread(
                target=self._accept, args=(sandbox_id, pod, sock, port), name="host-port", daemon=True
            ).start()
        if seen:
            log.info("sandbox %s: node ports %s relayed into the guest", sandbox_id[:12], sorted(p for _, p in seen))
        return sorted(seen)

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
            if pod.closed:
                guest.close()
                self._drop(pod, client)
                return
            pod.connections.add(guest)
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
