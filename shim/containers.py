"""``Containers``: runs admitted containers in their pod's guest and owns what that takes on the
host — the hold on each container's image and the image's read-only disk in the pod's guest
(hot-plugged when the pod's first container of that image is created), the agent connection of
each guest, each container's place and volume binds in the pod's share (the directory itself is
``shim.sandbox_dirs``'), the copy of each container's log from its guest agent to the kubelet's
``log_directory/log_path`` (through ``shim.log_copy``), the pod's ``resolv.conf`` and
``hostname`` files its containers share, and which volumes follow the host's later mounts below
their sources (through ``shim.mount_follow``).

Container records (admission, names, state) are kept by ``shim.records``; this owner moves them
through their life: created in the guest, running, exited (exit code, reason, times), removed.

It also holds the guest's word against the records: a connection to an agent instance other than
the one that reported at RunPodSandbox, a hello from a new instance on a live connection, or an
agent that does not know a container recorded as created or running means the agent lost its
containers, and ``Reconciler.agent_lost`` turns the sandbox NOTREADY.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import threading
import time
from dataclasses import replace
from pathlib import Path

from shim import faults
from shim.images import HeldImage, ImageStore
from shim.log_copy import LogCopies
from shim.model import (
    CONTAINER_CREATED,
    CONTAINER_EXITED,
    CONTAINER_RUNNING,
    SANDBOX_READY,
    ContainerRecord,
    MountRequest,
    SandboxRecord,
)
from shim.mount_follow import MountFollower
from shim.pod_volumes import PodVolumes
from shim.sandboxes import Sandboxes
from vmsandbox import hugetlbfs, kubelet_volumes, oci_spec, validation
from vmsandbox.adapters import binds, shared_tree
from vmsandbox.adapters.agent_client import AgentClient, AgentLost
from vmsandbox.adapters.guest_channel import GuestChannelClosed, GuestChannelTimeout, GuestRequestFailed
from vmsandbox.adapters.hypervisor import Hypervisor
from vmsandbox.agent_protocol import (
    PROC_WRITE_MAX,
    UNKNOWN_CONTAINER,
    CgroupStats,
    ContainerState,
    ExecResult,
    LogChunk,
    ProcOutput,
    ProtocolError,
)
from vmsandbox.domain import AGENT_CHANNEL, IMAGE_DISK_SLOTS, ImageDiskDevice, free_disk_target
from vmsandbox.domain_xml import read_image_disks, render_image_disk
from vmsandbox.errors import (
    CannotFit,
    InfrastructureError,
    InvalidArgument,
    NotFound,
    VmSandboxError,
    WrongState,
)
from vmsandbox.network import POD_FILES, pod_files
from vmsandbox.sizing import LinuxResources

log = logging.getLogger(__name__)

GUEST_SHARED_MOUNT = "/run/vmsandbox/shared"
"""Where the guest agent mounts the shared directory (images/agent)."""
_RESOLV_CONF_MAX = 64 * 1024
_SECCOMP_MAX = 1 << 20
_CONNECT_TIMEOUT_S = 30.0
_LOG_DRAIN_S = 5.0
"""How long an exit waits for the rest of the container's log to reach the kubelet's file."""


def _exit_reason(st: ContainerState) -> str:
    if st.oom_killed:
        return "OOMKilled"
    return "Completed" if st.exit_code == 0 else "Error"


def _host_resolv_conf() -> str:
    """The host's /etc/resolv.conf (bounded), for pods that sent no DNS settings."""
    try:
        with open("/etc/resolv.conf", "rb") as f:
            return f.read(_RESOLV_CONF_MAX).decode(errors="replace")
    except OSError:
        return ""


def _hugepage_mounts(linux: LinuxResources, mounts: tuple[oci_spec.Mount, ...]) -> tuple[oci_spec.Mount, ...]:
    """hugetlbfs mounts for the page sizes a container declared and its own mounts do not place."""
    sizes = [size for size, limit in linux.hugepage_limits if limit > 0]
    placed = {m.hugepage_size for m in mounts if m.hugepage_size}
    taken = {m.destination for m in mounts}
    return tuple(
        oci_spec.Mount(dest, "nodev", hugepage_size=hugetlbfs.pagesize_option(size))
        for size, dest in hugetlbfs.default_mountpoint(sizes).items()
        if hugetlbfs.pagesize_option(size) not in placed and dest not in taken
    )


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


class GuestProcess:
    """A streamed process in a guest, bound to the agent connection that started it (its id
    means nothing to another connection: the agent releases a host's processes when it leaves)."""

    def __init__(self, client: AgentClient, proc: str) -> None:
        self.client = client
        self.proc = proc

    def read(self, max_bytes: int, timeout_s: float) -> ProcOutput:
        return self.client.proc_read(self.proc, max_bytes=max_bytes, timeout_s=timeout_s)

    def write(self, data: bytes) -> bool:
        """Writes all of ``data`` (waiting while the process does not read); False once its stdin is closed."""
        view = memoryview(data)
        while view:
            chunk = bytes(view[:PROC_WRITE_MAX])
            n, closed = self.client.proc_write(self.proc, chunk)
            if closed:
                return False
            view = view[n:]
        return True

    def close_stdin(self) -> None:
        self.client.proc_close_stdin(self.proc)

    def resize(self, rows: int, cols: int) -> None:
        self.client.proc_resize(self.proc, rows, cols)

    def release(self) -> None:
        self.client.proc_release(self.proc)


class GuestAttach:
    """An Attach session on a container's own stdio in its guest (the same shape as GuestProcess)."""

    def __init__(self, client: AgentClient, session: str) -> None:
        self.client = client
        self.session = session

    def read(self, max_bytes: int, timeout_s: float) -> ProcOutput:
        return self.client.attach_read(self.session, max_bytes=max_bytes, timeout_s=timeout_s)

    def write(self, data: bytes) -> bool:
        view = memoryview(data)
        while view:
            n, closed = self.client.attach_write(self.session, bytes(view[:PROC_WRITE_MAX]))
            if closed:
                return False
            view = view[n:]
        return True

    def close_stdin(self) -> None:
        self.client.attach_close_stdin(self.session)

    def resize(self, rows: int, cols: int) -> None:
        self.client.attach_resize(self.session, rows, cols)

    def release(self) -> None:
        self.client.attach_release(self.session)


class Containers:
    def __init__(self, state_dir: str, sandboxes: Sandboxes, images: ImageStore, hypervisor: Hypervisor) -> None:
        self.sandboxes = sandboxes
        self.records = sandboxes.records
        self.dirs = sandboxes.dirs  # each sandbox's directory on the host: made, dropped and swept there
        self.images = images
        self.hypervisor = hypervisor
        self._lock = threading.Lock()
        self._clients: dict[str, AgentClient] = {}
        self._opening: dict[str, threading.Lock] = {}  # per sandbox, held while its agent is connected to
        self.logs = LogCopies(state_dir, sandboxes.config.log_rate_bytes, sandboxes.config.log_burst_bytes)
        self._container_locks: dict[str, threading.Lock] = {}
        self._disk_locks: dict[str, threading.Lock] = {}  # per sandbox: one image-disk change at a time
        # (sandbox, serial): creates in flight with that disk, and containers created with it by this process
        self._disk_users: dict[tuple[str, str], int] = {}
        self.follow = MountFollower()
        self.volumes = PodVolumes(self._call)

    def _attach_image(self, sandbox_id: str, held: HeldImage) -> tuple[str, bool]:
        """Hot-plugs an image's read-only disk into the sandbox's guest unless it has it already, so
        a guest holds the disks of its own containers' images and no other tenant's; returns the
        agent's ``lower`` for it and whether this call attached it. Counts this create as a user of
        the disk (until the pod goes, or ``_detach_unused`` when the create fails)."""
        name = self.records.get(sandbox_id).domain
        with self._lock:
            lock = self._disk_locks.setdefault(sandbox_id, threading.Lock())
        key = (sandbox_id, held.serial)
        with lock:
            with self._lock:
                if self._disk_users.get(key, 0) > 0:  # attached for this pod by this process already
                    self._disk_users[key] += 1
                    return f"disks/{held.serial}", False
            if not self.hypervisor.is_active(name):
                raise WrongState(f"sandbox {sandbox_id[:12]}: its guest is not running")
            disks = read_image_disks(self.hypervisor.live_xml(name))
            attached = False
            if held.serial not in disks:
                target = free_disk_target({d.target_dev for d in disks.values()})
                if target is None or len(disks) >= IMAGE_DISK_SLOTS:
                    raise CannotFit(
                        f"sandbox {sandbox_id[:12]} already holds the disks of {len(disks)} images, as many as "
                        f"a pod's guest takes ({IMAGE_DISK_SLOTS}): run containers of fewer images in one pod"
                    )
                source = self._bind_disk(sandbox_id, held)
                disk = ImageDiskDevice(source=str(source), serial=held.serial, target_dev=target)
                try:
                    self.hypervisor.attach_device(name, render_image_disk(disk))
                except BaseException:
                    self._unbind(sandbox_id, source)
                    raise
                attached = True
            with self._lock:
                self._disk_users[key] = self._disk_users.get(key, 0) + 1
        return f"disks/{held.serial}", attached

    def _bind_disk(self, sandbox_id: str, held: HeldImage) -> Path:
        """Makes the image's disk readable to the sandbox's QEMU alone: the store's file (root's,
        0400, in the 0700 store) is bound read-only, idmapped so that root's files are QEMU's uid's,
        onto ``<sandbox>/disks/<serial>.erofs`` inside that QEMU's mount namespace (on the host the
        path is an empty placeholder); returns the path QEMU opens."""
        record = self.records.get(sandbox_id)
        pid = self.hypervisor.emulator_pid(record.domain)
        if pid is None:
            raise WrongState(f"sandbox {sandbox_id[:12]}: its guest is not running")
        disks = self.dirs.disks(sandbox_id)
        disks.mkdir(mode=0o755, exist_ok=True)
        target = disks / f"{held.serial}.erofs"
        if binds.mounts_under(target, Path(f"/proc/{pid}/mountinfo").read_text()):
            return target  # bound by an attach whose disk is still being removed, or a crashed one
        target.touch(mode=0o400, exist_ok=True)
        binds.bind(pid, held.disk, target, readonly=True, beneath=disks, root_as=record.qemu_uid)
        return target

    def _detach_unused(self, sandbox_id: str, held: HeldImage, attached: bool) -> None:
        """Rollback of a failed create: it no longer uses the image's disk; a disk this create
        attached is detached again unless another container (or create in flight) uses it."""
        key = (sandbox_id, held.serial)
        with self._lock:
            lock = self._disk_locks.setdefault(sandbox_id, threading.Lock())
        with lock:
            with self._lock:
                left = self._disk_users.get(key, 1) - 1
                if left > 0:
                    self._disk_users[key] = left
                else:
                    self._disk_users.pop(key, None)
            if not attached or left > 0:
                return
            name = self.records.get(sandbox_id).domain
            disk = read_image_disks(self.hypervisor.live_xml(name)).get(held.serial)
            if disk is not None:
                try:
                    self.hypervisor.detach_device(name, render_image_disk(disk))
                except VmSandboxError as exc:
                    log.warning("sandbox %s: image disk %s stays attached: %s", sandbox_id[:12], held.serial, exc)
                    return
            with contextlib.suppress(VmSandboxError):  # QEMU closed it; a bind that stays goes with QEMU
                self._unbind(sandbox_id, self.dirs.disks(sandbox_id) / f"{held.serial}.erofs")

    def _qemu_pid(self, sandbox_id: str) -> int | None:
        return self.hypervisor.emulator_pid(self.records.get(sandbox_id).domain)

    def _unbind(self, sandbox_id: str, path: Path) -> None:
        """Detach the mounts at or below ``path`` in the guest's QEMU (if it runs)."""
        pid = self._qemu_pid(sandbox_id)
        if pid is not None:
            binds.unbind_all(pid, path)

    def _unbind_container(self, sandbox_id: str, container_id: str) -> None:
        """Detach a container's volume binds in its guest's QEMU. Guest root can rename directories
        of the share, and a bind moves with its parent, out of the container's own directory; so
        every mount in the share is detached except those in the places of the pod's other
        containers that may still use theirs."""
        self.follow.forget(sandbox_id, container_id)
        pid = self._qemu_pid(sandbox_id)
        if pid is None:
            return
        shared = self.dirs.shared(sandbox_id)
        keep = [
            shared / "containers" / o.id / "mounts"
            for o in self.records.containers(sandbox_id)
            if o.id != container_id and o.state != CONTAINER_EXITED
        ]
        binds.unbind_all(pid, shared, keep=keep)

    def _drop_container_dir(self, sandbox_id: str, container_id: str) -> None:
        self._unbind_container(sandbox_id, container_id)
        self.dirs.drop_container(sandbox_id, container_id)

    def _forget_sandbox(self, sandbox_id: str) -> None:
        """A removed sandbox's disk bookkeeping, mount watches and volume copies go with it (its
        QEMU is gone)."""
        self.follow.forget(sandbox_id)
        self.volumes.forget_sandbox(sandbox_id)
        with self._lock:
            self._disk_locks.pop(sandbox_id, None)
            for key in [k for k in self._disk_users if k[0] == sandbox_id]:
                del self._disk_users[key]

    def _forget_lock(self, container_id: str) -> None:
        """A removed container's lock goes with it (the map holds only containers that exist)."""
        with self._lock:
            self._container_locks.pop(container_id, None)

    def _lock_for(self, container_id: str) -> threading.Lock:
        with self._lock:
            return self._container_locks.setdefault(container_id, threading.Lock())

    # -- the guest ------------------------------------------------------------------------------
    def _client(self, sandbox_id: str, timeout_s: float = _CONNECT_TIMEOUT_S) -> AgentClient:
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
            return self._open_client(sandbox_id, timeout_s)

    def _open_client(self, sandbox_id: str, timeout_s: float) -> AgentClient:
        record = self.records.get(sandbox_id)
        path = self.hypervisor.channel_path(record.domain, AGENT_CHANNEL)
        client = AgentClient.open(
            path, timeout_s, label=f"sandbox {sandbox_id[:12]}", on_lost=lambda why: self._agent_lost(sandbox_id, why)
        )
        expected = record.agent_instance
        if expected and client.instance != expected:
            client.close()
            why = (
                f"the guest agent answering is instance {client.instance or 'unknown'}, not {expected}, which "
                "reported when the sandbox started: it started over and the containers it ran are lost"
            )
            self._agent_lost(sandbox_id, why)
            raise AgentLost(f"sandbox {sandbox_id[:12]}: {why}")
        with self._lock:
            old = self._clients.get(sandbox_id)
            if old is not None and not old.closed:
                client.close()
                return old
            self._clients[sandbox_id] = client
        return client

    def _drop_client(self, sandbox_id: str) -> None:
        with self._lock:
            client = self._clients.pop(sandbox_id, None)
        if client is not None:
            client.close()

    def _agent_lost(self, sandbox_id: str, why: str) -> None:
        """The sandbox's agent is lost (``why``): forget its connection, and have the sandbox turn NOTREADY."""
        with self._lock:
            client = self._clients.get(sandbox_id)
            if client is not None and client.closed:
                del self._clients[sandbox_id]
        try:
            self.sandboxes.reconciler.agent_lost(sandbox_id, why)
        except VmSandboxError as exc:  # a sandbox removed meanwhile
            log.warning("sandbox %s: guest agent lost (%s), not recorded: %s", sandbox_id[:12], why, exc)

    def _call(self, sandbox_id: str, fn: str, *args: object, **kw: object) -> object:
        """An agent op, reconnecting once when the channel closed under us (a guest keeps its
        containers across host connections). An agent that answered garbage or is lost is not
        asked again on this connection; one that does not know a container we ran is lost."""
        for attempt in (0, 1):
            client = self._client(sandbox_id)
            try:
                return getattr(client, fn)(*args, **kw)
            except GuestChannelClosed:
                self._drop_client(sandbox_id)
                if attempt:
                    raise
            except (ProtocolError, AgentLost):
                self._drop_client(sandbox_id)
                raise
            except GuestRequestFailed as exc:
                if exc.code == UNKNOWN_CONTAINER and fn != "create" and args:
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
            self._agent_lost(sandbox_id, why)
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
                self._client(s.id, timeout_s)
                connected += 1
            except VmSandboxError as exc:
                log.warning("sandbox %s: no connection to its guest agent: %s", s.id[:12], exc)
        return connected

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
        held = self.images.acquire(image.id)
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
            guest_mounts = self._share_mounts(c.sandbox_id, container_id, mounts)
            guest_mounts += self._pod_file_mounts(sandbox, {m.destination for m in guest_mounts})
            guest_mounts += _hugepage_mounts(c.linux, guest_mounts)
            run = replace(
                request,
                mounts=guest_mounts,
                resources=_admitted_limits(request.resources, c.linux),
                seccomp_profile=self._seccomp_document(request.seccomp),
            )
            spec = oci_spec.build_spec(run, image_cfg, user)
            lower, disk_attached = self._attach_image(c.sandbox_id, held)
            self._call(
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
                self._detach_unused(c.sandbox_id, held, disk_attached)
            self.images.release(image.id)
            self.volumes.release(c.sandbox_id, container_id)
            self._drop_container_dir(c.sandbox_id, container_id)
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
        root = Path(self.sandboxes.config.seccomp_profile_root)
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

    def check_mounts(self, mounts: list[MountRequest], pod_uid: str) -> None:
        """INVALID_ARGUMENT naming the first host path outside the pod's own directory in the
        kubelet's pod directory (``<kubelet_pods_dir>/<pod uid>/``: another pod's volumes are not
        this pod's) and the admin's allowlist (symlinks resolved)."""
        allowed = [Path(p) for p in self.sandboxes.config.mount_allowlist]
        if validation.path_component(pod_uid):
            allowed.append(Path(os.path.realpath(self.sandboxes.config.kubelet_pods_dir)) / pod_uid)
        for m in mounts:
            host_path = m.host_path
            if host_path and not any(Path(os.path.realpath(host_path)).is_relative_to(a) for a in allowed):
                raise InvalidArgument(
                    f"mount of host path {host_path[:256]!r} is not allowed: only paths under "
                    f"{', '.join(str(a) for a in allowed) or '(none)'} are shared into this pod"
                )

    def _share_mounts(
        self, sandbox_id: str, container_id: str, mounts: list[MountRequest]
    ) -> tuple[oci_spec.Mount, ...]:
        """Binds each allowed host path below the container's shared directory in the guest's QEMU,
        where the guest sees it live over 9p (binds.py); the spec mounts it there.

        Read-only is the host's bind: in the guest a volume and the host mounts below it are one 9p
        file system, so a read-only mount there would also cover those (the CRI's non-recursive
        read-only leaves them writable). A recursive one is read-only on both sides.

        A HostToContainer or Bidirectional volume of an unprivileged QEMU is bound private, and the
        host's later mounts below its source are copied in idmapped by ``self.follow``: propagated
        by the kernel, they would arrive without the mapping."""
        sandbox = self.records.get(sandbox_id)
        self.check_mounts(mounts, sandbox.meta.uid)
        out = []
        mountinfo = Path("/proc/self/mountinfo").read_text()
        qemu = self._qemu_pid(sandbox_id) if any(m.host_path for m in mounts) else None
        qemu_uid = sandbox.qemu_uid
        pods_dir = os.path.realpath(self.sandboxes.config.kubelet_pods_dir)
        for i, m in enumerate(mounts):
            container_path, host_path, readonly = m.container_path, m.host_path, m.readonly
            if not host_path:
                continue
            real = Path(os.path.realpath(host_path))
            if not real.exists():
                raise InvalidArgument(f"mount of host path {host_path[:256]!r}: it does not exist")
            pagesize = hugetlbfs.mount_pagesize(mountinfo, str(real))
            if pagesize is not None:  # a HugePages emptyDir: the guest's own pages of that size
                out.append(oci_spec.Mount(container_path, "nodev", readonly, hugepage_size=pagesize))
                continue
            if kubelet_volumes.is_atomic_volume(str(real), pods_dir):  # a copy in the guest, kept current
                source = self.volumes.attach(sandbox_id, container_id, str(real))
                out.append(oci_spec.Mount(destination=container_path, source=source, readonly=readonly))
                continue
            shared = self.dirs.shared(sandbox_id)
            rel = f"containers/{container_id}/mounts/{i}"
            if qemu is None:
                raise WrongState(f"sandbox {sandbox_id[:12]}: its guest is not running")
            try:  # what was checked is what is bound: the bind takes this descriptor, not the path again
                src_fd = binds.resolve(str(real))
            except OSError as exc:
                raise InvalidArgument(
                    f"mount of host path {host_path[:256]!r}: {exc.strerror} (it changed while being resolved)"
                ) from None
            try:
                shared_tree.make_dirs(shared, f"containers/{container_id}/mounts")
                shared_tree.make_empty(shared, rel, is_dir=stat.S_ISDIR(os.fstat(src_fd).st_mode))
                if m.propagation != "private" and qemu_uid:  # later host mounts below it: mount_follow.py
                    known = self.follow.snapshot(str(real))
                    binds.bind(
                        qemu, src_fd, shared / rel, readonly, m.recursive, "private", beneath=shared, root_as=qemu_uid
                    )
                    self.follow.watch(
                        sandbox_id,
                        container_id,
                        i,
                        qemu_pid=qemu,
                        source=str(real),
                        bound=shared / rel,
                        beneath=shared,
                        root_as=qemu_uid,
                        known=known,
                        readonly=readonly,
                    )
                else:
                    binds.bind(
                        qemu,
                        src_fd,
                        shared / rel,
                        readonly,
                        m.recursive,
                        m.propagation,
                        beneath=shared,
                        root_as=qemu_uid,
                    )
            finally:
                os.close(src_fd)
            out.append(
                oci_spec.Mount(
                    destination=container_path,
                    source=f"{GUEST_SHARED_MOUNT}/containers/{container_id}/mounts/{i}",
                    readonly=readonly and m.recursive,
                )
            )
        return tuple(out)

    def _pod_file_mounts(self, sandbox: SandboxRecord, covered: set[str]) -> tuple[oci_spec.Mount, ...]:
        """The pod's resolv.conf and hostname, written once per sandbox into its shared directory and
        mounted read-only into each container whose own mounts leave those paths free (containerd's
        rule: the kubelet's mounts win)."""
        shared = self.dirs.shared(sandbox.id)
        shared_tree.make_dirs(shared, "pod")
        dns = sandbox.dns
        out = []
        for path, text in pod_files(dns, sandbox.hostname, _host_resolv_conf() if dns.empty else "").items():
            if path in covered:
                continue
            name = POD_FILES[path]
            # written once: a later rewrite would not reach running containers
            shared_tree.write_once(shared, f"pod/{name}", text.encode(), 0o644)
            out.append(oci_spec.Mount(destination=path, source=f"{GUEST_SHARED_MOUNT}/pod/{name}", readonly=True))
        return tuple(out)

    def start(self, container_id: str) -> None:
        container_id = self.records.container(container_id).id  # a client's prefix names one lock, one path
        with self._lock_for(container_id):
            c = self.records.container(container_id)
            if c.state != CONTAINER_CREATED:
                raise WrongState(f"container {container_id[:12]} is {c.state}, not created: it can start only once")
            if not c.image_id:
                raise InfrastructureError(f"container {container_id[:12]} was not created in its guest")
            self._start_pump(c)
            st = self._call(c.sandbox_id, "start", container_id)
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
            chunk = self._call(sandbox_id, "log_read", cid, offset, max_bytes, wait_s)
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
                in_guest = {st.id: st for st in self._client(sandbox_id, 5.0).list(timeout_s=5.0)}
            except VmSandboxError as exc:
                log.warning("sandbox %s: its containers were not checked with its guest: %s", sandbox_id[:12], exc)
                continue
            for c in containers:
                st = in_guest.get(c.id)
                if not c.image_id:
                    if st is not None:
                        self._call(sandbox_id, "delete", c.id)
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
                self.images.acquire(c.image_id)
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
            st = self._call(c.sandbox_id, "status", container_id)
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
            self._unbind_container(c.sandbox_id, c.id)
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
            self._call(c.sandbox_id, "kill", container_id, c.stop_signal or "TERM")
            st = self._call(c.sandbox_id, "wait", container_id, timeout_s=max(timeout_s, 0))
            assert isinstance(st, ContainerState)
            if st.state != "exited":
                self._call(c.sandbox_id, "kill", container_id, "KILL")
                self._call(c.sandbox_id, "wait", container_id, timeout_s=30)
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
                self._call(c.sandbox_id, "delete", container_id)
        self.logs.forget(container_id)
        self.volumes.release(c.sandbox_id, container_id)
        self._drop_container_dir(c.sandbox_id, container_id)
        self.records.remove_container(container_id)
        if c.image_id:
            self.images.release(c.image_id)
        self._forget_lock(container_id)
        return container_id

    def sandbox_stopped(self, sandbox_id: str) -> None:
        """The sandbox's guest is gone (StopPodSandbox): stop copying its logs, drop its connection.
        Image holds stay until its containers (or the sandbox) are removed."""
        self.follow.forget(sandbox_id)
        self.volumes.forget_sandbox(sandbox_id)
        self.logs.stop(*(c.id for c in self.records.containers(sandbox_id)))
        self._drop_client(sandbox_id)

    def sandbox_removed(self, sandbox_id: str) -> None:
        """Forget a removed sandbox's guest: its connection, log copies and shared directory."""
        with self._lock:
            self._opening.pop(sandbox_id, None)
        for c in self.records.containers(sandbox_id):
            self._forget_lock(c.id)
            self.logs.forget(c.id)
            if c.image_id:
                self.images.release(c.image_id)
        self._drop_client(sandbox_id)
        self.dirs.drop(sandbox_id)
        self._forget_sandbox(sandbox_id)

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
        res = self._call(c.sandbox_id, "exec", c.id, argv, timeout_s=timeout_s, max_bytes=max_bytes)
        assert isinstance(res, ExecResult)
        return res

    def proc_start(self, container_id: str, argv: list[str], *, tty: bool, stdin: bool) -> GuestProcess:
        """A process started in the running container for a streaming Exec (``shim.streaming``).
        The record's state is enough here: the agent refuses a container that is not running."""
        c = self.records.container(container_id)
        if c.state != CONTAINER_RUNNING:
            raise WrongState(f"container {container_id[:12]} is not running: nothing to exec into")
        self.follow.catch_up(c.sandbox_id)
        client = self._client(c.sandbox_id)
        try:
            proc = client.proc_start(c.id, argv, tty=tty, stdin=stdin)
        except GuestChannelClosed:
            self._drop_client(c.sandbox_id)
            client = self._client(c.sandbox_id)
            proc = client.proc_start(c.id, argv, tty=tty, stdin=stdin)
        return GuestProcess(client, proc)

    def attach_start(self, container_id: str) -> GuestAttach:
        c = self.records.container(container_id)
        if c.state != CONTAINER_RUNNING:
            raise WrongState(f"container {container_id[:12]} is not running: nothing to attach to")
        client = self._client(c.sandbox_id)
        try:
            session = client.attach_open(c.id)
        except GuestChannelClosed:
            self._drop_client(c.sandbox_id)
            client = self._client(c.sandbox_id)
            session = client.attach_open(c.id)
        return GuestAttach(client, session)

    def guest_agent(self, sandbox_id: str) -> AgentClient:
        """The agent connection of a READY sandbox's guest (streaming relays use it directly)."""
        return self._client(self.records.get(sandbox_id).id)

    def stats(self, container_id: str) -> CgroupStats | None:
        """The running container's usage; None when it is not running or its guest gives no valid
        answer (one guest's refusal or malformed answer must not fail a list of every pod's stats)."""
        c = self.records.container(container_id)
        if c.state != CONTAINER_RUNNING:
            return None
        try:
            res = self._call(c.sandbox_id, "stats", c.id)
        except (GuestRequestFailed, InfrastructureError) as exc:
            log.info("container %s: no usage: %s", c.id[:12], exc)
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
            try:
                s = self._call(c.sandbox_id, "stats", c.id)
            except (GuestRequestFailed, InfrastructureError, NotFound) as exc:
                log.debug("container %s: no writable-layer usage: %s", c.id[:12], exc)
                continue
            assert isinstance(s, CgroupStats)
            used += s.writable_bytes
            inodes += s.writable_inodes
        return used, inodes

    def sandbox_stats(self, sandbox_id: str) -> CgroupStats | None:
        """The whole guest's usage; None when its guest gives no valid answer (as ``stats``)."""
        try:
            res = self._call(sandbox_id, "stats", "")
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
            self._call(c.sandbox_id, "update", c.id, files)

    def close(self) -> None:
        self.follow.close()
        self.volumes.close()
        self.logs.close()
        with self._lock:
            clients = list(self._clients.values())
            self._clients.clear()
        for cl in clients:
            cl.close()
