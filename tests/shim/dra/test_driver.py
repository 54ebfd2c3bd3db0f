"""shim.dra.driver: the driver started as the shim starts it (store, client, slices, plugin) against a
local HTTPS API server, and stopped cleanly (the slice deleted, the sockets gone, the store kept)."""

from __future__ import annotations

import stat
from pathlib import Path

from shim.dra.driver import DraDriver, claims_dir
from shim.dra.plugin import plugin_socket, registration_socket
from tests.shim.dra.test_kube import Api, kubeconfig, pki, server
from vmsandbox.dra import DraConfig, NetworkAttachment, NetworkConfig, PreparedClaim, PreparedDevice

__all__ = ["pki", "server"]  # the fixtures this module uses

CLAIM = PreparedClaim("u1", "ns", "c", ("pod-1",), (PreparedDevice("net", "n1-networks", "lan", NetworkConfig()),))


def test_start_and_clean_stop(tmp_path: Path, pki: Path, server: int) -> None:
    config = DraConfig(
        kubeconfig=kubeconfig(tmp_path, pki, server),
        plugins_registry_dir=str(tmp_path / "registry"),
        plugins_dir=str(tmp_path / "plugins"),
        node_name="n1",
        networks=(NetworkAttachment("lan", "bridge", "br-lan", "192.168.50.0/24"),),
    )
    state = tmp_path / "state"
    state.mkdir()
    driver = DraDriver.start(config, str(state))
    try:
        assert registration_socket(config).is_socket() and plugin_socket(config).is_socket()
        posted = [body for method, _, body, _ in Api.seen if method == "POST"]
        assert [b["spec"]["nodeName"] for b in posted] == ["n1"]
        driver.store.put(CLAIM)
    finally:
        driver.stop()
    assert not registration_socket(config).exists() and not plugin_socket(config).exists()
    assert ("DELETE", "/apis/resource.k8s.io/v1/resourceslices/n1-vmsandbox.dev-networks") in [
        (m, p) for m, p, _, _ in Api.seen
    ]
    assert stat.S_IMODE((state / "dra").stat().st_mode) == 0o700
    again = DraDriver.start(config, str(state))  # the prepared claim is still there after a restart
    try:
        assert again.store.all() == [CLAIM]
        assert claims_dir(str(state)).is_dir()
    finally:
        again.stop()
