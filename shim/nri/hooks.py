"""``NriHooks``: the one call per CRI event the RPCs make into NRI, and what NRI asks back.

It turns the shim's records (the RPC's, read once) into NRI's PodSandbox and Container, calls
the plugins through ``NriHost`` and carries out their answers through the owners: a
CreateContainer adjustment becomes the container's spec (env, annotations, command line,
rlimits, mounts, resources) after the same divergence admission as the container itself;
container updates, from an event's answer or a plugin's own UpdateContainers, go through
``ContainerAdmission.update`` (the VM's envelope) and ``Containers.apply_limits``. With NRI off
every hook is a no-op.

When plugins are called, and why:
- RunPodSandbox: after the VM booted (the pod has its id and IPs), with the pod's whole size as
  ``pod_resources``. NRI gives plugins no way to adjust a pod here, so the VM is sized from the
  pod's declaration alone; a plugin may only refuse the pod, which tears the new VM down and
  fails RunPodSandbox with the plugin's message. Plugins that accepted a pod whose RunPodSandbox
  then fails are told RemovePodSandbox (``sandbox_removed``), as containerd tells them.
- StopPodSandbox and RemovePodSandbox: after the teardown, so a failing or hanging plugin never
  holds a VM or its resources; each first tells StopContainer / RemoveContainer for the pod's
  containers, as containerd does.
- CreateContainer: the adjustment before the container is admitted (a refusal fails it with
  nothing made), PostCreateContainer as its last step; a create that fails after that tells
  RemoveContainer, as containerd's undo of a create does.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import replace

from gen.nri import api_pb2 as api
from shim.containers import Containers
from shim.model import (
    ContainerRecord,
    ContainerSpec,
    MountRequest,
    SandboxRecord,
    siblings_of,
)
from shim.nri import codec
from shim.nri.host import NriHost
from shim.sandboxes import Sandboxes
from vmsandbox import admission, nri_rules, oci_spec, validation
from vmsandbox.errors import VmSandboxError
from vmsandbox.lifecycle import check_fits_beside
from vmsandbox.sizing import LinuxResources

log = logging.getLogger(__name__)


class NriHooks:
    def __init__(self, host: NriHost | None, sandboxes: Sandboxes, containers: Containers) -> None:
        self.host = host
        self.sandboxes = sandboxes
        self.records = sandboxes.records
        self.containers = containers
        self._told_stopped: set[str] = set()  # containers plugins were told of as stopped
        self._told_lock = threading.Lock()

    def plugins(self) -> list[str]:
        return self.host.registered() if self.host is not None else []

    # -- what plugins see at registration and ask for at any time ---------------------------------
    def snapshot(self) -> tuple[list[api.PodSandbox], list[api.Container]]:
        return (
            [codec.pod(r) for r in self.records.list_sandboxes()],
            [codec.container(c) for c in self.records.containers()],
        )

    def apply_updates(self, plugin: str, updates: list[api.ContainerUpdate]) -> list[api.ContainerUpdate]:
        """Carry out a plugin's container updates through the VM's admission; the failed ones."""
        failed = []
        for u in updates:
            try:
                c = self.records.container(u.container_id)
                target = nri_rules.Target(name=c.name, linux=c.linux)
                after = nri_rules.apply_adjustment(target, plugin, codec.update(u)).linux
                if after != target.linux:
                    changed = self.containers.admission.update(self.records.get(c.sandbox_id), c, None, after)
                    self.containers.apply_limits(changed)
            except VmSandboxError as exc:
                log.warning("NRI: update of container %s by plugin %s refused: %s", u.container_id[:12], plugin, exc)
                if not u.ignore_failure:
                    failed.append(u)
        return failed

    # -- pod events -------------------------------------------------------------------------------
    def sandbox_started(self, sandbox_id: str) -> None:
        """Raises the plugins' refusal; RunPodSandbox (``shim.rpc.run_pod_sandbox``) then tears the new VM down."""
        if self.host is not None:
            self.host.run_pod_sandbox(codec.pod(self.records.get(sandbox_id)))

    def sandbox_stopped(self, record: SandboxRecord) -> None:
        """After the pod's teardown: StopContainer for each of its containers plugins were not
        told of yet (as containerd stops them one by one), then StopPodSandbox."""
        if self.host is None:
            return
        pod = codec.pod(record)
        for c in self.records.containers(record.id):
            with self._told_lock:
                if c.id in self._told_stopped:
                    continue
                self._told_stopped.add(c.id)
            for plugin, u in self.host.stop_container(pod, codec.container(c)):
                self.apply_updates(plugin, [u])
        self.host.stop_pod_sandbox(pod)

    def sandbox_removed(self, record: SandboxRecord, members: list[ContainerRecord]) -> None:
        """After the pod's removal: RemoveContainer for each container it held, then RemovePodSandbox."""
        if self.host is None:
            return
        pod = codec.pod(record)
        for c in members:
            with self._told_lock:
                self._told_stopped.discard(c.id)
            self.host.remove_container(pod, codec.container(c))
        self.host.remove_pod_sandbox(pod)

    def sandbox_updated(self, sandbox_id: str, overhead: LinuxResources, resources: LinuxResources) -> None:
        if self.host is None:
            return
        pod = codec.pod(self.records.get(sandbox_id))
        self.host.update_pod_sandbox(pod, codec.resources(overhead), codec.resources(resources))
        self.host.post_update_pod_sandbox(pod)

    # -- container events -------------------------------------------------------------------------
    def adjust_container(
        self, sandbox: SandboxRecord, spec: ContainerSpec, run: oci_spec.ContainerRequest
    ) -> tuple[ContainerSpec, oci_spec.ContainerRequest, list[MountRequest]]:
        """The container as the plugins adjust it, refused (naming them) when it leaves the pod's
        declaration or the VM: its spec (its ``mounts`` stay the kubelet's, which admission
        compares with the declaration), what it runs, and the mounts its guest gets."""
        mounts = list(spec.mounts)
        if self.host is None:
            return spec, run, mounts
        if spec.linux.empty and spec.resources is not None:
            before = admission.implied_linux(spec.resources)
        else:
            before = spec.linux
        pod = codec.pod(sandbox)
        ctr = api.Container(
            pod_sandbox_id=sandbox.id,
            name=spec.name,
            state=api.CONTAINER_UNKNOWN,
            labels=spec.labels,
            annotations=spec.annotations,
            args=[*run.command, *run.args],
            env=[f"{k}={v}" for k, v in run.env],
        )
        ctr.linux.resources.CopyFrom(codec.resources(before))
        ctr.rlimits.extend(api.POSIXRlimit(type=t, hard=h, soft=s) for t, h, s in run.rlimits)
        ctr.mounts.extend(
            api.Mount(
                destination=m.container_path, source=m.host_path, type="bind", options=["ro"] if m.readonly else []
            )
            for m in mounts
        )
        start = nri_rules.Target(
            name=spec.name, annotations=dict(spec.annotations), env=run.env, rlimits=run.rlimits, linux=before
        )
        target, updates = self.host.create_container(pod, ctr, start)
        if target.annotations != spec.annotations:  # what plugins add obeys Kubernetes' rules too
            validation.annotation_map(
                target.annotations, f'container "{spec.name}" annotations as NRI plugins set them'
            )
        self._check_resources(sandbox, spec, target, before)
        if target.linux != before:
            spec = replace(spec, linux=target.linux)
        spec = replace(spec, annotations=dict(target.annotations))
        changes: dict[str, object] = {"env": target.env, "rlimits": target.rlimits}
        if target.args is not None:
            changes.update(command=target.args, args=())
        if target.oom_score_adj is not None:
            changes["oom_score_adj"] = target.oom_score_adj
        run = replace(run, **changes)  # type: ignore[arg-type]
        added = {dest for dest, _, _ in target.mounts}
        mounts = [m for m in mounts if m.container_path not in added] + [
            MountRequest(dest, source, readonly) for dest, source, readonly in target.mounts
        ]
        for plugin, u in updates:
            self.apply_updates(plugin, [u])
        return spec, run, mounts

    def _check_resources(
        self, sandbox: SandboxRecord, spec: ContainerSpec, target: nri_rules.Target, before: LinuxResources
    ) -> None:
        declared = None
        if sandbox.declaration is not None:
            found = sandbox.declaration.find(spec.name)
            declared = found.resources if found is not None else None
        nri_rules.resource_divergence(target, before, declared, self._fits(sandbox, spec.name))

    def _fits(self, sandbox: SandboxRecord, name: str) -> Callable[[admission.Usage, str], None]:
        """The envelope rule for container ``name`` of ``sandbox``, as CreateContainer and
        UpdateContainerResources hold it (``lifecycle.check_fits_beside``)."""
        siblings = siblings_of(self.records.containers(sandbox.id))

        def fits(usage: admission.Usage, who: str) -> None:
            check_fits_beside(
                sandbox.envelope(),
                name,
                usage,
                siblings,
                init_order=sandbox.init_container_names,
                annotations=sandbox.annotations,
                who=who,
            )

        return fits

    def container_created(self, sandbox: SandboxRecord, c: ContainerRecord) -> None:
        if self.host is not None:
            self.host.post_create_container(codec.pod(sandbox), codec.container(c))

    def container_starting(self, sandbox: SandboxRecord, c: ContainerRecord) -> None:
        if self.host is not None:
            self.host.start_container(codec.pod(sandbox), codec.container(c))

    def container_started(self, sandbox: SandboxRecord, c: ContainerRecord) -> None:
        if self.host is not None:
            self.host.post_start_container(codec.pod(sandbox), codec.container(c))

    def update_container(self, sandbox: SandboxRecord, c: ContainerRecord, linux: LinuxResources) -> LinuxResources:
        """Plugins' say on an update: the resources to apply (their changes to this container
        included; changes to others carried out at once)."""
        if self.host is None:
            return linux
        updates = self.host.update_container(codec.pod(sandbox), codec.container(c), codec.resources(linux))
        target = nri_rules.Target(name=c.name, linux=linux)
        for plugin, u in updates:
            if u.container_id == c.id:
                target = nri_rules.apply_adjustment(target, plugin, codec.update(u))
            else:
                self.apply_updates(plugin, [u])
        if target.resource_plugins:  # an update is held to the VM's envelope; a refusal names the plugins
            nri_rules.resource_divergence(target, linux, None, self._fits(sandbox, c.name))
        return target.linux

    def container_updated(self, sandbox: SandboxRecord, c: ContainerRecord) -> None:
        if self.host is not None:
            self.host.post_update_container(codec.pod(sandbox), codec.container(c))

    def container_stopped(self, sandbox: SandboxRecord, c: ContainerRecord) -> None:
        if self.host is None:
            return
        with self._told_lock:
            self._told_stopped.add(c.id)
        for plugin, u in self.host.stop_container(codec.pod(sandbox), codec.container(c)):
            self.apply_updates(plugin, [u])

    def container_removed(self, sandbox: SandboxRecord, c: ContainerRecord) -> None:
        if self.host is None:
            return
        with self._told_lock:
            self._told_stopped.discard(c.id)
        self.host.remove_container(codec.pod(sandbox), codec.container(c))
