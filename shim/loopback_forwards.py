"""The loopback forwards of pods in a network namespace their caller made (shim mode): it owns each
one's listening socket in that namespace, its nat rule there and the connections it relays.

containerd serves a shim-mode pod's PortForward itself, by dialling ``localhost:<port>`` inside the
pod's network namespace; the guest is not on that loopback (it holds the pod's address through the
macvtap on ``eth0``). So, when such a pod is made, the shim listens on one port of the namespace's
loopback (``vmsandbox.adapters.netns.listen_in``) and adds one nat OUTPUT rule there redirecting
every TCP connection to ``127.0.0.1`` to it (``vmsandbox.loopback_forward.redirect_rule``, with
``iptables``: it is what the node's CNI plugins use, and what ``scripts/setup-host.sh`` installs).
Each connection's original port (``SO_ORIGINAL_DST``) is then dialled on the guest's own loopback
through its agent, as a host-network pod's PortForward is (``shim.streaming.backends.splice``), so
a container that listens on its loopback only is reached as under runc.

Bounded: ``MAX_CONNECTIONS_PER_POD`` at once per pod (more are reset as they come), one chunk in
flight each way per connection, one thread accepting per pod, so a guest that does not answer
holds only its own pod's connections. ``close`` (StopPodSandbox, and the undo of RunPodSandbox's
step) deletes the rule, stops listening and cuts the relayed connections. The namespace is held
open (a descriptor) from ``open`` to ``close``, so the rule is deleted in the very namespace it was
added to even once its caller's path is gone. Nothing is kept across a restart: shim-mode pods are
removed when vmsandbox starts again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from vmsandbox import loopback_forward as rules
from vmsandbox.adapters import netns
from vmsandbox.adapters.agent_streams import AgentStream
from vmsandbox.errors import InvalidArgument, VmSandboxError

log = logging.getLogger(__name__)

Connect = Callable[[str, int], AgentStream]
"""A TCP connection made by a sandbox's guest agent to a port on the guest's loopback."""
Splice = Callable[[AgentStream, socket.socket, Callable[[], None]], None]
"""Carries bytes between a socket and a guest's connection until both ends are done, then calls back."""
IPTABLES = "/usr/sbin/iptables"


@dataclass
class _Forward:
    ns_fd: int
    listener: socket.socket
    port: int
    connections: set[socket.socket] = field(default_factory=set)
    closed: bool = False


def _reset(sock: socket.socket) -> None:
    """Closes ``sock`` with a reset, so the dialler sees the connection fail rather than end."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


class LoopbackForwards:
    def __init__(self, connect: Connect, splice: Splice, iptables: str = IPTABLES) -> None:
        self._connect = connect
        self._splice = splice
        self._iptables = iptables
        self._lock = threading.Lock()
        self._pods: dict[str, _Forward] = {}

    def open(self, sandbox_id: str, netns_path: str) -> int:
        """Forward the loopback of the namespace ``netns_path`` (the caller's) into the guest of
        ``sandbox_id``; the port listened on there. Whole or nothing: a failure leaves no socket,
        rule or descriptor behind."""
        fd = netns.hold_given(netns_path)
        try:
            listener = netns.listen_in(fd, rules.LOOPBACK, rules.BACKLOG)
            try:
                port = int(listener.getsockname()[1])
                netns.run_in(
                    fd,
                    rules.iptables_argv("-I", port, self._iptables),
                    f"redirecting TCP to {rules.LOOPBACK} in {netns_path}",
                )
            except BaseException:
                listener.close()
                raise
        except BaseException:
            os.close(fd)
            raise
        fwd = _Forward(fd, listener, port)
        with self._lock:
            old = self._pods.pop(sandbox_id, None)
            self._pods[sandbox_id] = fwd
        if old is not None:  # not expected: an id is made once
            self._shut(sandbox_id, old)
        threading.Thread(target=self._accept, args=(sandbox_id, fwd), name="loopback-forward", daemon=True).start()
        log.info(
            "sandbox %s: TCP to %s in %s forwarded into the guest (listening on port %d)",
            sandbox_id[:12],
            rules.LOOPBACK,
            netns_path,
            port,
        )
        return port

    def close(self, sandbox_id: str) -> None:
        """Its rule deleted, its listener and connections closed; nothing there is fine."""
        with self._lock:
            fwd = self._pods.pop(sandbox_id, None)
        if fwd is not None:
            self._shut(sandbox_id, fwd)

    def sandboxes(self) -> set[str]:
        with self._lock:
            return set(self._pods)

    def _shut(self, sandbox_id: str, fwd: _Forward) -> None:
        with self._lock:
            fwd.closed = True
            socks = [fwd.listener, *fwd.connections]
        for s in socks:  # before the rule goes: the dialler's side sees the end through its NAT
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        try:
            netns.run_in(
                fwd.ns_fd,
                rules.iptables_argv("-D", fwd.port, self._iptables),
                f"deleting the loopback redirect of sandbox {sandbox_id[:12]}",
            )
        except VmSandboxError as exc:  # the namespace goes with the pod: so does a rule left in it
            log.warning("sandbox %s: loopback forward: %s", sandbox_id[:12], exc)
        fwd.listener.close()
        os.close(fwd.ns_fd)

    def _accept(self, sandbox_id: str, fwd: _Forward) -> None:
        while True:
            try:
                client, _ = fwd.listener.accept()
            except OSError:
                return  # closed
            try:
                raw = client.getsockopt(socket.SOL_IP, rules.SO_ORIGINAL_DST, rules.SOCKADDR_IN_LEN)
                port = rules.original_port(raw)
            except (OSError, InvalidArgument) as exc:
                log.info("sandbox %s: loopback connection not forwarded: %s", sandbox_id[:12], exc)
                _reset(client)
                continue
            with self._lock:
                ok = rules.admit(len(fwd.connections), fwd.closed)
                if ok:
                    fwd.connections.add(client)
            if not ok:
                log.info(
                    "sandbox %s: loopback connection to port %d refused: %d forwarded already",
                    sandbox_id[:12],
                    port,
                    rules.MAX_CONNECTIONS_PER_POD,
                )
                _reset(client)
                continue
            threading.Thread(
                target=self._serve, args=(sandbox_id, fwd, client, port), name="loopback-forward-conn", daemon=True
            ).start()

    def _serve(self, sandbox_id: str, fwd: _Forward, client: socket.socket, port: int) -> None:
        try:
            conn = self._connect(sandbox_id, port)
        except (OSError, VmSandboxError) as exc:
            log.info("sandbox %s: loopback connection to guest port %d failed: %s", sandbox_id[:12], port, exc)
            self._drop(fwd, client)
            _reset(client)
            return
        with self._lock:
            closed = fwd.closed
        if closed:  # closed while the guest was dialled
            with contextlib.suppress(VmSandboxError):
                conn.release()
            self._drop(fwd, client)
            _reset(client)
            return
        self._splice(conn, client, lambda: self._drop(fwd, client))

    def _drop(self, fwd: _Forward, s: socket.socket) -> None:
        with self._lock:
            fwd.connections.discard(s)
