"""The node's ResourceSlices, one owner: the network pool's slice is created (or brought back to what
the configuration says) at start and checked again every ``interval_s`` (so a slice someone deleted
or changed is put back, and its pool generation goes up when its devices change; after a failed
sync, every ``retry_s``), and deleted at a clean stop. Slices of this driver on this node that are
not ours now (a pool no longer configured) are deleted."""

from __future__ import annotations

import logging
import threading
from typing import Any

from shim.dra.kube import Conflict, KubeClient
from vmsandbox.dra import DraConfig, network_slice, slice_differs, slice_name
from vmsandbox.errors import NotFound, VmSandboxError

log = logging.getLogger(__name__)


class Slices:
    def __init__(
        self, config: DraConfig, node: str, client: KubeClient, interval_s: float = 30.0, retry_s: float = 5.0
    ) -> None:
        self._config, self._node, self._client = config, node, client
        self._interval, self._retry = interval_s, min(retry_s, interval_s)
        self._failed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.name = slice_name(config.driver_name, node)

    def sync(self) -> None:
        """Make the API server's slices of this node what we publish."""
        current = {}
        for item in self._client.list_slices(self._config.driver_name, self._node):
            name = item.get("metadata", {}).get("name") if isinstance(item, dict) else None
            if isinstance(name, str):
                current[name] = item
        for name in sorted(set(current) - {self.name}):
            log.info("DRA: deleting ResourceSlice %s (not published by this node now)", name)
            self._client.delete_slice(name)
        have: Any = current.get(self.name)
        if have is None:
            self._client.create_slice(network_slice(self._config.driver_name, self._node, self._config.networks, 1))
            log.info("DRA: published ResourceSlice %s (%d networks)", self.name, len(self._config.networks))
            return
        generation = int(have.get("spec", {}).get("pool", {}).get("generation", 0) or 0)
        wanted = network_slice(self._config.driver_name, self._node, self._config.networks, generation)
        if not slice_differs(have, wanted):
            return
        wanted = network_slice(self._config.driver_name, self._node, self._config.networks, generation + 1)
        wanted["metadata"]["resourceVersion"] = have.get("metadata", {}).get("resourceVersion", "")
        try:
            self._client.update_slice(self.name, wanted)
            log.info("DRA: updated ResourceSlice %s (pool generation %d)", self.name, generation + 1)
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
        try:
            self._client.delete_slice(self.name)
        except VmSandboxError as exc:
            log.warning("DRA: could not delete ResourceSlice %s: %s", self.name, exc)
