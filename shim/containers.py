"""``Containers``: admitted containers in their pod's guest, and their records through their life.

Container records are admitted and written by ``shim.container_admission`` into
``shim.records``; this owner moves them through their life: created in the guest, running,
exited (exit code, reason, times), removed. It builds each container's OCI spec (the image's
config, the user, the admitted cgroup limits, a ``localhost/`` seccomp profile) and holds the
container's image, and those of its image volumes, from its create until its removal; it keeps
one lock per container for its guest operations, the copy of each container's log from its guest
agent to the kubelet's ``log_directory/log_path`` (through ``shim.log_copy``), and answers status
and stats from the guest. Its parts: the agent connection of each guest (``shim.agent_pool``) and what a
container's guest sees of the host — image disks, volume binds, pod files
(``shim.container_mounts``).

The container RPCs order its single steps (``shim.rpc``: ``create_container``,
``start_container``, ``stop_container``, ``remove_container``, ``update_container_resources``);
each step either succeeds or leaves nothing of itself, and those an RPC may have to undo have
their undo here. At start-up (before the first RPC) it brings containers a killed shim left
half-way through a create or start to one state (``reconcile_with_guests``), holds their images
again and resumes their log copies and volume copies.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from shim.agent_pool import AgentPool
from shim.container_admission import ContainerAdmission
from shim.container_mounts import ContainerMounts
from shim.hot_plug import HotPlug
from shim.image_store import HeldImage, ImageStore
from shim.log_copy import CriLogFile, LogCopies, Sink
from shim.model import (
    CONTAINER_CREATED,
    CONTAINER_EXITED,
    CONTAINER_RUNNING,
    SANDBOX_READY,
    ContainerRecord,
    ImageVolume,
    SandboxRecord,
)
from shim.mount_follow import MountFollower
from shim.pod_volumes import PodVolumes
from shim.sandboxes import Sandboxes
from vmsandbox import oci_spec, validation
from vmsandbox.adapters import agent_streams
from vmsandbox.adapters.agent_client import AgentClient
from vmsandbox.adapters.agent_streams import AgentStream
from vmsandbox.adapters.guest_channel import GuestChannelClosed, GuestRequestFailed
from vmsandbox.adapters.hypervisor import Hypervisor
from vmsandbox.agent_ops import CgroupStats, ContainerState, ExecResult, LogChunk
from vmsandbox.agent_protocol import UNKNOWN_CONTAINER, ImageMount, ProtocolError
from vmsandbox.errors import InfrastructureError, InvalidArgument, NotFound, VmSandboxError, WrongState
from vmsandbox.image_catalogue import ImageRecord
from vmsandbox.sizing import LinuxResources

log = logging.getLogger(__name__)

_SECCOMP_MAX = 1 << 20
_LOG_DRAIN_S = 5.0
"""How long an exit waits for the rest of the container's log to reach the kubelet's file."""


OOM_KILLED = "OOMKilled"
"""The exit reason of a container the guest's kernel killed for memory (the CRI's word)."""


def _exit_reason(st: ContainerState) -> str:
    if st.oom_killed:
        return OOM_KILLED
    return "Completed" if st.exit_code == 0 else "Error"


def _admitted_limits(asked: oci_spec.Resources, linux: LinuxResources) -> oci_spec.Resources:
    """The cgroup limits of a container: what admission recorded (its LinuxContainerResources, or
    what its kubernetes_resources imply), the rest as asked."""
    return replace(
        asked,
        memory_limit_bytes=max(linux.memory_limit_bytes, 0) or asked.memory_limit_bytes,
        cpu_quota_us=max(linux.cpu_quota, 0) or asked.cpu_quota_us,
        cpu_period_us=max(linux.cpu_period, 0) or asked.cpu_period_us,
        cpu_shares=max(linux.cpu_shares, 0) or asked.cpu_shares,
    )


class Containers:
    def __init__(self, state_dir: str, sandboxes: Sandboxes, images: ImageStore, hypervisor: Hypervisor) -> None:
        self.records = sandboxes.records
        self.config = sandboxes.config
        self.dirs = sandboxes.dirs  # each sandbox's directory on the host: made, dropped and swept there
        self.images = images
        self._lock = threading.Lock()  # guards the map of containers' locks
        # the agent connection of each guest; a lost agent turns its sandbox NOTREADY
        self.pool = AgentPool(self.records, hypervisor, sandboxes.reconciler.agent_lost)
        self.logs = LogCopies(state_dir, self.config.log_rate_bytes, self.config.log_burst_bytes)
        self._container_locks: dict[str, threading.Lock] = {}
        self.follow = MountFollower()
        self.volumes = PodVolumes(self.pool.call)
        self.mounts = ContainerMounts(self.config, self.records, hypervisor, self.dirs, self.follow, self.volumes)
        self.admission = ContainerAdmission(self.records, sandboxes.locks)
        # resizes into the pods' headroom (every vCPU's QEMU thread exists from the start: it moved
        # into the pod's cgroup with QEMU, nothing to move after a resize)
        self.hot_plug = HotPlug(hypervisor, self.pool)
        # shim mode: where a container containerd made writes its output (containerd's fifos,
        # ``shim.containerd``); None, or None for a container: the kubelet's log file
        self.stdio_sink: Callable[[ContainerRecord], Sink | None] | None = None

    def forget_lock(self, container_id: str) -> None:
        """A removed container's lock goes with it (the map holds only containers that exist)."""
        with self._lock:
            self._container_locks.pop(container_id, None)

    def lock_for(self, container_id: str) -> threading.Lock:
        """The lock of a container's guest operations (its start, its status from the guest)."""
        with self._lock:
            return self._container_locks.setdefault(container_id, threading.Lock())

    # -- CreateContainer's steps (shim.rpc.create_container) ---------------------------------------
    @staticmethod
    def check_takes_containers(sandbox: SandboxRecord) -> None:
        """A sandbox an earlier version started takes no new container."""
        if sandbox.qemu_uid == 0:
            # made with QEMU as root and every image tree over 9p, before images were disks: its domain
            # has no empty PCIe root port to hot-plug a disk into, and a running domain gains none
            raise WrongState(
                f"sandbox {sandbox.id[:12]} was started by an earlier version of vmsandbox, whose guests get no "
                "image disks: it keeps running what it runs, but takes no new container; recreate the pod "
                "(delete it and let its controller, or the kubelet, start a new sandbox)"
            )

    def hold_image(self, c: ContainerRecord) -> tuple[ImageRecord, HeldImage]:
        """The container's image, held for it (NOT_FOUND when it is not pulled); undo:
        ``ImageStore.release``."""
        image = self.images.get(c.image)
        if image is None:
            raise NotFound(f"image {c.image[:256]!r} is not pulled (PullImage it first)")
        return image, self.images.acquire(image.id, c.id)

    def hold_volume_images(
        self, c: ContainerRecord, volumes: dict[int, ImageVolume]
    ) -> tuple[dict[int, HeldImage], tuple[str, ...]]:
        """The images of the container's image volumes (by the index of their mount), each held for
        it by ``c.volume_holder``, and their ids; NOT_FOUND naming the first not pulled (or
        removed: the same rule as for its own image), and then it holds none of them (undo:
        ``release_volume_images``)."""
        out: dict[int, HeldImage] = {}
        held: list[str] = []
        try:
            for i, v in volumes.items():
                image = self.images.get(v.image)
                if image is None:
                    raise NotFound(f"image {v.image[:256]!r} of an image volume is not pulled (PullImage it first)")
                out[i] = self.images.acquire(image.id, c.volume_holder)
                held.append(image.id)
        except BaseException:
            self.release_volume_images(c, held)
            raise
        return out, tuple(dict.fromkeys(held))

    def release_volume_images(self, c: ContainerRecord, image_ids: Sequence[str]) -> None:
        """The container holds none of ``image_ids`` (its image volumes' images) any more."""
        for image_id in image_ids:
            self.images.release(image_id, c.volume_holder)

    def guest_spec(
        self,
        c: ContainerRecord,
        run: oci_spec.ContainerRequest,
        user_spec: str,
        stop_signal: str,
        image: ImageRecord,
        held: HeldImage,
    ) -> tuple[dict[str, object], str]:
        """The OCI spec the guest runs the container by (``run.mounts``: the guest's mounts), and
        the signal that stops it."""
        spec_img = image.spec
        image_cfg = oci_spec.ImageConfig(
            entrypoint=tuple(spec_img.get("entrypoint", ())),
            cmd=tuple(spec_img.get("cmd", ())),
            env=tuple(spec_img.get("env", ())),
            working_dir=str(spec_img.get("working_dir", "")),
            user=image.user,
            stop_signal=str(spec_img.get("stop_signal", "")),
        )
        user = oci_spec.parse_user(user_spec or image.user, list(held.passwd), list(held.group))
        signal = oci_spec.stop_signal(stop_signal, image_cfg)
        # a profile given as it is (shim mode: the one containerd resolved), else the file's
        profile = run.seccomp_profile if run.seccomp_profile is not None else self._seccomp_document(run.seccomp)
        run = replace(run, resources=_admitted_limits(run.resources, c.linux), seccomp_profile=profile)
        return oci_spec.build_spec(run, image_cfg, user), signal

    def create_in_guest(
        self,
        c: ContainerRecord,
        lower: str,
        spec: dict[str, object],
        run: oci_spec.ContainerRequest,
        image_mounts: Sequence[ImageMount] = (),
    ) -> None:
        """The guest makes the container, its image volumes mounted from their disks (undo:
        ``delete_in_guest``)."""
        self.pool.call(
            c.sandbox_id,
            "create",
            c.id,
            lower=lower,
            spec=spec,
            stdin=run.stdin,
            stdin_once=run.stdin_once,
            tty=run.tty,
            **({"image_mounts": tuple(image_mounts)} if image_mounts else {}),
        )

    def delete_in_guest(self, c: ContainerRecord) -> None:
        """The guest deletes the container (killing it if it runs; one it does not have is deleted
        already); a guest that refuses or does not answer keeps it until the pod goes (logged)."""
        try:
            self.pool.call(c.sandbox_id, "delete", c.id)
        except GuestRequestFailed as exc:
            if exc.code != UNKNOWN_CONTAINER:
                log.warning("container %s: not deleted in its guest: %s", c.id[:12], exc)
        except InfrastructureError as exc:
            log.warning("container %s: not deleted in its guest: %s", c.id[:12], exc)

    def mark_created(
        self,
        c: ContainerRecord,
        sandbox: SandboxRecord,
        image: ImageRecord,
        signal: str,
        run: oci_spec.ContainerRequest,
        net_bind_service: bool,
        volume_images: Sequence[str] = (),
    ) -> ContainerRecord:
        """The record names the container's image (and its image volumes' images): it exists in its
        guest (a record naming none is one whose CreateContainer never answered:
        ``reconcile_with_guests``)."""
        created = replace(
            c,
            image_id=image.id,
            image_ref=image.repo_digests[0] if image.repo_digests else image.id,
            log_directory=sandbox.log_directory,
            stop_signal=signal,
            tty=run.tty,
            reason="Created",
            message="",
            net_bind_service=net_bind_service,
            volume_copies=self.volumes.used_by(sandbox.id, c.id),
            volume_images=tuple(volume_images),
        )
        self.records.save_container(created)
        return created

    def _seccomp_document(self, profile: str) -> object:
        """The parsed file of a ``localhost/<path>`` seccomp profile: only under the configured
        profile root (symlinks resolved), at most 1 MiB, JSON; None for other profiles."""
        if not profile.startswith("localhost/"):
            return None
        ref = profile.removeprefix("localhost/")
        root = Path(self.config.seccomp_profile_root)
        path = Path(os.path.realpath(root / ref))  # an absolute ref stays itself; a relative one is under root
        shown = validation.quote(ref)
        if not path.is_relative_to(os.path.realpath(root)):
            raise InvalidArgument(f"seccomp profile {shown} is outside {root}, where Localhost profiles are read from")
        try:
            with open(path, "rb") as f:
                data = f.read(_SECCOMP_MAX + 1)
        except OSError as exc:
            raise InvalidArgument(f"seccomp profile {shown} cannot be read: {exc.strerror}") from None
        if len(data) > _SECCOMP_MAX:
            raise InvalidArgument(f"seccomp profile {shown} is larger than {_SECCOMP_MAX} bytes")
        try:
            return json.loads(data)
        except ValueError as exc:
            raise InvalidArgument(f"seccomp profile {shown} is not JSON: {str(exc)[:200]}") from None

    # -- StartContainer's steps (shim.rpc.start_container) -------------------------------------------
    @staticmethod
    def check_startable(c: ContainerRecord) -> None:
        if c.state != CONTAINER_CREATED:
            raise WrongState(f"container {c.id[:12]} is {c.state}, not created: it can start only once")
        if not c.image_id:
            raise InfrastructureError(f"container {c.id[:12]} was not created in its guest")

    def start_in_guest(self, c: ContainerRecord) -> ContainerState:
        """The guest starts the container (undo: ``kill_in_guest``)."""
        st = self.pool.call(c.sandbox_id, "start", c.id)
        assert isinstance(st, ContainerState)
        return st

    def kill_in_guest(self, c: ContainerRecord) -> None:
        """Undo of a start: the guest kills the container (one it refuses to kill has exited); a
        guest that does not answer raises, so the start's earlier steps stay for the reconcile."""
        with contextlib.suppress(GuestRequestFailed):
            self.pool.call(c.sandbox_id, "kill", c.id, "KILL")

    def mark_running(self, c: ContainerRecord, st: ContainerState) -> ContainerRecord:
        """The record says RUNNING, with the host's time of the start (undo: ``mark_not_running``)."""
        # the guest's clock is its own (set from the RTC at boot, then free-running under TCG): times
        # reported to the kubelet are the host's, so that created <= started <= finished holds
        started = time.time_ns()
        offset = started - st.started_at_ns if st.started_at_ns else 0
        running = self.records.change_container(
            c.id,
            expect_state=CONTAINER_CREATED,
            state=CONTAINER_RUNNING,
            started_ns=started,
            guest_clock_offset_ns=offset,
            reason="",
        )
        return running or self.records.resolve_container(c.id)

    def mark_not_running(self, c: ContainerRecord) -> None:
        """Undo of ``mark_running``: the record says what it said before (``c``)."""
        self.records.change_container(
            c.id,
            expect_state=CONTAINER_RUNNING,
            state=c.state,
            started_ns=c.started_ns,
            guest_clock_offset_ns=c.guest_clock_offset_ns,
            reason=c.reason,
        )

    def start_log_copy(self, c: ContainerRecord) -> None:
        """Copying of the container's log to the kubelet's file (undo: ``LogCopies.stop``)."""
        dst: Sink | None = self.stdio_sink(c) if self.stdio_sink is not None else None
        if dst is None and c.log_path:
            dst = CriLogFile(
                Path(c.log_path) if c.log_path.startswith("/") else Path(c.log_directory or "/") / c.log_path
            )
        sandbox_id, cid = c.sandbox_id, c.id

        def read(offset: int, max_bytes: int, wait_s: float) -> LogChunk:
            chunk = self.pool.call(sandbox_id, "log_read", cid, offset, max_bytes, wait_s)
            assert isinstance(chunk, LogChunk)
            return chunk

        self.logs.start(cid, dst, read, tty=c.tty)

    def resume_logs(self) -> int:
        """At start-up: copying of every running container's log carries on from where the shim
        that ran before stopped (the guest kept the containers and their output); returns how many."""
        ready = {s.id for s in self.records.list_sandboxes() if s.state == SANDBOX_READY}
        resumed = 0
        self.logs.sweep({c.id for c in self.records.containers()})
        for c in self.records.containers():
            if c.state == CONTAINER_RUNNING and c.sandbox_id in ready:
                self.start_log_copy(c)
                resumed += 1
        return resumed

    def reconcile_with_guests(self) -> dict[str, list[str]]:
        """At start-up, before the first RPC: a container that a killed shim left half-way through
        CreateContainer or StartContainer is brought to one state its guest and the CRI agree on.
        One whose CreateContainer never answered (its record names no image: the caller never got
        its id) is deleted from its guest and forgotten, so the kubelet's retry creates it afresh;
        one its guest started is RUNNING. Returns the ids of each kind."""
        report: dict[str, list[str]] = {"forgotten": [], "started": []}
        pending: dict[str, list[ContainerRecord]] = {}
        for c in self.records.containers():
            if c.state == CONTAINER_CREATED:
                pending.setdefault(c.sandbox_id, []).append(c)
        ready = {s.id: s for s in self.records.list_sandboxes() if s.state == SANDBOX_READY}
        for sandbox_id, containers in pending.items():
            sandbox = ready.get(sandbox_id)
            if sandbox is None:
                continue
            try:  # a guest that does not answer soon must not hold up the start
                in_guest = {st.id: st for st in self.pool.client(sandbox_id, 5.0).list(timeout_s=5.0)}
            except VmSandboxError as exc:
                log.warning("sandbox %s: its containers were not checked with its guest: %s", sandbox_id[:12], exc)
                continue
            for c in containers:
                st = in_guest.get(c.id)
                if not c.image_id:  # it holds no image, and no volume copy yet: its guest side and place go
                    if st is not None:
                        self.pool.call(sandbox_id, "delete", c.id)
                    self.logs.forget(c.id)
                    self.mounts.drop_container_dir(sandbox, c.id)
                    self.records.remove_container(c.id)
                    self.forget_lock(c.id)
                    report["forgotten"].append(c.id)
                    log.info("container %s: its CreateContainer never answered; forgotten", c.id[:12])
                elif st is not None and st.state != "created":
                    started = time.time_ns()
                    offset = started - st.started_at_ns if st.started_at_ns else 0
                    self.records.change_container(
                        c.id,
                        expect_state=CONTAINER_CREATED,
                        state=CONTAINER_RUNNING,
                        started_ns=started,
                        guest_clock_offset_ns=offset,
                        reason="",
                    )
                    report["started"].append(c.id)
                    log.info("container %s: its guest had started it; it is running", c.id[:12])
        return report

    def resume_volumes(self) -> int:
        """At start-up: the copies of atomic-writer volumes that running guests keep for their
        containers (as the records say) are kept current again; returns how many containers use one."""
        ready = {s.id: s for s in self.records.list_sandboxes() if s.state == SANDBOX_READY}
        users = 0
        for c in self.records.containers():
            if c.volume_copies and c.sandbox_id in ready:
                self.volumes.adopt(c.sandbox_id, c.id, c.volume_copies, ready[c.sandbox_id].userns)
                users += 1
        self.volumes.start()
        return users

    def hold_images(self) -> int:
        """At start-up: every container the ledger keeps holds its image again, as it did in the shim
        that ran before (RemoveContainer, or its sandbox's removal, releases it); returns how many."""
        held = 0
        for c in self.records.containers():
            if not c.image_id:
                continue
            try:
                self.images.acquire(c.image_id, c.id)
                held += 1
            except NotFound:
                log.warning("container %s: its image %s is not stored any more", c.id[:12], c.image_id)
            for image_id in c.volume_images:  # its image volumes' images, likewise
                try:
                    self.images.acquire(image_id, c.volume_holder)
                except NotFound:
                    log.warning("container %s: its volume's image %s is not stored any more", c.id[:12], image_id)
        return held

    @staticmethod
    def asks_guest(c: ContainerRecord) -> bool:
        """Whether ``refresh`` asks the guest about ``c`` (else its record is its whole state)."""
        return c.state != CONTAINER_EXITED and bool(c.image_id)

    def refresh(self, c: ContainerRecord, sandbox: SandboxRecord | None = None) -> ContainerRecord:
        """``c`` brought up to date with its guest (exit code, reason, finish time); ``sandbox``:
        its pod's record, when the caller has it."""
        if not self.asks_guest(c):
            return c
        try:
            st = self.pool.call(c.sandbox_id, "status", c.id)
        except VmSandboxError as e:
            now = self.records.resolve_container(c.id)  # its guest's death or a lost agent may be recorded
            if now.state == CONTAINER_EXITED:
                return now
            if self.records.get(c.sandbox_id).state == SANDBOX_READY:
                if isinstance(e, ProtocolError):
                    raise  # the guest answered, with garbage: say so (UNAVAILABLE), do not guess
                # the guest does not answer; if it died, libvirt's event marks the sandbox soon
                log.warning("container %s: no status from its guest: %s", c.id[:12], e)
                return c
            return self._exited(now, sandbox, 255, "SandboxDied", f"the pod's guest is gone: {e}")
        assert isinstance(st, ContainerState)
        if st.state != "exited":
            return c
        finished = st.finished_at_ns + c.guest_clock_offset_ns if st.finished_at_ns and c.guest_clock_offset_ns else 0
        return self._exited(
            c, sandbox, st.exit_code, _exit_reason(st), "", max(finished, c.started_ns) if finished else 0
        )

    def _exited(
        self, c: ContainerRecord, sandbox: SandboxRecord | None, code: int, reason: str, message: str, at: int = 0
    ) -> ContainerRecord:
        if reason == "SandboxDied":
            self.logs.stop(c.id)
        else:  # what it wrote last reaches the kubelet's file before its exit is reported
            self.logs.finish(c.id, _LOG_DRAIN_S)
        sandbox = sandbox or self.records.find(c.sandbox_id)
        try:  # nothing runs with its volumes any more: let go of the host's files now
            if sandbox is not None:
                self.mounts.unbind_container(sandbox, c.id)
        except VmSandboxError as exc:
            log.warning("container %s exited; its volumes stay bound until it is removed: %s", c.id[:12], exc)
        done = replace(
            c, state=CONTAINER_EXITED, exit_code=code, reason=reason, message=message, finished_ns=at or time.time_ns()
        )
        self.records.save_container(done)
        return done

    # -- StopContainer's steps (shim.rpc.stop_container) ---------------------------------------------
    def stop_in_guest(self, c: ContainerRecord, timeout_s: int) -> None:
        """The container's stop signal, then SIGKILL if it still runs after ``timeout_s`` (a guest
        that refuses, because it exited meanwhile, is fine)."""
        with contextlib.suppress(GuestRequestFailed):
            self.pool.call(c.sandbox_id, "kill", c.id, c.stop_signal or "TERM")
            st = self.pool.call(c.sandbox_id, "wait", c.id, timeout_s=max(timeout_s, 0))
            assert isinstance(st, ContainerState)
            if st.state != "exited":
                self.pool.call(c.sandbox_id, "kill", c.id, "KILL")
                self.pool.call(c.sandbox_id, "wait", c.id, timeout_s=30)

    def record_stop(self, c: ContainerRecord, sandbox: SandboxRecord) -> ContainerRecord:
        """The container's exit as its guest says it (``refresh``); one that never ran in its guest
        is EXITED as stopped before it started."""
        c = self.refresh(c, sandbox)
        if c.state != CONTAINER_EXITED and (not c.image_id or c.state == CONTAINER_CREATED):
            reason = "Completed" if c.state == CONTAINER_CREATED else "Error"
            return self._exited(c, sandbox, 0, reason, "stopped before it started")
        return c

    def sandbox_stopped(self, sandbox_id: str) -> None:
        """The sandbox's guest is gone (StopPodSandbox): stop copying its logs, drop its connection.
        Image holds stay until its containers (or the sandbox) are removed."""
        self.follow.forget(sandbox_id)
        self.volumes.forget_sandbox(sandbox_id)
        self.logs.stop(*(c.id for c in self.records.containers(sandbox_id)))
        self.pool.drop(sandbox_id)

    def sandbox_removed(self, sandbox_id: str) -> None:
        """Forget a removed sandbox's guest: its connection, log copies and shared directory."""
        self.pool.forget(sandbox_id)
        for c in self.records.containers(sandbox_id):
            self.forget_lock(c.id)
            self.logs.forget(c.id)
            if c.image_id:
                self.images.release(c.image_id, c.id)
            self.release_volume_images(c, c.volume_images)
        self.pool.drop(sandbox_id)
        self.dirs.drop(sandbox_id)
        self.mounts.forget_sandbox(sandbox_id)

    def reopen_log(self, container_id: str) -> None:
        c = self.records.container(container_id)
        if c.state != CONTAINER_RUNNING:
            raise WrongState(f"container {c.id[:12]} is not running: its log is not being written")
        self.logs.reopen(c.id)

    def exec_sync(self, container_id: str, argv: list[str], timeout_s: int, max_bytes: int) -> ExecResult:
        c = self.refresh(self.records.container(container_id))
        if c.state != CONTAINER_RUNNING:
            raise WrongState(f"container {container_id[:12]} is not running: nothing to exec into")
        if not argv:
            raise InvalidArgument("ExecSync: cmd is empty")
        self.follow.catch_up(c.sandbox_id)  # what the host mounted below its volumes until now is there
        res = self.pool.call(c.sandbox_id, "exec", c.id, argv, timeout_s=timeout_s, max_bytes=max_bytes)
        assert isinstance(res, ExecResult)
        return res

    def proc_start(self, container_id: str, argv: list[str], *, tty: bool, stdin: bool) -> AgentStream:
        """A process started in the running container for a streaming Exec (``shim.streaming``).
        The record's state is enough here: the agent refuses a container that is not running."""
        c = self.records.container(container_id)
        if c.state != CONTAINER_RUNNING:
            raise WrongState(f"container {container_id[:12]} is not running: nothing to exec into")
        self.follow.catch_up(c.sandbox_id)
        return self._open_stream(
            c.sandbox_id, lambda client: agent_streams.proc_start(client, c.id, argv, tty=tty, stdin=stdin)
        )

    def attach_start(self, container_id: str) -> AgentStream:
        """A session on the running container's own stdio for an Attach."""
        c = self.records.container(container_id)
        if c.state != CONTAINER_RUNNING:
            raise WrongState(f"container {container_id[:12]} is not running: nothing to attach to")
        return self._open_stream(c.sandbox_id, lambda client: agent_streams.attach_open(client, c.id))

    def _open_stream(self, sandbox_id: str, open_: Callable[[AgentClient], AgentStream]) -> AgentStream:
        """A stream session opened on the guest's connection; on a new connection when that one had
        closed (the session is bound to the connection that opened it)."""
        try:
            return open_(self.pool.client(sandbox_id))
        except GuestChannelClosed:
            self.pool.drop(sandbox_id)
            return open_(self.pool.client(sandbox_id))

    def stats(self, container_id: str) -> CgroupStats | None:
        """The running container's usage; None when it is not running or its guest gives no valid
        answer (one guest's refusal or malformed answer must not fail a list of every pod's stats)."""
        c = self.records.container(container_id)
        return self._guest_stats(c) if c.state == CONTAINER_RUNNING else None

    def _guest_stats(self, c: ContainerRecord) -> CgroupStats | None:
        """What the container's guest answers to ``stats``; None when it refuses, answers badly or is gone."""
        try:
            res = self.pool.call(c.sandbox_id, "stats", c.id)
        except (GuestRequestFailed, InfrastructureError, NotFound) as exc:
            log.debug("container %s: no usage: %s", c.id[:12], exc)
            return None
        assert isinstance(res, CgroupStats)
        return res

    def writable_usage(self) -> tuple[int, int]:
        """(bytes, inodes) of every container's writable layer (in its guest's memory), created,
        running or exited, until it is removed; guests that do not answer are left out."""
        used = inodes = 0
        ready = {s.id for s in self.records.list_sandboxes() if s.state == SANDBOX_READY}
        for c in self.records.containers():
            if not c.image_id or c.sandbox_id not in ready:
                continue  # not created in a guest, or its guest is gone
            s = self._guest_stats(c)
            if s is None:
                continue
            used += s.writable_bytes
            inodes += s.writable_inodes
        return used, inodes

    def sandbox_stats(self, sandbox_id: str) -> CgroupStats | None:
        """The whole guest's usage; None when its guest gives no valid answer (as ``stats``)."""
        try:
            res = self.pool.call(sandbox_id, "stats", "")
        except (GuestRequestFailed, InfrastructureError) as exc:
            log.info("sandbox %s: no usage: %s", sandbox_id[:12], exc)
            return None
        assert isinstance(res, CgroupStats)
        return res

    def apply_limits(self, c: ContainerRecord) -> None:
        """The guest applies the container's (admitted) cgroup limits, as ``c`` records them."""
        if c.state not in (CONTAINER_RUNNING, CONTAINER_CREATED) or not c.image_id:
            return
        linux = c.linux
        files: dict[str, str] = {}
        if linux.memory_limit_bytes:
            files["memory.max"] = str(linux.memory_limit_bytes)
        quota, period = linux.cpu_quota, linux.cpu_period or 100_000
        if quota > 0:
            files["cpu.max"] = f"{quota} {period}"
        shares = linux.cpu_shares
        if shares:
            # the cgroup v1 -> v2 conversion crun and runc use
            files["cpu.weight"] = str(1 + ((shares - 2) * 9999) // 262142)
        if files:
            self.pool.call(c.sandbox_id, "update", c.id, files)

    def close(self) -> None:
        self.follow.close()
        self.volumes.close()
        self.logs.close()
        self.pool.close()
