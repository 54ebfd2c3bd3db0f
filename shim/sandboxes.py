"""``Sandboxes``: a pod's life cycle — run, stop, remove, update — and its containers' admission.

It composes the owners of a pod's state: its records (``shim.records``: typed values decoded
once, kept in memory and written through to the ledger, ledger first), its boot, snapshots and
rollback (``shim.boot``), the reconcile with libvirt and the turning NOTREADY of a pod whose guest
died or lost its agent (``shim.reconcile``), host resources (``shim.host_resources``), pod networks
(``shim.pod_networks``), each sandbox's directory (``shim.sandbox_dirs``) and snapshots
(``shim.snapshots``). Containers are admitted into a sandbox by ``shim.container_admission``,
under the same per-sandbox lock (``locks``). RunPodSandbox is
transactional: any failure after the claim tears the domain down and releases every claim
before the error leaves ``shim.boot``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import replace

from shim import faults, logs
from shim.boot import Boot
from shim.config import ShimConfig
from shim.host_resources import ResourceManager
from shim.model import (
    SANDBOX_NOTREADY,
    SandboxSpec,
)
from shim.pod_networks import PodNetworks
from shim.reconcile import Reconciler, remove_console_log
from shim.records import Records, SandboxLocks, new_id
from shim.sandbox_dirs import SandboxDirs
from shim.sandbox_part import Owners
from shim.snapshots import Snapshots
from vmsandbox import admission
from vmsandbox.adapters.hypervisor import Hypervisor
from vmsandbox.adapters.ledger import Ledger
from vmsandbox.adapters.sysfs import read_inventory
from vmsandbox.errors import InvalidArgument
from vmsandbox.host import HostInventory
from vmsandbox.lifecycle import (
    SandboxPlan,
    plan_sandbox,
)
from vmsandbox.profile import Profile
from vmsandbox.sizing import LinuxResources

log = logging.getLogger(__name__)


class Sandboxes:
    def __init__(
        self,
        config: ShimConfig,
        ledger: Ledger,
        hypervisor: Hypervisor,
        profiles: dict[str, Profile],
        *,
        inventory: Callable[[], HostInventory] | None = None,
        clock: Callable[[], int] = time.time_ns,
        resources: ResourceManager | None = None,
        network: PodNetworks | None = None,
    ) -> None:
        self.config = config
        self.ledger = ledger
        self.hypervisor = hypervisor
        self.profiles = profiles
        self.profiles_by_name = {p.name: p for p in profiles.values()}
        self.network = network or PodNetworks(config)  # the one owner of pods' namespaces and CNI attachments
        self.inventory = inventory or (lambda: read_inventory(config.sys_root, config.proc_root))
        self._clock = clock
        self.locks = SandboxLocks()
        # the one owner of the sandbox and container records (and their ledger rows), pod names and the generation
        self.records = Records(ledger)
        # each sandbox's directory (the share its guest mounts over 9p): made for a boot, dropped when
        # a boot is rolled back or the sandbox removed, swept for sandboxes that no longer exist
        self.dirs = SandboxDirs(config.state_dir, hypervisor.daemon_pid)
        first = self.inventory()
        # the one owner of CPUs, pages, memory and devices: its free state is rebuilt from the ledger
        self.resources = resources or ResourceManager.open(config, first, ledger)
        self.policy = self.resources.policy
        # the one owner of snapshots (their making, storing and restoring)
        self.snapshots = Snapshots(config.state_dir, hypervisor, ledger.instance_id, self.resources)
        owners = Owners(
            config,
            ledger,
            hypervisor,
            self.records,
            self.locks,
            self.resources,
            self.snapshots,
            self.dirs,
            self.network,
            clock,
        )
        self.boot = Boot(owners)
        self.reconciler = Reconciler(owners)
        for problem in self.policy.problems(first, profiles.values()):
            log.warning("%s", problem)

    # -- sandboxes ------------------------------------------------------------------------------
    def run(self, spec: SandboxSpec) -> str:
        started = time.monotonic()
        meta = spec.meta
        logs.bind(pod=f"{meta.namespace}/{meta.name}")
        for field_name in ("name", "namespace", "uid"):
            if not getattr(meta, field_name):
                raise InvalidArgument(f"PodSandboxConfig.metadata.{field_name} is empty")
        if meta.attempt < 0:
            raise InvalidArgument(f"PodSandboxConfig.metadata.attempt is negative ({meta.attempt})")
        plan = self.plan(spec)
        sandbox_id = new_id()
        self.records.reserve_name(meta, sandbox_id)
        self.locks.in_flight.add(sandbox_id)
        try:
            return self.boot.start_pod(spec, plan, sandbox_id, started)
        except BaseException:
            self.records.release_name(meta, sandbox_id)
            raise
        finally:
            self.locks.in_flight.discard(sandbox_id)

    def plan(self, spec: SandboxSpec) -> SandboxPlan:
        """What the pod gets (profile, shape, devices, accelerator): the same function ``vmsandbox plan`` runs."""
        facts = self.policy.facts(self.inventory(), spec.declaration, kvm_device=os.path.exists("/dev/kvm"))
        return plan_sandbox(spec, self.profiles, facts, default_handler=self.config.default_handler)

    def stop(self, sandbox_id: str) -> None:
        """Destroy the guest and release its resources; unknown ids and repeats succeed."""
        found = self.records.find_for_teardown(sandbox_id)
        if found is None:
            return
        sandbox_id = found.id
        with self.locks.lock_for(sandbox_id):
            record = self.records.find(sandbox_id)
            if record is None:
                return
            self.hypervisor.destroy(record.domain)
            faults.checkpoint("remove:after-destroy")
            self.hypervisor.teardown(record.domain)  # undefine
            self.resources.release(sandbox_id)
            faults.checkpoint("remove:after-release")
            self.records.exit_containers(sandbox_id, reason="SandboxStopped")
            if record.state != SANDBOX_NOTREADY:
                self.records.put_sandbox(record.with_state(SANDBOX_NOTREADY))
                log.info("sandbox %s stopped: domain %s removed, resources released", sandbox_id[:12], record.domain)
            self.network.detach(sandbox_id)  # raises while CNI DEL fails; the next Stop tries again

    def remove(self, sandbox_id: str) -> None:
        # paths below are built from the id of a row we wrote, never the client's
        found = self.records.find_for_teardown(sandbox_id)
        if found is None:
            return
        sandbox_id = found.id
        self.stop(sandbox_id)
        with self.locks.lock_for(sandbox_id):
            self.network.remove(sandbox_id)
            record = self.records.find(sandbox_id)
            if record is not None:
                self.records.release_name(record.meta, record.id)
            self.records.delete_sandbox(sandbox_id)
            remove_console_log(self.config.console_dir, sandbox_id)
        self.locks.forget(sandbox_id)

    def update_sandbox(self, sandbox_id: str, resources: LinuxResources) -> None:
        """UpdatePodSandboxResources: accepted and recorded when it fits the VM, else FAILED_PRECONDITION."""
        sandbox_id = self.records.get(sandbox_id).id
        with self.locks.lock_for(sandbox_id):
            record = self.records.get(sandbox_id)
            admission.check_envelope(
                record.sized_shape().demand, [], admission.Usage.of_linux(resources), who="the pod's new resources"
            )
            updated = replace(record, updated_resources=resources)
            self.records.put_sandbox(updated)
