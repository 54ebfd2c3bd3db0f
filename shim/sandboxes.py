"""``Sandboxes``: the owners of pods' state, made and composed once, and a pod's plan.

It composes the owners of a pod's state: its records (``shim.records``: typed values decoded
once, kept in memory and written through to the ledger, ledger first), its guest's boot and the
snapshots of its shape (``shim.boot``), the reconcile with libvirt and the turning NOTREADY of a
pod whose guest died or lost its agent (``shim.reconcile``), host resources
(``shim.host_resources``), pod networks (``shim.pod_networks``), each sandbox's directory
(``shim.sandbox_dirs``) and snapshots (``shim.snapshots``). The sandbox RPCs (``shim.rpc``) order
their calls; it plans a pod (``plan``, as ``vmsandbox plan`` does). Containers are admitted into
a sandbox by ``shim.container_admission``, under the same per-sandbox lock (``locks``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from shim.boot import Boot
from shim.config import ShimConfig
from shim.host_resources import ResourceManager
from shim.model import SandboxSpec
from shim.pod_networks import PodNetworks
from shim.reconcile import Reconciler
from shim.records import Records, SandboxLocks
from shim.sandbox_dirs import SandboxDirs
from shim.sandbox_part import Owners
from shim.snapshots import Snapshots
from vmsandbox.adapters.hypervisor import Hypervisor
from vmsandbox.adapters.ledger import Ledger
from vmsandbox.adapters.sysfs import read_inventory
from vmsandbox.host import HostInventory
from vmsandbox.lifecycle import SandboxPlan, plan_sandbox
from vmsandbox.profile import Profile

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
    def plan(self, spec: SandboxSpec) -> SandboxPlan:
        """What the pod gets (profile, shape, devices, accelerator): the same function ``vmsandbox plan`` runs."""
        facts = self.policy.facts(self.inventory(), spec.declaration, kvm_device=os.path.exists("/dev/kvm"))
        return plan_sandbox(spec, self.profiles, facts, default_handler=self.config.default_handler)
