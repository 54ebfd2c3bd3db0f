"""The DRA driver as the shim runs it: the claim store, the API server client, the kubelet plugin and
the ResourceSlices, started together after the shim's own state is back and stopped at a clean
stop (the slices deleted, the sockets removed; the prepared claims stay for the next start)."""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from pathlib import Path

from shim.dra.kube import KubeClient
from shim.dra.plugin import DraPlugin
from shim.dra.slices import Slices
from shim.dra.store import ClaimStore
from vmsandbox import validation
from vmsandbox.dra import DraConfig

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

    @classmethod
    def start(cls, config: DraConfig, state_dir: str, slice_interval_s: float = 30.0) -> DraDriver:
        node = node_name(config)
        (Path(state_dir) / "dra").mkdir(mode=0o700, exist_ok=True)
        store = ClaimStore(claims_dir(state_dir))
        client = KubeClient(config.kubeconfig)
        plugin = DraPlugin(config, node, store, client)
        slices = Slices(config, node, client, slice_interval_s)
        slices.start()
        plugin.start()
        log.info("DRA: driver %s on node %s, %d prepared claims kept", config.driver_name, node, len(store.all()))
        return cls(store, plugin, slices)

    def stop(self) -> None:
        self.plugin.stop()
        self.slices.stop()
