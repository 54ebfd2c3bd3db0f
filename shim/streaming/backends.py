"""What streaming sessions reach through the rest of the shim: a process in a container's guest
(``Containers``) and a TCP connection to a pod's port."""

from __future__ import annotations

import socket

from shim.containers import Containers, GuestAttach, GuestProcess
from shim.sandboxes import Sandboxes
from vmsandbox.errors import NotFound, WrongState
from vmsandbox.streaming import StreamRequest

DIAL_TIMEOUT_S = 10.0


class ShimBackends:
    def __init__(self, sandboxes: Sandboxes, containers: Containers) -> None:
        self.sandboxes = sandboxes
        self.containers = containers

    def start_process(self, req: StreamRequest) -> GuestProcess | GuestAttach:
        """A new process for an Exec (a command); the container's own stdio for an Attach (none)."""
        if not req.cmd:
            return self.containers.attach_start(req.container_id)
        return self.containers.proc_start(req.container_id, list(req.cmd), tty=req.tty, stdin=req.stdin)

    def dial(self, sandbox_id: str, port: int) -> socket.socket:
        """A connection to ``port`` of the pod, from the node: the guest owns the pod's address (its
        NIC is a passthru macvtap on the pod namespace's eth0), so the node reaches it the way the
        kubelet reaches any pod IP. A host-network pod has no address of its own (user-mode NIC)."""
        record = self.sandboxes.find(sandbox_id)
        if record is None:
            raise NotFound(f"sandbox {sandbox_id[:12]} is gone")
        network = record.pod_network()
        ips = network.ips if network is not None else ()
        if not ips:
            raise WrongState(
                f"sandbox {sandbox_id[:12]} has no pod IP (a host-network pod's guest has QEMU's user-mode "
                "network, which nothing outside can connect into): port-forward needs a CNI pod"
            )
        ip = ips[0]
        sock = socket.create_connection((ip, port), timeout=DIAL_TIMEOUT_S)
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
