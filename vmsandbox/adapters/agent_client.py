"""Host side of the container ops of the guest agent (protocol 2, ``vmsandbox.agent_ops``).

One ``AgentClient`` per sandbox holds the channel connection; a reader thread hands each response
to the request waiting for its id, so requests run concurrently (a ``wait`` for a container's exit
does not hold up an ``exec``). Container state lives in the guest: a client that closes (a shim
that restarts) and a new client that opens find the containers running as they were. Stream
sessions (streamed processes, attach sessions, forwarded connections) are opened on a client by
``vmsandbox.adapters.agent_streams``.

The reader also watches for a lost agent: a ``hello`` from another agent instance (or from an
agent without one) on this acked connection means the agent started over without its containers,
and more unsolicited messages than ``UnsolicitedBudget`` allows mean a guest that floods. Either
way the connection is dropped, pending requests fail with ``AgentLost`` and ``on_lost`` is told
why (from a thread of its own, so it may take locks). A line that is not a valid message fails the
pending requests with ``ProtocolError`` and drops the connection; the next client reconnects.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from vmsandbox.adapters.guest_channel import (
    GuestChannel,
    GuestChannelClosed,
    GuestChannelTimeout,
    GuestRequestFailed,
)
from vmsandbox.agent_ops import (
    MAX_ONLINE_CPUS,
    CgroupStats,
    ContainerState,
    ExecResult,
    LogChunk,
    container_state_from_body,
    container_states_from_body,
    cpus_online_from_body,
    exec_result_from_body,
    log_chunk_from_body,
    stats_from_body,
)
from vmsandbox.agent_protocol import (
    CPUS_ONLINE_VERSION,
    EXEC_OUTPUT_MAX,
    IMAGE_MOUNTS_VERSION,
    TTY_VERSION,
    USERNS_VERSION,
    VOLUMES_VERSION,
    Ack,
    GuestReport,
    Hello,
    ImageMount,
    ProtocolError,
    Request,
    Response,
    UnsolicitedBudget,
)
from vmsandbox.errors import InfrastructureError, InternalError, WrongState

RESPONSE_SLACK_S = 10.0
"""Extra time a blocking op (wait, exec, a stream session's read) gets over its own timeout for the round trip."""


_READ_WAIT_S = 3600.0
"""The reader thread waits this long per message (and again); the socket closing ends it."""


def _has_userns(spec: Mapping[str, object]) -> bool:
    """Whether an OCI spec gives its container a user namespace of its own."""
    linux = spec.get("linux")
    namespaces = linux.get("namespaces") if isinstance(linux, Mapping) else None
    return isinstance(namespaces, list) and any(isinstance(n, Mapping) and n.get("type") == "user" for n in namespaces)


class AgentLost(InfrastructureError):
    """The guest's agent is not the one whose containers this host knows (it restarted), or it
    broke the protocol's bounds on unsolicited messages: the sandbox's containers are lost."""


class _Lost(Exception):
    """Raised inside the reader loop: the agent is lost, for the reason given."""


class _Pending:
    def __init__(self) -> None:
        self.event = threading.Event()
        self.response: Response | None = None


class AgentClient:
    """Concurrent requests to one guest agent over its virtio-serial channel."""

    def __init__(self, channel: GuestChannel, on_lost: Callable[[str], None] | None = None) -> None:
        self.report: GuestReport = channel.report
        self.instance = channel.report.instance
        """The agent instance this connection serves ("" for agents that have none)."""
        self._conn = channel.take_connection()
        self.label = self._conn.label
        self._on_lost = on_lost
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._pending: dict[str, _Pending] = {}
        self._ids = itertools.count(1)
        self._closed: str | None = None
        self._failure: type[InfrastructureError] = GuestChannelClosed
        self._budget = UnsolicitedBudget(at=time.monotonic())
        if self.report.protocol < 2:
            self._conn.close()
            raise InfrastructureError(
                f"the guest agent on {self.label} speaks protocol {self.report.protocol}; containers need 2"
            )
        self._reader = threading.Thread(target=self._read_loop, name="agent-reader", daemon=True)
        self._reader.start()

    @classmethod
    def open(
        cls,
        socket_path: str | os.PathLike[str],
        timeout_s: float,
        *,
        label: str = "",
        on_lost: Callable[[str], None] | None = None,
    ) -> AgentClient:
        return cls(GuestChannel.open(socket_path, timeout_s, label), on_lost)

    @property
    def closed(self) -> bool:
        """True once the connection is gone (closed, failed or the agent lost): open another client."""
        with self._lock:
            return self._closed is not None

    def _read_loop(self) -> None:
        reason = "closed"
        lost = ""
        try:
            while True:
                msg = self._conn.read(time.monotonic() + _READ_WAIT_S, "a response")
                if isinstance(msg, Response) and msg.id is not None:
                    with self._lock:
                        pending = self._pending.pop(msg.id, None)
                    if pending is not None:
                        pending.response = msg
                        pending.event.set()
                        continue
                self._unsolicited(msg)
        except _Lost as e:
            reason = lost = str(e)
            self._failure = AgentLost
        except ProtocolError as e:
            reason = str(e)
            self._failure = ProtocolError
        except (GuestChannelClosed, GuestChannelTimeout, OSError) as e:
            reason = str(e)
        finally:
            with self._lock:
                self._closed = reason
                waiting = list(self._pending.values())
                self._pending.clear()
            self._conn.close()
            for p in waiting:
                p.event.set()
        if lost and self._on_lost is not None:
            threading.Thread(target=self._on_lost, args=(lost,), name="agent-lost", daemon=True).start()

    def _unsolicited(self, msg: object) -> None:
        """A message no request waits for: a late response, a hello, anything a guest never sends."""
        budget = self._budget.spend(time.monotonic())
        if budget is None:
            raise _Lost(
                f"{self.label}: the guest agent sent more unsolicited messages than the host accepts "
                "(responses nobody asked for, repeated hellos); disconnected"
            )
        self._budget = budget
        if isinstance(msg, Hello):
            if self.instance and msg.report.instance == self.instance:
                with self._send_lock:  # our ack crossed its hello, or it missed the ack: say it again
                    self._conn.send(Ack())
                return
            raise _Lost(
                f"{self.label}: the guest agent started over (it greeted again as instance "
                f"{msg.report.instance or 'unknown'}, this connection's is {self.instance or 'unknown'}): "
                "the containers it ran are lost"
            )

    def _error(self, what: str) -> InfrastructureError:
        return self._failure(f"{what}: {self._closed}")

    def request(self, op: str, args: Mapping[str, object], timeout_s: float) -> Mapping[str, object]:
        """The body of the response to ``op``; GuestRequestFailed when the agent refuses,
        GuestChannelTimeout / GuestChannelClosed when it does not answer, ProtocolError when it
        answered garbage or the request is longer than the agent reads, AgentLost when it is not the
        agent this client connected to."""
        pending = _Pending()
        with self._lock:
            if self._closed is not None:
                raise self._error(f"{op!r} not sent")
            rid = str(next(self._ids))
            self._pending[rid] = pending
        try:
            with self._send_lock:
                self._conn.send(Request(id=rid, op=op, args=args))
        except BaseException:
            with self._lock:
                self._pending.pop(rid, None)
            raise
        if not pending.event.wait(timeout_s):
            with self._lock:
                self._pending.pop(rid, None)
            raise GuestChannelTimeout(f"no response to {op!r} within {timeout_s:g} s on {self.label}")
        response = pending.response
        if response is None:
            raise self._error(f"no response to {op!r}")
        if not response.ok:
            raise GuestRequestFailed(f"{self.label}: the guest refused {op!r}: {response.error}", response.code)
        return response.body

    # ---- typed ops ----------------------------------------------------------------------------

    def create(
        self,
        cid: str,
        *,
        lower: str,
        spec: Mapping[str, object],
        timeout_s: float = 60,
        stdin: bool = False,
        stdin_once: bool = False,
        tty: bool = False,
        image_mounts: Sequence[ImageMount] = (),
    ) -> ContainerState:
        """Creates container ``cid``: overlay of ``lower`` (an image disk, ``disks/SERIAL``, or a
        tree the guest sees shared from the host) and a writable layer; the agent keeps its output
        for ``log_read``; with ``stdin``, a stdin that Attach sessions write to; with ``tty``, a
        terminal (agents of protocol 4 on: an older one is refused here rather than given a
        container without one); ``image_mounts``: its image volumes (agents of protocol 7 on,
        likewise)."""
        if image_mounts and self.report.protocol < IMAGE_MOUNTS_VERSION:
            raise WrongState(
                f"the guest agent on {self.label} speaks protocol {self.report.protocol}, which mounts no image "
                f"volume; an image volume needs protocol {IMAGE_MOUNTS_VERSION} (a guest image built from this "
                "release: recreate the pod)"
            )
        if tty and self.report.protocol < TTY_VERSION:
            raise WrongState(
                f"the guest agent on {self.label} speaks protocol {self.report.protocol}, which gives containers no "
                f"terminal; a container with tty needs protocol {TTY_VERSION} (a guest image built from this release)"
            )
        if _has_userns(spec) and self.report.protocol < USERNS_VERSION:
            raise WrongState(
                f"the guest agent on {self.label} speaks protocol {self.report.protocol}, which does not idmap a "
                f"container's root file system; a container in a user namespace of its pod's own (hostUsers: false) "
                f"needs protocol {USERNS_VERSION} (a guest image built from this release)"
            )
        args: dict[str, object] = {"id": cid, "lower": lower, "spec": dict(spec)}
        if stdin:
            args |= {"stdin": True, "stdin_once": stdin_once}
        if tty:
            args["tty"] = True
        if image_mounts:
            args["image_mounts"] = [m.to_arg() for m in image_mounts]
        body = self.request("create", args, timeout_s)
        return container_state_from_body(body, f"{self.label}: create response")

    def log_read(self, cid: str, offset: int, max_bytes: int, wait_s: float) -> LogChunk:
        """Container ``cid``'s CRI log from stream ``offset`` (the guest may drop what lies
        before it), at most ``max_bytes``, waiting up to ``wait_s`` for output to arrive.
        ProtocolError when the answer lies (see ``log_chunk_from_body``)."""
        args = {"id": cid, "offset": offset, "max_bytes": max_bytes, "wait_ms": int(wait_s * 1000)}
        body = self.request("log_read", args, wait_s + RESPONSE_SLACK_S)
        return log_chunk_from_body(body, offset, max_bytes, "log_read response")

    def start(self, cid: str, timeout_s: float = 60) -> ContainerState:
        return container_state_from_body(self.request("start", {"id": cid}, timeout_s), f"{self.label}: start response")

    def kill(self, cid: str, signal: str, timeout_s: float = 30) -> ContainerState:
        return container_state_from_body(
            self.request("kill", {"id": cid, "signal": signal}, timeout_s), f"{self.label}: kill response"
        )

    def wait(self, cid: str, timeout_s: float) -> ContainerState:
        """The state once the container exited, or when ``timeout_s`` passed (state not exited)."""
        body = self.request("wait", {"id": cid, "timeout_ms": int(timeout_s * 1000)}, timeout_s + RESPONSE_SLACK_S)
        return container_state_from_body(body, f"{self.label}: wait response")

    def status(self, cid: str, timeout_s: float = 30) -> ContainerState:
        return container_state_from_body(
            self.request("status", {"id": cid}, timeout_s), f"{self.label}: status response"
        )

    def list(self, timeout_s: float = 30) -> list[ContainerState]:
        return container_states_from_body(self.request("list", {}, timeout_s), f"{self.label}: list response")

    def delete(self, cid: str, timeout_s: float = 60) -> None:
        self.request("delete", {"id": cid}, timeout_s)

    def exec(self, cid: str, argv: Sequence[str], *, timeout_s: float, max_bytes: int = EXEC_OUTPUT_MAX) -> ExecResult:
        """Runs ``argv`` in the container; timeout_s 0: no timeout."""
        args = {"id": cid, "argv": list(argv), "timeout_ms": int(timeout_s * 1000), "max_bytes": max_bytes}
        wait = (timeout_s or 24 * 3600) + RESPONSE_SLACK_S
        return exec_result_from_body(self.request("exec", args, wait), f"{self.label}: exec response")

    def stats(self, cid: str = "", timeout_s: float = 30) -> CgroupStats:
        """Usage of container ``cid``; of the whole guest when ``cid`` is empty."""
        return stats_from_body(self.request("stats", {"id": cid}, timeout_s), f"{self.label}: stats response")

    def update(self, cid: str, files: Mapping[str, str], timeout_s: float = 30) -> None:
        """Writes cgroup limit files ("memory.max", "cpu.max", ...) of a container."""
        self.request("update", {"id": cid, "files": dict(files)}, timeout_s)

    def cpus_online(self, count: int, timeout_s: float = 30) -> int:
        """Has the guest bring its CPUs online up to ``count`` (present ones it booted offline: a
        resize into the pod's vCPU headroom; none is taken offline); how many it says are online
        after. An agent older than protocol 9 is refused here."""
        if not 1 <= count <= MAX_ONLINE_CPUS:
            raise InternalError(f"cpus_online of {count} CPUs (1 to {MAX_ONLINE_CPUS})")
        if self.report.protocol < CPUS_ONLINE_VERSION:
            raise WrongState(
                f"the guest agent on {self.label} speaks protocol {self.report.protocol}, which cannot bring the "
                f"pod's headroom vCPUs online; that needs protocol {CPUS_ONLINE_VERSION} (a guest image built from "
                "this release: recreate the pod)"
            )
        body = self.request("cpus_online", {"count": count}, timeout_s)
        return cpus_online_from_body(body, f"{self.label}: cpus_online response")

    # ---- copies of the kubelet's atomic-writer volumes (vmsandbox.kubelet_volumes) -------------

    def _volumes_spoken(self) -> None:
        if self.report.protocol < VOLUMES_VERSION:
            raise WrongState(
                f"the guest agent on {self.label} speaks protocol {self.report.protocol}, which takes no ConfigMap, "
                f"Secret, projected or downward API volume; those need protocol {VOLUMES_VERSION} (a guest image "
                "built from this release: recreate the pod)"
            )

    def volume_begin(self, vid: str, version: str, timeout_s: float = 30) -> bool:
        """Starts putting ``version`` of volume ``vid`` into the guest; True when the guest has it
        already (nothing to send)."""
        self._volumes_spoken()
        body = self.request("volume_begin", {"volume": vid, "version": version}, timeout_s)
        current = body.get("current")
        if not isinstance(current, bool):
            raise ProtocolError("volume_begin response: 'current' must be a boolean")
        return current

    def volume_write(self, args: Mapping[str, object], timeout_s: float = 60) -> None:
        """One batch of a version's directories and file parts (``kubelet_volumes.write_batches``)."""
        self.request("volume_write", args, timeout_s)

    def volume_commit(self, args: Mapping[str, object], timeout_s: float = 30) -> None:
        """Makes the staged version the volume's (``kubelet_volumes.commit_args``)."""
        self.request("volume_commit", args, timeout_s)

    def volume_remove(self, vid: str, timeout_s: float = 30) -> None:
        self._volumes_spoken()
        self.request("volume_remove", {"volume": vid}, timeout_s)

    def close(self) -> None:
        self._conn.close()
        self._reader.join(timeout=5)

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            self.close()
