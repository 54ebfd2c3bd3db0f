"""``ContainerAdmission``: whether a container may join its pod's VM, and its limits from then on.

A CreateContainer is admitted against its pod's declaration (KEP-4112) or, for a pod sized from
LinuxPodSandboxConfig, the VM's room beside its siblings (``vmsandbox.lifecycle.admit_container``),
and recorded CREATED (``admit``); an UpdateContainerResources is held to the same envelope
(``check_fits_beside``) and recorded (``update``, undone by ``restore``). Each reads the pod's
containers and writes under the pod's lock (``SandboxLocks``), so two containers of one pod are
never admitted against the same room. The pod's record is the caller's, read once per RPC; only
whether the pod is still READY is read again, under the lock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from shim.model import (
    CONTAINER_CREATED,
    SANDBOX_READY,
    ContainerRecord,
    ContainerSpec,
    SandboxRecord,
    siblings_of,
)
from shim.records import Records, SandboxLocks, new_id
from vmsandbox import admission, validation
from vmsandbox.errors import AlreadyExists, Diverged, NotFound
from vmsandbox.lifecycle import ContainerAsk, admit_container, check_fits_beside, growth_beside
from vmsandbox.resize import Growth
from vmsandbox.resources import ContainerResources
from vmsandbox.sizing import LinuxResources

log = logging.getLogger(__name__)


class ContainerAdmission:
    def __init__(self, records: Records, locks: SandboxLocks, clock: Callable[[], int] = time.time_ns) -> None:
        self.records = records
        self.locks = locks
        self._clock = clock

    def admit(self, sandbox: SandboxRecord, spec: ContainerSpec, container_id: str = "") -> ContainerRecord:
        """The container, admitted into ``sandbox`` and recorded CREATED (naming no image yet: its
        guest has not made it), under ``container_id`` (its caller's choice; "": a new id);
        undo: ``Records.remove_container``."""
        with self.locks.lock_for(sandbox.id):
            if container_id and self.records.find_container(container_id) is not None:
                raise AlreadyExists(f"container {container_id} exists already")
            if self.records.get(sandbox.id).state != SANDBOX_READY:
                raise Diverged(f"pod sandbox {sandbox.id[:12]} is not ready (it was stopped)")
            existing = self.records.containers(sandbox.id)
            ask = ContainerAsk(spec.name, spec.attempt, spec.resources, spec.asked_attachments(), spec.linux)
            admitted = admit_container(
                sandbox.declaration,
                sandbox.sized_shape(),
                ask,
                siblings_of(existing),
                sandbox.annotations,
                sandbox.growth,
            )
            container = ContainerRecord(
                id=container_id or new_id(),
                sandbox_id=sandbox.id,
                name=spec.name,
                attempt=spec.attempt,
                state=CONTAINER_CREATED,
                created_ns=self._clock(),
                image=spec.image,
                labels=dict(spec.labels),
                annotations=dict(spec.annotations),
                log_path=validation.join_log_path(sandbox.log_directory, spec.log_path),
                resources=admitted.resources,
                # what the container's cgroup holds: as sent, else implied by its kubernetes_resources
                linux=admitted.linux,
                reason="Created",
                message="admitted; not yet created in its guest",
            )
            self.records.put_container(container)
        log.info("container %s (%s) admitted into sandbox %s", spec.name, container.id[:12], sandbox.id[:12])
        return container

    def update(
        self, sandbox: SandboxRecord, c: ContainerRecord, resources: ContainerResources | None, linux: LinuxResources
    ) -> ContainerRecord:
        """The container's new limits, recorded when they fit the VM beside its siblings (else
        CannotFit naming it); undo: ``restore``."""
        with self.locks.lock_for(sandbox.id):
            new_linux = admission.implied_linux(resources) if resources is not None and linux.empty else linux
            check_fits_beside(sandbox.envelope(), c.name, _usage(resources, linux), **self._beside(sandbox, c))
            changes: dict[str, Any] = {"linux": new_linux}
            if resources is not None:
                changes["resources"] = replace(c.resources, requests=resources.requests, limits=resources.limits)
            changed = self.records.change_container(c.id, **changes)
        if changed is None:
            raise NotFound(f"container {c.id[:12]} was removed")
        return changed

    def growth(
        self, sandbox: SandboxRecord, c: ContainerRecord, resources: ContainerResources | None, linux: LinuxResources
    ) -> Growth:
        """How far the pod's envelope must grow for the container's new limits to fit beside its
        siblings: the pod's growth when they fit; Diverged when its resize headroom cannot hold them."""
        with self.locks.lock_for(sandbox.id):
            return growth_beside(
                sandbox.sized_shape(), sandbox.growth, c.name, _usage(resources, linux), **self._beside(sandbox, c)
            )

    def _beside(self, sandbox: SandboxRecord, c: ContainerRecord) -> dict[str, Any]:
        """What the envelope rule needs of an update of ``c`` beside its siblings (under the pod's lock)."""
        return {
            "siblings": siblings_of(self.records.containers(sandbox.id)),
            "init_order": sandbox.init_container_names,
            "annotations": sandbox.annotations,
            "who": f'update of "{c.name}"',
        }

    def restore(self, c: ContainerRecord) -> None:
        """Undo of ``update``: the limits ``c`` recorded."""
        self.records.change_container(c.id, linux=c.linux, resources=c.resources)


def _usage(resources: ContainerResources | None, linux: LinuxResources) -> admission.Usage:
    """What an update's limits use: its kubernetes_resources when sent, else its LinuxContainerResources."""
    return admission.Usage.of_resources(resources) if resources is not None else admission.Usage.of_linux(linux)
