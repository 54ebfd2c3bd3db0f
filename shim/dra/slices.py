"""The node's ResourceSlices, one owner: the network pool's slice, and the PCI pool's when
``dra.pci_pools`` names device pools (``vmsandbox.dra_pci.pci_slice``), are created (or brought back
to what the configuration and the host say) at start and checked again every ``interval_s`` (so a slice someone deleted
or changed is put back, and its pool generation goes up when its devices change; after a failed
sync, every ``retry_s``), and deleted at a clean stop. Slices of this driver on this node that are
not ours now (a pool no longer configured) are deleted."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from shim.dra.kube import Conflict, KubeClient
from vmsandbox.devices import DeviceGroup
from vmsandbox.dra import DraConfig, network_slice, slice_differs, slice_name
from vmsandbox.dra_pci import pci_slice, pci_slice_name
from vmsandbox.errors import NotFound, VmSandboxError

log = logging.getLogger(__name__)


class Slices:
    def __init__(
        self,
        config: DraConfig,
        node: str,
        client: KubeClient,
        interval_s: float = 30.0,
        retry_s: float = 5.0,
        pci: Callable[[], Sequence[DeviceGroup]] | None = None,
    ) -> None:
        self._config, self._node, self._client = config, node, client
        self._pci = pci  # the IOMMU groups published now (read again at each sync); None: no PCI pool
        self._interval, self._retry = interval_s, min(retry_s, interval_s)
        self._failed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.name = slice_name(config.driver_name, node)
        self.pci_name = pci_slice_name(config.driver_name, node) if pci is not None else ""

    def _wanted(self) -> dict[str, tuple[Callable[[int], dict[str, Any]], str]]:
        """Each slice we publish: how to make it at a generation, and what it holds (for the log)."""
        driver, node = self._config.driver_name, self._node
        networks = self._config.networks
        out: dict[str, tuple[Callable[[int], dict[str, Any]], str]] = {
            self.name: (lambda g: network_slice(driver, node, networks, g), f"{len(networks)} networks")
        }
        if self._pci is not None:
            groups = tuple(self._pci())
            out[self.pci_name] = (lambda g: pci_slice(driver, node, groups, g), f"{len(groups)} PCI devices")
        return out

    def sync(self) -> None:
        """Make the API server's slices of this node what we publish."""
        current = {}
        for item in self._client.list_slices(self._config.driver_name, self._node):
            name = item.get("metadata", {}).get("name") if isinstance(item, dict) else None
            if isinstance(name, str):
                current[name] = item
        wanted = self._wanted()
        for name in sorted(set(current) - set(wanted)):
            log.info("DRA: deleting ResourceSlice %s (not published by this node now)", name)
            self._client.delete_slice(name)
        for name, (make, what) in wanted.items():
            self._sync_one(name, current.get(name), make, what)

    def _sync_one(self, name: str, have: Any, make: Callable[[int], dict[str, Any]], what: str) -> None:
        if have is None:
            self._client.create_slice(make(1))
            log.info("DRA: published ResourceSlice %s (%s)", name, what)
            return
        generation = int(have.get("spec", {}).get("pool", {}).get("generation", 0) or 0)
        if not slice_differs(have, make(generation)):
            return
        wanted = make(generation + 1)
        wanted["metadata"]["resourceVersion"] = have.get("metadata", {}).get("resourceVersion", "")
        try:
            self._client.update_slice(name, wanted)
            log.info("DRA: updated ResourceSlice %s (pool generation %d)", name, generation + 1)
        except (Conflict, NotFound):
            pass  # changed under us: the next sync looks again

    def start(self) -> None:
        try:
            self.sync()
        except VmSandboxError as exc:  # the API server may come up after us: the loop tries again
            log.warning("DRA: ResourceSlice sync: %s", exc)
            self._failed = True
        self._thread = threading.Thread(target=self._run, name="dra-slices", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        wait = self._retry if self._failed else self._interval
        while not self._stop.wait(wait):
            try:
                self.sync()
                wait = self._interval
            except VmSandboxError as exc:
                log.warning("DRA: ResourceSlice sync: %s", exc)
                wait = self._retry

    def stop(self) -> None:
        """A clean stop: the node's devices are not offered while the driver is away."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._interval + 15)
        for name in (self.name, self.pci_name):
            if not name:
                continue
            try:
                self._client.delete_slice(name)
            except VmSandboxError as exc:
                log.warning("DRA: could not delete ResourceSlice %s: %s", name, exc)
