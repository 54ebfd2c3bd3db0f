"""What streaming sessions reach through the rest of the shim: a process in a container's guest
(``Containers``) and a TCP connection to a pod's port."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable

from shim.containers import Containers
from shim.records import Records
from vmsandbox.adapters import agent_streams
from vmsandbox.adapters.agent_client import AgentClient
from vmsandbox.adapters.agent_streams import AgentStream
from vmsandbox.agent_ops import STREAM_READ_MAX, STREAM_WRITE_MAX
from vmsandbox.errors import NotFound, VmSandboxError
from vmsandbox.stream_rules import StreamRequest

DIAL_TIMEOUT_S = 10.0
POLL_S = 5.0

log = logging.getLogger(__name__)


def relay(agent: AgentClient, port: int) -> socket.socket:
    """A socket whose other end is a TCP connection the guest agent made to its own ``port``
    (a stream session of the agent's ``tcp_*`` ops), as ``splice`` carries it."""
    conn = agent_streams.tcp_connect(agent, port)
    ours, theirs = socket.socketpair()
    splice(conn, ours)
    return theirs


def splice(conn: AgentStream, ours: socket.socket, on_end: Callable[[], None] | None = None) -> None:
    """Carries bytes between the socket ``ours`` and the guest's connection ``conn`` (one of the
    agent's ``tcp_*`` stream sessions): two threads, one chunk in flight each way. Once both
    directions ended, the session is released, ``ours`` closed and ``on_end`` called; shutting
    ``ours`` down ends both."""
    done = [False, False]
    lock = threading.Lock()

    def finished(i: int) -> None:
        with lock:
            done[i] = True
            last = all(done)
        if last:
            with contextlib.suppress(VmSandboxError):
                conn.release()
            ours.close()
            if on_end is not None:
                on_end()

    def guest_to_client() -> None:
        try:
            while True:
                out = conn.read(STREAM_READ_MAX, POLL_S)
                if out.stdout:
                    ours.sendall(out.stdout)
                if out.done:
                    ours.shutdown(socket.SHUT_WR)
                    return
        except (OSError, VmSandboxError) as e:
            log.debug("streaming: relay from the guest ended: %s", e)
            with contextlib.suppress(OSError):
                ours.shutdown(socket.SHUT_RDWR)
        finally:
            finished(0)

    def client_to_guest() -> None:
        try:
            while chunk := ours.recv(STREAM_WRITE_MAX):
                conn.write(chunk)
            conn.close_input()
        except (OSError, VmSandboxError) as e:
            log.debug("streaming: relay to the guest ended: %s", e)
        finally:
            finished(1)

    for fn in (guest_to_client, client_to_guest):
        threading.Thread(target=fn, name="streaming-relay", daemon=True).start()


class ShimBackends:
    def __init__(self, records: Records, containers: Containers) -> None:
        self.records = records
        self.containers = containers

    def start_process(self, req: StreamRequest) -> AgentStream:
        """A new process for an Exec (a command); the container's own stdio for an Attach (none)."""
        if not req.cmd:
            return self.containers.attach_start(req.container_id)
        return self.containers.proc_start(req.container_id, list(req.cmd), tty=req.tty, stdin=req.stdin)

    def guest_connect(self, sandbox_id: str, port: int) -> AgentStream:
        """A TCP connection the pod's guest agent makes to ``port`` on the guest's own loopback,
        where the pod's containers listen (they share the guest's network namespace)."""
        return agent_streams.tcp_connect(self.containers.pool.guest_agent(sandbox_id), port)

    def dial(self, sandbox_id: str, port: int) -> socket.socket:
        """A connection to ``port`` of the pod, from the node: the guest owns the pod's address (its
        NIC is a passthru macvtap on the pod namespace's eth0), so the node reaches it the way the
        kubelet reaches any pod IP. A host-network pod has no address of its own (user-mode NIC):
        its connections are relayed by the guest agent."""
        record = self.records.find(sandbox_id)
        if record is None:
            raise NotFound(f"sandbox {sandbox_id[:12]} is gone")
        network = record.network
        ips = network.ips if network is not None else ()
        if not ips:
            # a host-network pod's guest has QEMU's user-mode network: nothing outside can connect
            # in, so the agent connects to the port on the guest's loopback and relays
            return relay(self.containers.pool.guest_agent(sandbox_id), port)
        ip = ips[0]
        sock = socket.create_connection((ip, port), timeout=DIAL_TIMEOUT_S)
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
