"""``ContainerMounts``: what a container's guest sees of the host — image disks, volume binds, pod files.

It owns:
- the read-only disk of each image in the pod's guest: hot-plugged when the pod's first
  container of that image, or with an image volume of it, is created (bound, idmapped, into that
  QEMU's mount namespace alone), counted by its users, detached again when a failed create was
  its only one, else kept until the pod goes;
- each container's place and volume binds in the pod's share (the directory itself is
  ``shim.sandbox_dirs``'): host paths checked once against the kubelet's pod directory and the
  allowlist (``plan``: what is checked is what is bound), bound into the guest's QEMU
  (``vmsandbox.adapters.binds``), HugePages emptyDirs as the guest's own pages, atomic-writer
  volumes as copies kept current in the guest (through ``shim.pod_volumes``), and the host's later
  mounts below a volume followed (through ``shim.mount_follow``);
- the pod's ``resolv.conf`` and ``hostname`` files its containers share.

Each change is one step of CreateContainer (``shim.rpc.create_container``) that either succeeds
or leaves nothing of itself, with its undo here too. The pod's record is the caller's, read once
per RPC.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

from shim.config import ShimConfig
from shim.image_store import HeldImage
from shim.model import CONTAINER_EXITED, MountRequest, SandboxRecord
from shim.mount_follow import MountFollower
from shim.pod_volumes import PodVolumes
from shim.records import Records
from shim.sandbox_dirs import SandboxDirs
from vmsandbox import hugetlbfs, kubelet_volumes, oci_spec, validation
from vmsandbox.adapters import binds, shared_tree
from vmsandbox.adapters.hypervisor import Hypervisor
from vmsandbox.agent_protocol import ImageMount
from vmsandbox.domain import IMAGE_DISK_SLOTS, ImageDiskDevice, free_disk_target
from vmsandbox.domain_xml import read_image_disks, render_image_disk
from vmsandbox.errors import CannotFit, InvalidArgument, VmSandboxError, WrongState
from vmsandbox.network import POD_FILES, pod_files
from vmsandbox.sizing import LinuxResources

log = logging.getLogger(__name__)

GUEST_SHARED_MOUNT = "/run/vmsandbox/shared"
"""Where the guest agent mounts the shared directory (images/agent)."""
GUEST_DISKS_MOUNT = "/run/vmsandbox/disks"
"""Where the guest agent mounts each image disk, at ``<serial>`` (images/agent; an image volume's
bind source, which the agent sets itself once it resolved the sub path)."""
_RESOLV_CONF_MAX = 64 * 1024


def _host_resolv_conf() -> str:
    """The host's /etc/resolv.conf (bounded), for pods that sent no DNS settings."""
    try:
        with open("/etc/resolv.conf", "rb") as f:
            return f.read(_RESOLV_CONF_MAX).decode(errors="replace")
    except OSError:
        return ""


@dataclass(frozen=True)
class PlannedMount:
    """A mount of a host path, checked: how the guest gets it (``bind``, ``volume``: an
    atomic-writer volume's copy, ``hugepages``: an emptyDir of that page size)."""

    index: int  # its place among the container's mounts (and the name of its bind in the share)
    request: MountRequest
    real: str  # the host path, symlinks resolved: what was checked, and what is bound
    kind: str
    pagesize: str = ""


def hugepage_mounts(linux: LinuxResources, mounts: tuple[oci_spec.Mount, ...]) -> tuple[oci_spec.Mount, ...]:
    """hugetlbfs mounts for the page sizes a container declared and its own mounts do not place."""
    sizes = [size for size, limit in linux.hugepage_limits if limit > 0]
    placed = {m.hugepage_size for m in mounts if m.hugepage_size}
    taken = {m.destination for m in mounts}
    return tuple(
        oci_spec.Mount(dest, "nodev", hugepage_size=hugetlbfs.pagesize_option(size))
        for size, dest in hugetlbfs.default_mountpoint(sizes).items()
        if hugetlbfs.pagesize_option(size) not in placed and dest not in taken
    )


class ContainerMounts:
    def __init__(
        self,
        config: ShimConfig,
        records: Records,
        hypervisor: Hypervisor,
        dirs: SandboxDirs,
        follow: MountFollower,
        volumes: PodVolumes,
    ) -> None:
        self.config = config
        self.records = records
        self.hypervisor = hypervisor
        self.dirs = dirs
        self.follow = follow
        self.volumes = volumes
        self._lock = threading.Lock()  # guards the two maps below
        self._disk_locks: dict[str, threading.Lock] = {}  # per sandbox: one image-disk change at a time
        # (sandbox, serial): creates in flight with that disk, and containers created with it by this process
        self._disk_users: dict[tuple[str, str], int] = {}

    def attach_image(self, sandbox: SandboxRecord, held: HeldImage) -> tuple[str, bool]:
        """Hot-plugs an image's read-only disk into the sandbox's guest unless it has it already, so
        a guest holds the disks of its own containers' images and no other tenant's; returns the
        agent's ``lower`` for it and whether this call attached it. Counts this create as a user of
        the disk (until the pod goes, or ``detach_unused`` when the create fails)."""
        name = sandbox.domain
        with self._lock:
            lock = self._disk_locks.setdefault(sandbox.id, threading.Lock())
        key = (sandbox.id, held.serial)
        with lock:
            with self._lock:
                if self._disk_users.get(key, 0) > 0:  # attached for this pod by this process already
                    self._disk_users[key] += 1
                    return f"disks/{held.serial}", False
            if not self.hypervisor.is_active(name):
                raise WrongState(f"sandbox {sandbox.id[:12]}: its guest is not running")
            disks = read_image_disks(self.hypervisor.live_xml(name))
            attached = False
            if held.serial not in disks:
                target = free_disk_target({d.target_dev for d in disks.values()})
                if target is None or len(disks) >= IMAGE_DISK_SLOTS:
                    raise CannotFit(
                        f"sandbox {sandbox.id[:12]} already holds the disks of {len(disks)} images, as many as "
                        f"a pod's guest takes ({IMAGE_DISK_SLOTS}): run containers of fewer images in one pod"
                    )
                source = self._bind_disk(sandbox, held)
                disk = ImageDiskDevice(source=str(source), serial=held.serial, target_dev=target)
                try:
                    self.hypervisor.attach_device(name, render_image_disk(disk))
                except BaseException:
                    self._unbind(sandbox, source)
                    raise
                attached = True
            with self._lock:
                self._disk_users[key] = self._disk_users.get(key, 0) + 1
        return f"disks/{held.serial}", attached

    def _bind_disk(self, sandbox: SandboxRecord, held: HeldImage) -> Path:
        """Makes the image's disk readable to the sandbox's QEMU alone: the store's file (root's,
        0400, in the 0700 store) is bound read-only, idmapped so that root's files are QEMU's uid's,
        onto ``<sandbox>/disks/<serial>.erofs`` inside that QEMU's mount namespace (on the host the
        path is an empty placeholder); returns the path QEMU opens."""
        pid = self.hypervisor.emulator_pid(sandbox.domain)
        if pid is None:
            raise WrongState(f"sandbox {sandbox.id[:12]}: its guest is not running")
        disks = self.dirs.disks(sandbox.id)
        disks.mkdir(mode=0o755, exist_ok=True)
        target = disks / f"{held.serial}.erofs"
        if binds.mounts_under(target, Path(f"/proc/{pid}/mountinfo").read_text()):
            return target  # bound by an attach whose disk is still being removed, or a crashed one
        target.touch(mode=0o400, exist_ok=True)
        binds.bind(pid, held.disk, target, readonly=True, beneath=disks, root_as=sandbox.qemu_uid)
        return target

    def detach_unused(self, sandbox: SandboxRecord, held: HeldImage, attached: bool) -> None:
        """Undo of ``attach_image`` (a create that failed): it no longer uses the image's disk; a
        disk this create attached is detached again unless another container (or create in flight)
        uses it."""
        key = (sandbox.id, held.serial)
        with self._lock:
            lock = self._disk_locks.setdefault(sandbox.id, threading.Lock())
        with lock:
            with self._lock:
                left = self._disk_users.get(key, 1) - 1
                if left > 0:
                    self._disk_users[key] = left
                else:
                    self._disk_users.pop(key, None)
            if not attached or left > 0:
                return
            name = sandbox.domain
            disk = read_image_disks(self.hypervisor.live_xml(name)).get(held.serial)
            if disk is not None:
                try:
                    self.hypervisor.detach_device(name, render_image_disk(disk))
                except VmSandboxError as exc:
                    log.warning("sandbox %s: image disk %s stays attached: %s", sandbox.id[:12], held.serial, exc)
                    return
            with contextlib.suppress(VmSandboxError):  # QEMU closed it; a bind that stays goes with QEMU
                self._unbind(sandbox, self.dirs.disks(sandbox.id) / f"{held.serial}.erofs")

    def attach_volume_images(
        self, sandbox: SandboxRecord, helds: dict[int, HeldImage]
    ) -> tuple[tuple[HeldImage, bool], ...]:
        """The disks of a container's image volumes in its guest, each attached as its own image's
        is (``attach_image``: once per guest, whether a container's root or a volume uses it, and
        counted by its users until the pod goes); returns, per distinct disk, whether this call
        attached it. On failure it counts as a user of none of them (undo:
        ``detach_volume_images``)."""
        done: list[tuple[HeldImage, bool]] = []
        try:
            for held in {h.serial: h for h in helds.values()}.values():
                _, attached = self.attach_image(sandbox, held)
                done.append((held, attached))
        except BaseException:
            self.detach_volume_images(sandbox, tuple(done))
            raise
        return tuple(done)

    def detach_volume_images(self, sandbox: SandboxRecord, attached: tuple[tuple[HeldImage, bool], ...]) -> None:
        """Undo of ``attach_volume_images`` (``detach_unused`` of each disk, newest first)."""
        for held, was_attached in reversed(attached):
            self.detach_unused(sandbox, held, was_attached)

    @staticmethod
    def image_volume_mounts(
        mounts: tuple[MountRequest, ...], helds: dict[int, HeldImage]
    ) -> tuple[dict[int, oci_spec.Mount], tuple[ImageMount, ...]]:
        """The spec's read-only binds of a container's image volumes, by the index of their mount,
        and what the guest agent mounts at each (the disk it finds by serial and the sub path it
        resolves inside that disk's tree, which becomes the bind's source)."""
        spec: dict[int, oci_spec.Mount] = {}
        agent: list[ImageMount] = []
        for i, held in sorted(helds.items()):
            m = mounts[i]
            assert m.image is not None
            source = f"{GUEST_DISKS_MOUNT}/{held.serial}/{m.image.sub_path}".rstrip("/")
            spec[i] = oci_spec.Mount(m.container_path, source, readonly=True)
            agent.append(ImageMount(m.container_path, held.serial, m.image.sub_path))
        return spec, tuple(agent)

    def disk_users(self, sandbox_id: str) -> dict[str, int]:
        """Image disk serial -> the creates that counted themselves as its users in this sandbox."""
        with self._lock:
            return {serial: n for (sid, serial), n in self._disk_users.items() if sid == sandbox_id}

    def _qemu_pid(self, sandbox: SandboxRecord) -> int | None:
        return self.hypervisor.emulator_pid(sandbox.domain)

    def _unbind(self, sandbox: SandboxRecord, path: Path) -> None:
        """Detach the mounts at or below ``path`` in the guest's QEMU (if it runs)."""
        pid = self._qemu_pid(sandbox)
        if pid is not None:
            binds.unbind_all(pid, path)

    def make_container_dir(self, sandbox: SandboxRecord, container_id: str) -> None:
        """The container's own directory in the pod's share (undo: ``drop_container_dir``)."""
        shared_tree.make_dirs(self.dirs.shared(sandbox.id), f"containers/{container_id}")

    def unbind_container(self, sandbox: SandboxRecord, container_id: str) -> None:
        """Detach a container's volume binds in its guest's QEMU. Guest root can rename directories
        of the share, and a bind moves with its parent, out of the container's own directory; so
        every mount in the share is detached except those in the places of the pod's other
        containers that may still use theirs."""
        self.follow.forget(sandbox.id, container_id)
        pid = self._qemu_pid(sandbox)
        if pid is None:
            return
        shared = self.dirs.shared(sandbox.id)
        keep = [
            shared / "containers" / o.id / "mounts"
            for o in self.records.containers(sandbox.id)
            if o.id != container_id and o.state != CONTAINER_EXITED
        ]
        binds.unbind_all(pid, shared, keep=keep)

    def drop_container_dir(self, sandbox: SandboxRecord, container_id: str) -> None:
        """Detach the container's binds and remove its directory in the share."""
        self.unbind_container(sandbox, container_id)
        self.dirs.drop_container(sandbox.id, container_id)

    def forget_sandbox(self, sandbox_id: str) -> None:
        """A removed sandbox's disk bookkeeping, mount watches and volume copies go with it (its
        QEMU is gone)."""
        self.follow.forget(sandbox_id)
        self.volumes.forget_sandbox(sandbox_id)
        with self._lock:
            self._disk_locks.pop(sandbox_id, None)
            for key in [k for k in self._disk_users if k[0] == sandbox_id]:
                del self._disk_users[key]

    def plan(self, sandbox: SandboxRecord, mounts: list[MountRequest]) -> tuple[PlannedMount, ...]:
        """The mounts of host paths, each checked once (symlinks resolved): INVALID_ARGUMENT naming
        the first outside the pod's own directory in the kubelet's pod directory
        (``<kubelet_pods_dir>/<pod uid>/``: another pod's volumes are not this pod's) and the
        admin's allowlist, or that does not exist; each with how the guest gets it. A mount
        without a host path is no mount of the host's."""
        allowed = [Path(p) for p in self.config.mount_allowlist]
        if validation.path_component(sandbox.meta.uid):
            allowed.append(Path(os.path.realpath(self.config.kubelet_pods_dir)) / sandbox.meta.uid)
        pods_dir = os.path.realpath(self.config.kubelet_pods_dir)
        mountinfo = ""
        out = []
        for i, m in enumerate(mounts):
            if not m.host_path:
                continue
            real = Path(os.path.realpath(m.host_path))
            shown = repr(m.host_path[:256])
            if not any(real.is_relative_to(a) for a in allowed):
                raise InvalidArgument(
                    f"mount of host path {shown} is not allowed: only paths under "
                    f"{', '.join(str(a) for a in allowed) or '(none)'} are shared into this pod"
                )
            if not real.exists():
                raise InvalidArgument(f"mount of host path {shown}: it does not exist")
            mountinfo = mountinfo or Path("/proc/self/mountinfo").read_text()
            pagesize = hugetlbfs.mount_pagesize(mountinfo, str(real))
            if pagesize is not None:  # a HugePages emptyDir: the guest's own pages of that size
                out.append(PlannedMount(i, m, str(real), "hugepages", pagesize))
            elif kubelet_volumes.is_atomic_volume(str(real), pods_dir):  # a copy in the guest, kept current
                out.append(PlannedMount(i, m, str(real), "volume"))
            else:
                out.append(PlannedMount(i, m, str(real), "bind"))
        return tuple(out)

    def attach_volumes(
        self, sandbox: SandboxRecord, container_id: str, planned: tuple[PlannedMount, ...]
    ) -> dict[int, oci_spec.Mount]:
        """The guest copies of the container's atomic-writer volumes, by the index of their mount;
        on failure the container uses none (undo: ``PodVolumes.release``)."""
        out = {}
        try:
            for p in planned:
                if p.kind == "volume":
                    source = self.volumes.attach(sandbox.id, container_id, p.real, sandbox.userns)
                    out[p.index] = oci_spec.Mount(p.request.container_path, source, p.request.readonly)
        except BaseException:
            self.volumes.release(sandbox.id, container_id)
            raise
        return out

    def bind(
        self, sandbox: SandboxRecord, container_id: str, planned: tuple[PlannedMount, ...]
    ) -> dict[int, oci_spec.Mount]:
        """Binds each planned host path below the container's shared directory in the guest's QEMU,
        where the guest sees it live over 9p (binds.py), and gives HugePages emptyDirs the guest's
        own pages; the spec's mounts, by the index of their mount. On failure none of its binds is
        left (undo: ``unbind_container``).

        Read-only is the host's bind: in the guest a volume and the host mounts below it are one 9p
        file system, so a read-only mount there would also cover those (the CRI's non-recursive
        read-only leaves them writable). A recursive one is read-only on both sides.

        A HostToContainer or Bidirectional volume of an unprivileged QEMU is bound private, and the
        host's later mounts below its source are copied in idmapped by ``self.follow``: propagated
        by the kernel, they would arrive without the mapping."""
        out = {}
        qemu = self._qemu_pid(sandbox) if any(p.kind == "bind" for p in planned) else None
        try:
            for p in planned:
                m = p.request
                if p.kind == "hugepages":
                    out[p.index] = oci_spec.Mount(m.container_path, "nodev", m.readonly, hugepage_size=p.pagesize)
                elif p.kind == "bind":
                    if qemu is None:
                        raise WrongState(f"sandbox {sandbox.id[:12]}: its guest is not running")
                    self._bind_one(sandbox, container_id, p, qemu)
                    out[p.index] = oci_spec.Mount(
                        destination=m.container_path,
                        source=f"{GUEST_SHARED_MOUNT}/containers/{container_id}/mounts/{p.index}",
                        readonly=m.readonly and m.recursive,
                    )
        except BaseException:
            with contextlib.suppress(VmSandboxError):
                self.unbind_container(sandbox, container_id)
            raise
        return out

    def _bind_one(self, sandbox: SandboxRecord, container_id: str, p: PlannedMount, qemu: int) -> None:
        m, shared, qemu_uid = p.request, self.dirs.shared(sandbox.id), sandbox.qemu_uid
        rel = f"containers/{container_id}/mounts/{p.index}"
        try:  # what was checked is what is bound: the bind takes this descriptor, not the path again
            src_fd = binds.resolve(p.real)
        except OSError as exc:
            raise InvalidArgument(
                f"mount of host path {m.host_path[:256]!r}: {exc.strerror} (it changed while being resolved)"
            ) from None
        try:
            shared_tree.make_dirs(shared, f"containers/{container_id}/mounts")
            shared_tree.make_empty(shared, rel, is_dir=stat.S_ISDIR(os.fstat(src_fd).st_mode))
            if m.propagation != "private" and qemu_uid:  # later host mounts below it: mount_follow.py
                known = self.follow.snapshot(p.real)
                binds.bind(
                    qemu, src_fd, shared / rel, m.readonly, m.recursive, "private", beneath=shared, root_as=qemu_uid
                )
                self.follow.watch(
                    sandbox.id,
                    container_id,
                    p.index,
                    qemu_pid=qemu,
                    source=p.real,
                    bound=shared / rel,
                    beneath=shared,
                    root_as=qemu_uid,
                    known=known,
                    readonly=m.readonly,
                )
            else:
                binds.bind(
                    qemu, src_fd, shared / rel, m.readonly, m.recursive, m.propagation, beneath=shared, root_as=qemu_uid
                )
        finally:
            os.close(src_fd)

    def pod_file_mounts(self, sandbox: SandboxRecord, covered: set[str]) -> tuple[oci_spec.Mount, ...]:
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
