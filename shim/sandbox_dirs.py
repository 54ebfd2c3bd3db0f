"""``SandboxDirs``: each sandbox's directory on the host, ``<state>/sandboxes/<id>/``, and its layout.

Below it are ``shared/`` (the share the guest mounts over virtio-9p: the pod's files and each
container's ``containers/<id>/``) and ``disks/`` (the places where image disks are bound into the
sandbox's QEMU). This module alone knows those paths. It makes a sandbox's directory before its
QEMU starts, owned by that QEMU's uid, removes it when the sandbox goes, and sweeps the
directories of sandboxes nobody remembers. ``Sandboxes`` holds the one instance (a boot makes
the directory, a rollback and a removal drop it, the reconcile sweeps); ``Containers`` works
inside it through the same instance.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from vmsandbox import validation
from vmsandbox.adapters import binds, shared_tree
from vmsandbox.agent_protocol import SHARED_TAG
from vmsandbox.domain import SharedDir

log = logging.getLogger(__name__)


class SandboxDirs:
    def __init__(self, state_dir: str) -> None:
        # resolved once: below it, paths are taken as written (a guest may have made symlinks there)
        self.root = Path(os.path.realpath(state_dir)) / "sandboxes"

    def shared(self, sandbox_id: str) -> Path:
        return self.root / sandbox_id / "shared"

    def disks(self, sandbox_id: str) -> Path:
        return self.root / sandbox_id / "disks"

    def make(self, sandbox_id: str, qemu_uid: int) -> tuple[SharedDir, ...]:
        """The sandbox's shared directory, made before its QEMU starts: the sandbox's directory
        and the share are QEMU's own (``qemu_uid``, mode 0700), the directories above them only
        passable (0711), so no other sandbox's QEMU (nor any other unprivileged host user) can
        open them."""
        shared = self.shared(sandbox_id)
        shared.mkdir(parents=True, exist_ok=True)
        shared_tree.make_dirs(shared, "containers")
        os.chmod(self.root, 0o711)
        for d in (self.root / sandbox_id, shared):
            os.chown(d, qemu_uid, qemu_uid)
            os.chmod(d, 0o700)
        # mapped: nothing the guest writes here (volumes included) is a setuid file, a file
        # capability, a symlink or a device node on the host, nor owned by anyone but QEMU's user
        return (SharedDir(str(shared), SHARED_TAG, accessmode="mapped"),)

    def drop(self, sandbox_id: str) -> None:
        """Remove a sandbox's directory (its guest is gone, and the mounts in its QEMU and the image
        disks with it)."""
        binds.remove_tree(self.root, sandbox_id)

    def drop_container(self, sandbox_id: str, container_id: str) -> None:
        """Remove a container's directory in the share (its binds detached first by the caller)."""
        binds.remove_tree(self.shared(sandbox_id), f"containers/{container_id}")

    def sweep(self, keep: set[str]) -> None:
        """Remove the directories of sandboxes nobody remembers (a crash between tear-down and removal)."""
        try:
            dirs = sorted(p for p in self.root.iterdir() if p.is_dir())
        except OSError:
            return
        for d in dirs:
            sid = d.name
            if sid in keep or not validation.is_full_id(sid):
                continue
            binds.remove_tree(self.root, sid)
            log.info("reconcile: removed the directory of forgotten sandbox %s", sid[:12])
