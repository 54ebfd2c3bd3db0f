"""``SandboxDirs``: each sandbox's directory on the host, ``<state>/sandboxes/<id>/``, and its layout.

Below it are ``shared/`` (the share the guest mounts over virtio-9p: the pod's files and each
container's ``containers/<id>/``) and ``disks/`` (the places where image disks are bound into the
sandbox's QEMU). The directory is a file system of its own, ``<state>/sandboxes/<id>.img``
loop-mounted (``vmsandbox.adapters.share_image``), sized by ``vmsandbox.shared_storage``: what the
guest writes stops there, and its use is one ``statvfs``. It is mounted on the sandbox's
directory, not on ``shared/``, because the binds made in QEMU's namespace below ``shared/`` are
let go by detaching every mount there (``binds.unbind_all``).

This module alone knows those paths. It makes a sandbox's directory before its QEMU starts, owned
by that QEMU's uid, removes it when the sandbox goes (unmounted, then its image deleted: nothing
the guest wrote is walked), and sweeps the directories and images of sandboxes nobody remembers.
``Sandboxes`` holds the one instance (RunPodSandbox makes the directory and its rollback drops
it, a removal drops it through ``Containers``, the reconcile sweeps); ``Containers`` works inside
it through the same instance.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

from vmsandbox import shared_storage, validation
from vmsandbox.adapters import binds, share_image, shared_tree
from vmsandbox.agent_protocol import SHARED_TAG
from vmsandbox.domain import SharedDir
from vmsandbox.errors import InfrastructureError

log = logging.getLogger(__name__)


class SandboxDirs:
    def __init__(self, state_dir: str, namespace_pid: Callable[[], int | None] = lambda: None) -> None:
        # resolved once: below it, paths are taken as written (a guest may have made symlinks there)
        self.root = Path(os.path.realpath(state_dir)) / "sandboxes"
        # the hypervisor daemon, whose mount namespace QEMU's are copied from (share_image.mount)
        self.namespace_pid = namespace_pid

    def shared(self, sandbox_id: str) -> Path:
        return self.root / sandbox_id / "shared"

    def disks(self, sandbox_id: str) -> Path:
        return self.root / sandbox_id / "disks"

    def image(self, sandbox_id: str) -> Path:
        return self.root / f"{sandbox_id}.img"

    def make(self, sandbox_id: str, qemu_uid: int, capacity_bytes: int | None) -> tuple[SharedDir, ...]:
        """The sandbox's shared directory, made before its QEMU starts: the sandbox's directory
        and the share are QEMU's own (``qemu_uid``, mode 0700), the directories above them only
        passable (0711), so no other sandbox's QEMU (nor any other unprivileged host user) can
        open them. The sandbox's directory is a file system where ``capacity_bytes`` can be
        written (None: a plain directory, for a guest that never starts). On failure nothing of
        it is left."""
        top = self.root / sandbox_id
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o711)
        try:
            top.mkdir(mode=0o700)
        except FileExistsError:  # ids are new: this is not a directory to take over (nor to drop)
            raise InfrastructureError(f"sandbox directory {top} exists already") from None
        try:
            if capacity_bytes is not None:
                image = self.image(sandbox_id)
                share_image.make(image, shared_storage.image_bytes(capacity_bytes), qemu_uid)
                share_image.mount(image, top, namespace_pid=self.namespace_pid())
                with contextlib.suppress(FileNotFoundError):
                    os.rmdir(top / "lost+found")
            shared = self.shared(sandbox_id)
            shared.mkdir(exist_ok=True)
            shared_tree.make_dirs(shared, "containers")
            for d in (top, shared):
                os.chown(d, qemu_uid, qemu_uid)
                os.chmod(d, 0o700)
        except BaseException:
            self.drop(sandbox_id)
            raise
        # mapped: nothing the guest writes here (volumes included) is a setuid file, a file
        # capability, a symlink or a device node on the host, nor owned by anyone but QEMU's user
        return (SharedDir(str(shared), SHARED_TAG, accessmode="mapped"),)

    def drop(self, sandbox_id: str) -> None:
        """Remove a sandbox's directory (its guest is gone, and the mounts in its QEMU and the image
        disks with it): its file system is detached, the directory below (empty: the mount point)
        removed, its image deleted. A QEMU that still holds the file system keeps it until it exits."""
        top = self.root / sandbox_id
        share_image.unmount(top, namespace_pid=self.namespace_pid())
        binds.remove_tree(self.root, sandbox_id)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.image(sandbox_id))

    def adopt(self, sandbox_ids: set[str]) -> int:
        """At start-up, in a mount namespace other than the hypervisor daemon's: the file systems of
        these running sandboxes are seen here again (``share_image.adopt``); returns how many."""
        pid = self.namespace_pid()
        return sum(share_image.adopt(self.root / sid, pid) for sid in sorted(sandbox_ids))

    def usage(self, sandbox_id: str) -> share_image.Usage | None:
        """What the sandbox's guest has written on the host (one ``statvfs``), or None for a
        sandbox whose directory has no file system of its own (made by an earlier version)."""
        return share_image.usage(self.root / sandbox_id)

    def total_usage(self) -> tuple[int, int]:
        """(bytes, inodes) used in every sandbox's file system: one ``statvfs`` each, nothing walked."""
        used = inodes = 0
        try:
            names = [e.name for e in os.scandir(self.root) if validation.is_full_id(e.name)]
        except OSError:
            return 0, 0
        for sid in names:
            u = self.usage(sid)
            if u is not None:
                used += u.used_bytes
                inodes += u.used_inodes
        return used, inodes

    def drop_container(self, sandbox_id: str, container_id: str) -> None:
        """Remove a container's directory in the share (its binds detached first by the caller)."""
        binds.remove_tree(self.shared(sandbox_id), f"containers/{container_id}")

    def sweep(self, keep: set[str]) -> None:
        """Remove the directories and images of sandboxes nobody remembers (a crash between
        tear-down and removal, or in the middle of making one)."""
        try:
            names = sorted({p.name.removesuffix(".img") for p in self.root.iterdir()})
        except OSError:
            return
        for sid in names:
            if sid in keep or not validation.is_full_id(sid):
                continue
            self.drop(sid)
            log.info("reconcile: removed the directory of forgotten sandbox %s", sid[:12])
