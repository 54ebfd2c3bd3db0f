"""``AgentPool``: the one connection to each pod's guest agent, and the guest's word held against the records.

A guest's QEMU channel takes one host connection at a time, so each sandbox has at most one
``AgentClient`` here, opened on first use (one attempt at a time per guest), dropped when the
channel closes or the agent misbehaves, and opened again by the next call. ``call`` runs an agent
op, reconnecting once when the channel closed under it (a guest keeps its containers across host
connections).

It also holds the guest's word against the records (``shim.records``): a connection to an agent
instance other than the one that reported at RunPodSandbox, a hello from a new instance on a
live connection, or an agent that does not know a container recorded as created or running
means the agent lost its containers, and ``on_lost`` (``Reconciler.agent_lost``) turns the
sandbox NOTREADY.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from shim.model import CONTAINER_CREATED, CONTAINER_EXITED, CONTAINER_RUNNING, SANDBOX_READY
from shim.records import Records
from vmsandbox.adapters.agent_client import AgentClient, AgentLost
from vmsandbox.adapters.guest_channel import GuestChannelClosed, GuestRequestFailed
from vmsandbox.adapters.hypervisor import Hypervisor
from vmsandbox.agent_protocol import UNKNOWN_CONTAINER, ProtocolError
from vmsandbox.domain import AGENT_CHANNEL
from vmsandbox.errors import VmSandboxError

log = logging.getLogger(__name__)

_CONNECT_TIMEOUT_S = 30.0


class AgentPool:
    def __init__(self, records: Records, hypervisor: Hypervisor, on_lost: Callable[[str, str], object]) -> None:
        self.records = records
        self.hypervisor = hypervisor
        self._on_lost = on_lost
        self._lock = threading.Lock()
        self._clients: dict[str, AgentClient] = {}
        self._opening: dict[str, threading.Lock] = {}  # per sandbox, held while its agent is connected to

    def client(self, sandbox_id: str, timeout_s: float = _CONNECT_TIMEOUT_S) -> AgentClient:
        with self._lock:
            client = self._clients.get(sandbox_id)
            opening = self._opening.setdefault(sandbox_id, threading.Lock())
        if client is not None and not client.closed:
            return client
        # one connection attempt per guest at a time: QEMU's channel takes one host connection, so a
        # second one (an RPC beside the start-up watch) would wait unanswered until the first closes
        with opening:
            with self._lock:
                client = self._clients.get(sandbox_id)
            if client is not None and not client.closed:
                return client
            return self._open(sandbox_id, timeout_s)

    def _open(self, sandbox_id: str, timeout_s: float) -> AgentClient:
        record = self.records.get(sandbox_id)
        path = self.hypervisor.channel_path(record.domain, AGENT_CHANNEL)
        client = AgentClient.open(
            path, timeout_s, label=f"sandbox {sandbox_id[:12]}", on_lost=lambda why: self._lost(sandbox_id, why)
        )
        expected = record.agent_instance
        if expected and client.instance != expected:
            client.close()
            why = (
                f"the guest agent answering is instance {client.instance or 'unknown'}, not {expected}, which "
                "reported when the sandbox started: it started over and the containers it ran are lost"
            )
            self._lost(sandbox_id, why)
            raise AgentLost(f"sandbox {sandbox_id[:12]}: {why}")
        with self._lock:
            old = self._clients.get(sandbox_id)
            if old is not None and not old.closed:
                client.close()
                return old
            self._clients[sandbox_id] = client
        return client

    def drop(self, sandbox_id: str) -> None:
        with self._lock:
            client = self._clients.pop(sandbox_id, None)
        if client is not None:
            client.close()

    def _lost(self, sandbox_id: str, why: str) -> None:
        """The sandbox's agent is lost (``why``): forget its connection, and have the sandbox turn NOTREADY."""
        with self._lock:
            client = self._clients.get(sandbox_id)
            if client is not None and client.closed:
                del self._clients[sandbox_id]
        try:
            self._on_lost(sandbox_id, why)
        except VmSandboxError as exc:  # a sandbox removed meanwhile
            log.warning("sandbox %s: guest agent lost (%s), not recorded: %s", sandbox_id[:12], why, exc)

    def call(self, sandbox_id: str, fn: str, *args: object, **kw: object) -> object:
        """An agent op, reconnecting once when the channel closed under us (a guest keeps its
        containers across host connections). An agent that answered garbage or is lost is not
        asked again on this connection; one that does not know a container we ran is lost."""
        for attempt in (0, 1):
            client = self.client(sandbox_id)
            try:
                return getattr(client, fn)(*args, **kw)
            except GuestChannelClosed:
                self.drop(sandbox_id)
                if attempt:
                    raise
            except (ProtocolError, AgentLost):
                self.drop(sandbox_id)
                raise
            except GuestRequestFailed as exc:
                # a container unknown to a create is new, to a delete gone already (a retried removal)
                if exc.code == UNKNOWN_CONTAINER and fn not in ("create", "delete") and args:
                    self._check_unknown(sandbox_id, str(args[0]), exc)
                raise
        raise AssertionError("unreachable")

    def _check_unknown(self, sandbox_id: str, container_id: str, exc: GuestRequestFailed) -> None:
        """The agent says it has no container ``container_id``: if we have it as created in the guest
        (or running), the agent lost it (AgentLost); else the answer is just true."""
        if not container_id:
            return  # an op on the whole guest
        try:
            c = self.records.container(container_id)
        except VmSandboxError:
            return
        if c.image_id and c.state in (CONTAINER_CREATED, CONTAINER_RUNNING):
            why = (
                f"the guest agent does not know container {c.id[:12]}, which it created ({c.state}): "
                "it lost its containers"
            )
            self._lost(sandbox_id, why)
            raise AgentLost(f"sandbox {sandbox_id[:12]}: {why}") from exc

    def watch_guests(self, timeout_s: float = 5.0) -> int:
        """Connect to the agent of every READY sandbox whose containers run (at start-up, and again
        when a connection went away), so that an agent that started over is noticed without waiting
        for an RPC; the same agent instance reconnecting is adoption, another one is a lost agent.
        Returns how many agents were connected."""
        live = {c.sandbox_id for c in self.records.containers() if c.image_id and c.state != CONTAINER_EXITED}
        connected = 0
        for s in self.records.list_sandboxes():
            if s.state != SANDBOX_READY or s.id not in live:
                continue
            try:
                self.client(s.id, timeout_s)
                connected += 1
            except VmSandboxError as exc:
                log.warning("sandbox %s: no connection to its guest agent: %s", s.id[:12], exc)
        return connected

    def guest_agent(self, sandbox_id: str) -> AgentClient:
        """The agent connection of a READY sandbox's guest (streaming relays use it directly)."""
        return self.client(self.records.get(sandbox_id).id)

    def forget(self, sandbox_id: str) -> None:
        """A removed sandbox's connect lock goes with it (its connection: ``drop``)."""
        with self._lock:
            self._opening.pop(sandbox_id, None)

    def close(self) -> None:
        with self._lock:
            clients = list(self._clients.values())
            self._clients.clear()
        for cl in clients:
            cl.close()
