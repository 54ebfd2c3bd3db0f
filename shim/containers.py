"""``Containers``: runs admitted containers in their pod's guest and moves their records through their life.

Container records (admission, names) are written by ``shim.sandboxes`` into ``shim.records``;
this owner moves them through their life: created in the guest, running, exited (exit code,
reason, times), removed. It builds each container's OCI spec (the image's config, the user, the
admitted cgroup limits, a ``localhost/`` seccomp profile) and holds the container's image from
its create until its removal; it keeps one lock per container for its guest operations, the copy
of each container's log from its guest agent to the kubelet's ``log_directory/log_path``
(through ``shim.log_copy``), and answers stats from the guest. Its parts: the agent connection
of each guest (``shim.agent_pool``) and what a container's guest sees of the host — image
disks, volume binds, pod files (``shim.container_mounts``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from shim import faults
from shim.agent_pool import AgentPool
from shim.container_mounts import ContainerMounts, hugepage_mounts
from shim.image_store import ImageStore
from shim.log_copy import LogCopies
from shim.model import (
    CONTAINER_CREATED,
    CONTAINER_EXITED,
    CONTAINER_RUNNING,
    SANDBOX_READY,
    ContainerRecord,
    MountRequest,
)
from shim.mount_follow import MountFollower
from shim.pod_volumes import PodVolumes
from shim.sandboxes import Sandboxes
from vmsandbox import oci_spec, validation
from vmsandbox.adapters import agent_streams, shared_tree
from vmsandbox.adapters.agent_client import AgentClient
from vmsandbox.adapters.agent_streams import AgentStream
from vmsandbox.adapters.guest_channel import GuestChannelClosed, GuestChannelTimeout, GuestRequestFailed
from vmsandbox.adapters.hypervisor import Hypervisor
from vmsandbox.agent_ops import CgroupStats, ContainerState, ExecResult, LogChunk
from vmsandbox.agent_protocol import ProtocolError
from vmsandbox.errors import InfrastructureError, InvalidArgument, NotFound, VmSandboxError, WrongState
from vmsandbox.sizing import LinuxResources

log = logging.getLogger(__name__)

_SECCOMP_MAX = 1 << 20
_LOG_DRAIN_S = 5.0
"""How long an exit waits for the rest of the container's log to reach the kubelet's file."""


def _exit_reason(st: ContainerState) -> str:
    if st.oom_killed:
        return "OOMKilled"
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

    def _forget_lock(self, container_id: str) -> None:
        """A removed container's lock goes with it (the map holds only containers that exist)."""
        with self._lock:
            self._container_locks.pop(container_id, None)

    def _lock_for(self, container_id: str) -> threading.Lock:
        with self._lock:
            return self._container_locks.setdefault(container_id, threading.Lock())

    # -- lifecycle ------------------------------------------------------------------------------
    def create(
        self,
        container_id: str,
        request: oci_spec.ContainerRequest,
        user_spec: str,
        stop_signal: str,
        mounts: list[MountRequest],
    ) -> None:
        """Creates an admitted container in its guest (its record exists, state CREATED)."""
        faults.checkpoint("create:after-admit")
        c = self.records.container(container_id)
        sandbox = self.records.get(c.sandbox_id)
        if sandbox.qemu_uid == 0:
            # made with QEMU as root and every image tree over 9p, before images were disks: its domain
            # has no empty PCIe root port to hot-plug a disk into, and a running domain gains none
            raise WrongState(
                f"sandbox {sandbox.id[:12]} was started by an earlier version of vmsandbox, whose guests get no "
                "image disks: it keeps running what it runs, but takes no new container; recreate the pod "
                "(delete it and let its controller, or the kubelet, start a new sandbox)"
            )
        image = self.images.get(c.image)
        if image is None:
            raise NotFound(f"image {c.image[:256]!r} is not pulled (PullImage it first)")
        held = self.images.acquire(image.id, container_id)
        disk_attached: bool | None = None  # None: the disk is not counted as used by this create
        try:
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
            shared_tree.make_dirs(self.dirs.shared(c.sandbox_id), f"containers/{container_id}")
            guest_mounts = self.mounts.share_mounts(c.sandbox_id, container_id, mounts)
            guest_mounts += self.mounts.pod_file_mounts(sandbox, {m.destination for m in guest_mounts})
            guest_mounts += hugepage_mounts(c.linux, guest_mounts)
            run = replace(
                request,
                mounts=guest_mounts,
                resources=_admitted_limits(request.resources, c.linux),
                seccomp_profile=self._seccomp_document(request.seccomp),
            )
            spec = oci_spec.build_spec(run, image_cfg, user)
            lower, disk_attached = self.mounts.attach_image(c.sandbox_id, held)
            self.pool.call(
                c.sandbox_id,
                "create",
                container_id,
                lower=lower,
                spec=spec,
                stdin=request.stdin,
                stdin_once=request.stdin_once,
                tty=request.tty,
            )
            faults.checkpoint("create:after-guest")
        except BaseException:
            if disk_attached is not None:
                self.mounts.detach_unused(c.sandbox_id, held, disk_attached)
            self.images.release(image.id, container_id)
            self.volumes.release(c.sandbox_id, container_id)
            self.mounts.drop_container_dir(c.sandbox_id, container_id)
            raise
        ref = image.repo_digests[0] if image.repo_digests else image.id
        self.records.save_container(
            replace(
                c,
                image_id=image.id,
                image_ref=ref,
                log_directory=sandbox.log_directory,
                stop_signal=signal,
                tty=request.tty,
                reason="Created",
                message="",
                volume_copies=self.volumes.used_by(c.sandbox_id, container_id),
            )
        )

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

    def start(self, container_id: str) -> None:
        container_id = self.records.container(container_id).id  # a client's prefix names one lock, one path
        with self._lock_for(container_id):
            c = self.records.container(container_id)
            if c.state != CONTAINER_CREATED:
                raise WrongState(f"container {container_id[:12]} is {c.state}, not created: it can start only once")
            if not c.image_id:
                raise InfrastructureError(f"container {container_id[:12]} was not created in its guest")
            self._start_pump(c)
            st = self.pool.call(c.sandbox_id, "start", container_id)
            assert isinstance(st, ContainerState)
            faults.checkpoint("start:after-guest")
            # the guest's clock is its own (set from the RTC at boot, then free-running under TCG): times
            # reported to the kubelet are the host's, so that created <= started <= finished holds
            started = time.time_ns()
            offset = started - st.started_at_ns if st.started_at_ns else 0
            self.records.change_container(
                container_id,
                expect_state=CONTAINER_CREATED,
                state=CONTAINER_RUNNING,
                started_ns=started,
                guest_clock_offset_ns=offset,
                reason="",
            )

    def _start_pump(self, c: ContainerRecord) -> None:
        dst = None
        if c.log_path:
            dst = Path(c.log_path) if c.log_path.startswith("/") else Path(c.log_directory or "/") / c.log_path
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
                self._start_pump(c)
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
        ready = {s.id for s in self.records.list_sandboxes() if s.state == SANDBOX_READY}
        for sandbox_id, containers in pending.items():
            if sandbox_id not in ready:
                continue
            try:  # a guest that does not answer soon must not hold up the start
                in_guest = {st.id: st for st in self.pool.client(sandbox_id, 5.0).list(timeout_s=5.0)}
            except VmSandboxError as exc:
                log.warning("sandbox %s: its containers were not checked with its guest: %s", sandbox_id[:12], exc)
                continue
            for c in containers:
                st = in_guest.get(c.id)
                if not c.image_id:
                    if st is not None:
                        self.pool.call(sandbox_id, "delete", c.id)
                    self.remove(c.id)
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
        ready = {s.id for s in self.records.list_sandboxes() if s.state == SANDBOX_READY}
        users = 0
        for c in self.records.containers():
            if c.volume_copies and c.sandbox_id in ready:
                self.volumes.adopt(c.sandbox_id, c.id, c.volume_copies)
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
        return held

    @staticmethod
    def asks_guest(c: ContainerRecord) -> bool:
        """Whether ``refresh`` asks the guest about ``c`` (else its record is its whole state)."""
        return c.state != CONTAINER_EXITED and bool(c.image_id)

    def refresh(self, container_id: str) -> ContainerRecord:
        """The record, brought up to date with the guest (exit code, reason, finish time)."""
        c = self.records.container(container_id)
        container_id = c.id  # the full id, never the client's prefix, goes to the guest
        if not self.asks_guest(c):
            return c
        try:
            st = self.pool.call(c.sandbox_id, "status", container_id)
        except VmSandboxError as e:
            now = self.records.container(container_id)  # its guest's death or a lost agent may be recorded
            if now.state == CONTAINER_EXITED:
                return now
            if self.records.get(c.sandbox_id).state == SANDBOX_READY:
                if isinstance(e, ProtocolError):
                    raise  # the guest answered, with garbage: say so (UNAVAILABLE), do not guess
                # the guest does not answer; if it died, libvirt's event marks the sandbox soon
                log.warning("container %s: no status from its guest: %s", container_id[:12], e)
                return c
            return self._exited(now, 255, "SandboxDied", f"the pod's guest is gone: {e}")
        assert isinstance(st, ContainerState)
        if st.state != "exited":
            return c
        finished = st.finished_at_ns + c.guest_clock_offset_ns if st.finished_at_ns and c.guest_clock_offset_ns else 0
        return self._exited(c, st.exit_code, _exit_reason(st), "", max(finished, c.started_ns) if finished else 0)

    def _exited(self, c: ContainerRecord, code: int, reason: str, message: str, at: int = 0) -> ContainerRecord:
        if reason == "SandboxDied":
            self.logs.stop(c.id)
        else:  # what it wrote last reaches the kubelet's file before its exit is reported
            self.logs.finish(c.id, _LOG_DRAIN_S)
        try:  # nothing runs with its volumes any more: let go of the host's files now
            self.mounts.unbind_container(c.sandbox_id, c.id)
        except VmSandboxError as exc:
            log.warning("container %s exited; its volumes stay bound until it is removed: %s", c.id[:12], exc)
        done = replace(
            c, state=CONTAINER_EXITED, exit_code=code, reason=reason, message=message, finished_ns=at or time.time_ns()
        )
        self.records.save_container(done)
        return done

    def stop(self, container_id: str, timeout_s: int) -> None:
        if not validation.teardown_id(container_id, "container_id"):
            return  # not an id of ours: nothing to stop, as containerd answers
        try:
            c = self.refresh(container_id)
        except NotFound:
            return
        container_id = c.id  # the full id, never the client's prefix, goes to the guest
        if c.state == CONTAINER_EXITED:
            return
        if not c.image_id or c.state == CONTAINER_CREATED:
            self._exited(c, 0, "Completed" if c.state == CONTAINER_CREATED else "Error", "stopped before it started")
            return
        with contextlib.suppress(GuestRequestFailed):
            self.pool.call(c.sandbox_id, "kill", container_id, c.stop_signal or "TERM")
            st = self.pool.call(c.sandbox_id, "wait", container_id, timeout_s=max(timeout_s, 0))
            assert isinstance(st, ContainerState)
            if st.state != "exited":
                self.pool.call(c.sandbox_id, "kill", container_id, "KILL")
                self.pool.call(c.sandbox_id, "wait", container_id, timeout_s=30)
        self.refresh(container_id)

    def remove(self, container_id: str) -> str | None:
        """Removes a container from its guest and the ledger; returns its full id (None: nothing to
        remove, which succeeds, as containerd answers)."""
        if not validation.teardown_id(container_id, "container_id"):
            return None  # not an id of ours
        try:
            c = self.records.container(container_id)
        except NotFound:
            return None
        container_id = c.id  # the full id, never the client's prefix, names the guest's container and our paths
        if c.image_id:
            with contextlib.suppress(GuestRequestFailed, GuestChannelClosed, GuestChannelTimeout, InfrastructureError):
                self.pool.call(c.sandbox_id, "delete", container_id)
        self.logs.forget(container_id)
        self.volumes.release(c.sandbox_id, container_id)
        self.mounts.drop_container_dir(c.sandbox_id, container_id)
        self.records.remove_container(container_id)
        if c.image_id:
            self.images.release(c.image_id, container_id)
        self._forget_lock(container_id)
        return container_id

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
            self._forget_lock(c.id)
            self.logs.forget(c.id)
            if c.image_id:
                self.images.release(c.image_id, c.id)
        self.pool.drop(sandbox_id)
        self.dirs.drop(sandbox_id)
        self.mounts.forget_sandbox(sandbox_id)

    def reopen_log(self, container_id: str) -> None:
        c = self.records.container(container_id)
        if c.state != CONTAINER_RUNNING:
            raise WrongState(f"container {c.id[:12]} is not running: its log is not being written")
        self.logs.reopen(c.id)

    def exec_sync(self, container_id: str, argv: list[str], timeout_s: int, max_bytes: int) -> ExecResult:
        c = self.refresh(container_id)
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

    def update(self, container_id: str, linux: LinuxResources) -> None:
        """Applies a container's (admitted) cgroup limits in the guest."""
        c = self.records.container(container_id)
        if c.state not in (CONTAINER_RUNNING, CONTAINER_CREATED) or not c.image_id:
            return
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
