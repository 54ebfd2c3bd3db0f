"""``SandboxPart``: the owners that a pod's boot (``shim.boot``) and the reconcile with libvirt
(``shim.reconcile``) both work with (``Owners``, made once by ``Sandboxes``), as attributes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from shim.config import ShimConfig
from shim.host_resources import ResourceManager
from shim.pod_networks import PodNetworks
from shim.records import Records, SandboxLocks
from shim.sandbox_dirs import SandboxDirs
from shim.snapshots import Snapshots
from vmsandbox.adapters.hypervisor import Hypervisor
from vmsandbox.adapters.ledger import Ledger


@dataclass(frozen=True)
class Owners:
    config: ShimConfig
    ledger: Ledger
    hypervisor: Hypervisor
    records: Records
    locks: SandboxLocks
    resources: ResourceManager
    snapshots: Snapshots
    dirs: SandboxDirs
    network: PodNetworks
    clock: Callable[[], int]


class SandboxPart:
    def __init__(self, owners: Owners) -> None:
        self.config = owners.config
        self.ledger = owners.ledger
        self.hypervisor = owners.hypervisor
        self.records = owners.records
        self.locks = owners.locks
        self.resources = owners.resources
        self.snapshots = owners.snapshots
        self.dirs = owners.dirs
        self.network = owners.network
        self._clock = owners.clock
