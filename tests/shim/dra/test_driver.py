"""shim.dra.driver: the driver started as the shim starts it (store, client, slices, plugin) against a
local HTTPS API server, and stopped cleanly (the slice deleted, the sockets gone, the store kept)."""

from __future__ import annotations

import stat
from dataclasses import replace
from pathlib import Path

from shim.dra.driver import DraDriver, claims_dir, ipam_dir
from shim.dra.plugin import plugin_socket, registration_socket
from shim.dra.store import ClaimStore
from tests.shim.dra.test_kube import Api, kubeconfig, pki, server
from vmsandbox.agent_protocol import NicReport
from vmsandbox.dra import (
    IPAM_ADDING,
    DraConfig,
    NetworkAttachment,
    NetworkConfig,
    PreparedClaim,
    PreparedDevice,
    claimed_mac,
)
from vmsandbox.errors import InfrastructureError

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


def test_status_written_at_failure_and_again_after_a_start(tmp_path: Path, pki: Path, server: int) -> None:
    """A failed RunPodSandbox's claims: each device Ready False with the reason; after a start, the
    READY pods' claims get the status their guest reports now (those without claims, or whose guest
    does not answer, are passed by)."""
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
    claim = PreparedClaim(
        "u1",
        "ns",
        "c",
        ("pod-1",),
        (PreparedDevice("net", "n1-networks", "lan", NetworkConfig("net1", ("192.168.50.7/24",))),),
    )
    try:
        driver.store.put(claim)
        driver.write_failure([claim], "AttachFailed", "RunPodSandbox failed: no")
        method, path, body, _ = Api.seen[-1]
        assert (method, path.split("?")[0]) == (
            "PATCH",
            "/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/c/status",
        )
        (cond,) = body["status"]["devices"][0]["conditions"]
        assert (cond["status"], cond["reason"], cond["message"]) == (
            "False",
            "AttachFailed",
            "RunPodSandbox failed: no",
        )

        mac = claimed_mac("sb-1", "u1", 0)

        def report(sandbox_id: str) -> list[NicReport]:
            if sandbox_id == "sb-3":
                raise InfrastructureError("the agent does not answer")
            return [NicReport("net1", mac, ("192.168.50.7/24",), True)]

        seen = len(Api.seen)
        pods = [("sb-1", "ns/p1", "pod-1"), ("sb-2", "ns/p2", "pod-2"), ("sb-3", "ns/p1", "pod-1")]
        assert driver.resync_status(pods, report) == 1
        ((method, _, body, _),) = Api.seen[seen:]
        (device,) = body["status"]["devices"]
        assert device["networkData"] == {"interfaceName": "net1", "ips": ["192.168.50.7/24"], "hardwareAddress": mac}
    finally:
        driver.stop()


def test_start_releases_what_a_cut_short_prepare_added(tmp_path: Path, pki: Path, server: int) -> None:
    config = DraConfig(
        kubeconfig=kubeconfig(tmp_path, pki, server),
        plugins_registry_dir=str(tmp_path / "registry"),
        plugins_dir=str(tmp_path / "plugins"),
        node_name="n1",
        networks=(NetworkAttachment("lan", "bridge", "br-lan", "192.168.50.0/24"),),
    )
    state = tmp_path / "state"
    (state / "dra").mkdir(parents=True)
    ClaimStore(claims_dir(str(state))).put(replace(CLAIM, ipam=IPAM_ADDING))
    driver = DraDriver.start(config, str(state), cni_bin_dirs=[str(tmp_path / "no-plugins")])
    try:
        # host-local is not there: the DEL fails, the record stays for the next start
        assert [c.uid for c in driver.store.all()] == ["u1"]
    finally:
        driver.stop()
    assert ipam_dir(config, str(state)) == state / "dra" / "ipam" and (state / "dra" / "ipam").is_dir()
    if Path("/usr/lib/cni/host-local").is_file():
        driver = DraDriver.start(config, str(state), cni_bin_dirs=["/usr/lib/cni"])
        try:
            assert driver.store.all() == []
        finally:
            driver.stop()
