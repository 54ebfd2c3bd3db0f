"""CNI host-local IPAM for the DRA driver's claimed network devices, one owner: it runs the
``host-local`` plugin (through ``vmsandbox.adapters.cni_exec``: found in the CNI plugin directories,
bounded in time and output, its error its own message) for each device of a claim without static
addresses, ADD at NodePrepareResources and DEL at NodeUnprepareResources, with its allocations
under ``dataDir`` (``<state_dir>/dra/ipam`` unless ``dra.ipam_dir`` says), one directory per network.
What each allocation is kept under and what the plugin is given are the core's
(``vmsandbox.dra_ipam``).

At start, ``reconcile`` DELetes what no prepared claim holds: the devices of a claim whose record
says ``adding`` (a prepare cut short: that claim is not prepared, its record goes) and any
allocation file of this driver's container ids whose claim is not prepared with it."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from shim import faults
from shim.dra.store import ClaimStore
from vmsandbox import dra_ipam
from vmsandbox.adapters import cni_exec
from vmsandbox.cni import CniError
from vmsandbox.dra import IPAM_ADDED, IPAM_ADDING, NetworkAttachment, PreparedClaim
from vmsandbox.dra_ipam import Allocation, IpamDevice
from vmsandbox.errors import VmSandboxError, WrongState

log = logging.getLogger(__name__)

MAX_FILES = 1 << 16  # allocation files read per network at start

Runner = Callable[..., dict[str, Any] | None]  # cni_exec.run_plugin's signature


class HostLocal:
    def __init__(
        self,
        networks: Sequence[NetworkAttachment],
        data_dir: Path,
        bin_dirs: Sequence[str],
        run: Runner = cni_exec.run_plugin,
    ) -> None:
        self._networks = {n.name: n for n in networks}
        self.data_dir = data_dir
        self._bin_dirs = tuple(bin_dirs)
        self._run = run
        data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(data_dir, 0o700)

    def _network(self, name: str) -> NetworkAttachment:
        network = self._networks.get(name)
        if network is None:
            raise WrongState(f"network {name} is not configured on this node")
        return network

    def _call(self, command: str, network: NetworkAttachment, device: IpamDevice) -> dict[str, Any] | None:
        return self._run(
            dra_ipam.PLUGIN,
            dra_ipam.plugin_input(network, str(self.data_dir)),
            dra_ipam.plugin_env(command, device, self._bin_dirs),
            self._bin_dirs,
            want_result=command == "ADD",
        )

    def add(self, claim: PreparedClaim) -> PreparedClaim:
        """ADD each of the claim's devices without static addresses; the claim with their addresses,
        ``added``. On a failure what was added is DELeted and the error raised."""
        devices = list(claim.devices)
        try:
            for device in dra_ipam.ipam_devices(claim):
                network = self._network(device.network)
                result = self._call("ADD", network, device)
                addresses = dra_ipam.added_addresses(result or {}, network)
                devices[device.index] = replace(devices[device.index], allocated=addresses)
                log.info("DRA: host-local gave %s on %s to claim %s device %d", ",".join(addresses),
                         network.name, claim.uid, device.index)  # fmt: skip
        except VmSandboxError:
            try:
                self.delete(claim)
            except VmSandboxError as exc:
                log.warning("DRA: claim %s: host-local DEL after a failed ADD: %s (DELeted at the next start)",
                            claim.uid, exc)  # fmt: skip
            raise
        faults.checkpoint("dra:after-ipam-add")
        return replace(claim, devices=tuple(devices), ipam=IPAM_ADDED)

    def delete(self, claim: PreparedClaim) -> None:
        """DEL each of the claim's host-local devices (a DEL of what host-local does not hold
        succeeds); the first failure is raised once every device was tried."""
        failed: list[str] = []
        for device in dra_ipam.ipam_devices(claim):
            try:
                self._delete(device.network, device)
            except VmSandboxError as exc:
                failed.append(str(exc))
        if failed:
            raise CniError(f"claim {claim.namespace}/{claim.name}: host-local DEL: {'; '.join(failed)[:1024]}")

    def _delete(self, network_name: str, device: IpamDevice) -> None:
        network = self._networks.get(network_name)
        if network is None:  # host-local needs the network's config: its files are ours to remove
            self._forget(network_name, device)
            return
        self._call("DEL", network, device)

    def _forget(self, network: str, device: IpamDevice) -> None:
        for allocation in self.allocations(only=network):
            if allocation.container_id == device.container_id:
                (self.data_dir / network / allocation.address).unlink(missing_ok=True)
                log.info("DRA: %s of unconfigured network %s released (its file removed)", allocation.address, network)

    def allocations(self, only: str | None = None) -> list[Allocation]:
        """host-local's allocation files, read bounded, never through a symlink."""
        out: list[Allocation] = []
        try:
            networks = sorted(p for p in self.data_dir.iterdir() if only is None or p.name == only)
        except OSError:
            return out
        for directory in networks:
            try:
                if not stat.S_ISDIR(os.lstat(directory).st_mode):
                    continue
                names = sorted(os.listdir(directory))[:MAX_FILES]
            except OSError:
                continue
            for name in names:
                content = _read_small(directory / name)
                if content is None:
                    continue
                got = dra_ipam.parse_allocation(directory.name, name, content)
                if got is not None:
                    out.append(got)
        return out

    def reconcile(self, store: ClaimStore) -> None:
        """At start: a claim whose prepare was cut short is DELeted and forgotten; allocations no
        prepared claim holds are DELeted. Failures are logged (the next start tries again)."""
        for claim in store.all():
            if claim.ipam != IPAM_ADDING:
                continue
            try:
                self.delete(claim)
                store.remove(claim.uid)
                log.info("DRA: claim %s/%s was being prepared: its host-local addresses released, not prepared",
                         claim.namespace, claim.name)  # fmt: skip
            except (VmSandboxError, OSError) as exc:
                log.warning("DRA: claim %s: %s", claim.uid, exc)
        prepared: Mapping[str, PreparedClaim] = {c.uid: c for c in store.all()}
        for allocation in dra_ipam.stale_allocations(self.allocations(), prepared):
            index = int(allocation.container_id.rsplit("-", 1)[1])
            device = IpamDevice(index, allocation.network, allocation.container_id, allocation.ifname or f"dra{index}")
            try:
                self._delete(allocation.network, device)
                log.info("DRA: host-local's %s on %s (%s) held by no prepared claim: released", allocation.address,
                         allocation.network, allocation.container_id)  # fmt: skip
            except VmSandboxError as exc:
                log.warning("DRA: host-local's %s on %s not released: %s", allocation.address, allocation.network, exc)


def _read_small(path: Path) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, dra_ipam.MAX_ALLOCATION_FILE + 1)
    finally:
        os.close(fd)
