"""The DRA driver as the shim runs it: the claim store, the API server client, the kubelet plugin and
the ResourceSlices, started together after the shim's own state is back and stopped at a clean
stop (the slices deleted, the sockets removed; the prepared claims stay for the next start)."""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from shim.dra.kube import KubeClient
from shim.dra.pci import PciDevices
from shim.dra.plugin import DraPlugin
from shim.dra.slices import Slices
from shim.dra.store import ClaimStore
from vmsandbox import validation
from vmsandbox.agent_protocol import NicReport
from vmsandbox.dra import ClaimedNic, DraConfig, PreparedClaim, claim_status, is_pci
from vmsandbox.errors import VmSandboxError

log = logging.getLogger(__name__)


def node_name(config: DraConfig) -> str:
    """The node the kubelet registers: the configured name, else the host's (as the kubelet's)."""
    name = config.node_name or socket.gethostname().lower()
    validation.dns1123_subdomain(name, "dra node_name")
    return name


def claims_dir(state_dir: str) -> Path:
    return Path(state_dir) / "dra" / "claims"


@dataclass
class DraDriver:
    store: ClaimStore
    plugin: DraPlugin
    slices: Slices
    client: KubeClient | None = None
    driver: str = ""

    @classmethod
    def start(
        cls, config: DraConfig, state_dir: str, slice_interval_s: float = 30.0, pci: PciDevices | None = None
    ) -> DraDriver:
        """``pci``: the passthrough devices to publish (None: no PCI pool)."""
        node = node_name(config)
        (Path(state_dir) / "dra").mkdir(mode=0o700, exist_ok=True)
        store = ClaimStore(claims_dir(state_dir))
        client = KubeClient(config.kubeconfig)
        plugin = DraPlugin(config, node, store, client, pci)
        slices = Slices(config, node, client, slice_interval_s, pci=pci.groups if pci is not None else None)
        slices.start()
        plugin.start()
        log.info("DRA: driver %s on node %s, %d prepared claims kept", config.driver_name, node, len(store.all()))
        return cls(store, plugin, slices, client, config.driver_name)

    def write_status(
        self,
        claims: Sequence[PreparedClaim],
        nics: Sequence[ClaimedNic],
        reported: Sequence[NicReport],
        where: str = "the pod's VM",
    ) -> None:
        """Write each claim's ``status.devices[]`` (``vmsandbox.dra.claim_status``) once its pod's
        guest is up: ``nics`` are the claims' network devices' NICs in order, ``reported`` the
        guest's (a passthrough device has no NIC). A write that fails is logged: the pod runs with
        its NICs all the same. An ordinary pod's devices (``shim.dra.runc_nics``) are written so
        too, ``reported`` read from its namespace."""
        if self.client is None:
            return
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        at = 0
        for claim in claims:
            count = sum(1 for d in claim.devices if not is_pci(d))
            mine, at = nics[at : at + count], at + count
            try:
                body = claim_status(claim, self.driver, mine, reported, now, where)
                self.client.apply_claim_status(claim.namespace, claim.name, body, self.driver)
            except (VmSandboxError, ValueError) as exc:
                log.warning("DRA: status of claim %s/%s not written: %s", claim.namespace, claim.name, exc)

    def stop(self) -> None:
        self.plugin.stop()
        self.slices.stop()
