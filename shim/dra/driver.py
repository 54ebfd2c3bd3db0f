"""The DRA driver as the shim runs it: the claim store, host-local IPAM, the API server client, the
kubelet plugin and the ResourceSlices, started together after the shim's own state is back (host-local's
allocations reconciled with the store before the plugin answers) and stopped at a clean stop (the
slices deleted, the sockets removed; the prepared claims and their addresses stay for the next
start). It writes the claims' status: once a pod is READY, when its RunPodSandbox failed (each
device ``Ready`` ``False`` with the reason), and again for READY pods after a restart."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from shim import faults
from shim.dra.ipam import HostLocal
from shim.dra.kube import KubeClient
from shim.dra.pci import PciDevices
from shim.dra.plugin import DraPlugin
from shim.dra.slices import Slices
from shim.dra.store import ClaimStore
from vmsandbox import validation
from vmsandbox.agent_protocol import NicReport
from vmsandbox.dra import (
    ClaimedNic,
    DraConfig,
    NetworkAttachment,
    PreparedClaim,
    claim_failure_status,
    claim_status,
    claimed_nics,
    is_pci,
)
from vmsandbox.dra_pci import network_claims
from vmsandbox.errors import VmSandboxError

log = logging.getLogger(__name__)


def node_name(config: DraConfig) -> str:
    """The node the kubelet registers: the configured name, else the host's (as the kubelet's)."""
    name = config.node_name or socket.gethostname().lower()
    validation.dns1123_subdomain(name, "dra node_name")
    return name


def claims_dir(state_dir: str) -> Path:
    return Path(state_dir) / "dra" / "claims"


def ipam_dir(config: DraConfig, state_dir: str) -> Path:
    """host-local's dataDir for claimed NICs: ``dra.ipam_dir``, else under the state directory."""
    return Path(config.ipam_dir) if config.ipam_dir else Path(state_dir) / "dra" / "ipam"


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class DraDriver:
    store: ClaimStore
    plugin: DraPlugin
    slices: Slices
    client: KubeClient | None = None
    driver: str = ""
    networks: tuple[NetworkAttachment, ...] = ()

    @classmethod
    def start(
        cls,
        config: DraConfig,
        state_dir: str,
        slice_interval_s: float = 30.0,
        pci: PciDevices | None = None,
        cni_bin_dirs: Sequence[str] = ("/opt/cni/bin", "/usr/lib/cni"),
    ) -> DraDriver:
        """``pci``: the passthrough devices to publish (None: no PCI pool); ``cni_bin_dirs``: where
        CNI host-local is found."""
        node = node_name(config)
        (Path(state_dir) / "dra").mkdir(mode=0o700, exist_ok=True)
        store = ClaimStore(claims_dir(state_dir))
        ipam = HostLocal(config.networks, ipam_dir(config, state_dir), cni_bin_dirs)
        ipam.reconcile(store)  # before the kubelet can prepare or unprepare anything
        client = KubeClient(config.kubeconfig)
        plugin = DraPlugin(config, node, store, client, pci, ipam)
        slices = Slices(config, node, client, slice_interval_s, pci=pci.groups if pci is not None else None)
        slices.start()
        plugin.start()
        log.info("DRA: driver %s on node %s, %d prepared claims kept", config.driver_name, node, len(store.all()))
        return cls(store, plugin, slices, client, config.driver_name, config.networks)

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
        faults.checkpoint("dra:before-status")
        self._write_status(claims, nics, reported, where)
        faults.checkpoint("dra:after-status")

    def _write_status(
        self,
        claims: Sequence[PreparedClaim],
        nics: Sequence[ClaimedNic],
        reported: Sequence[NicReport],
        where: str = "the pod's VM",
    ) -> None:
        if self.client is None:
            return
        now = _now()
        at = 0
        for claim in claims:
            count = sum(1 for d in claim.devices if not is_pci(d))
            mine, at = nics[at : at + count], at + count
            try:
                body = claim_status(claim, self.driver, mine, reported, now, where)
                self.client.apply_claim_status(claim.namespace, claim.name, body, self.driver)
            except (VmSandboxError, ValueError) as exc:
                log.warning("DRA: status of claim %s/%s not written: %s", claim.namespace, claim.name, exc)

    def write_failure(self, claims: Sequence[PreparedClaim], reason: str, message: str) -> None:
        """A pod's RunPodSandbox failed: each of its claims' devices ``Ready`` ``False`` with
        ``reason`` and ``message`` (``vmsandbox.dra.claim_failure_status``). Best effort: a write
        that fails is logged, and each is bounded by the client's timeout."""
        if self.client is None:
            return
        now = _now()
        for claim in claims:
            try:
                body = claim_failure_status(claim, self.driver, reason, message, now)
                self.client.apply_claim_status(claim.namespace, claim.name, body, self.driver)
            except (VmSandboxError, ValueError) as exc:
                log.warning("DRA: failure status of claim %s/%s not written: %s", claim.namespace, claim.name, exc)

    def resync_status(self, pods: Iterable[tuple[str, str, str]], report: Callable[[str], Sequence[NicReport]]) -> int:
        """After a start: write again the status of the claims of each READY pod, given as (sandbox
        id, namespace/name, pod uid), from what its guest reports now (``report``, by sandbox id);
        the same write as at RunPodSandbox, so one already there changes nothing. How many pods'."""
        done = 0
        for sandbox_id, pod, uid in pods:
            claims = self.store.for_pod(uid)
            if not claims:
                continue
            try:
                nic_claims = network_claims(claims)  # the NICs as RunPodSandbox made them
                nics = claimed_nics(pod, sandbox_id, nic_claims, self.networks) if nic_claims else ()
                reported = report(sandbox_id)
            except (VmSandboxError, ValueError, OSError) as exc:
                log.warning("DRA: status of pod %s's claims not written again: %s", pod, exc)
                continue
            self._write_status(claims, nics, reported)
            done += 1
        return done

    def stop(self) -> None:
        self.plugin.stop()
        self.slices.stop()
