"""shim.dra.plugin driven as the kubelet drives it: a real gRPC client on the registration socket,
then on the endpoint it names; claims read from a fake API server."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from gen.kubelet.dra.v1 import api_pb2 as dra_pb
from gen.kubelet.dra.v1 import api_pb2_grpc as dra_grpc
from gen.kubelet.pluginregistration.v1 import api_pb2 as reg_pb
from gen.kubelet.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from shim.dra.plugin import DraPlugin, registration_socket
from shim.dra.store import ClaimStore
from vmsandbox.dra import DraConfig, NetworkAttachment
from vmsandbox.errors import InfrastructureError, NotFound

DRIVER, NODE = "vmsandbox.dev", "node-a"
POD = "pod-uid-1"
SHARE = "9d7c0a4e-0000-4000-8000-000000000001"


def claim_json(uid: str, name: str) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "ns", "name": name, "uid": uid},
        "status": {
            "reservedFor": [{"resource": "pods", "name": "p", "uid": POD}],
            "allocation": {
                "devices": {
                    "results": [
                        {
                            "request": "net",
                            "driver": DRIVER,
                            "pool": f"{NODE}-networks",
                            "device": "lan",
                            "shareID": SHARE,
                        }
                    ]
                }
            },
        },
    }


class FakeApi:
    def __init__(self) -> None:
        self.claims: dict[tuple[str, str], Any] = {}
        self.calls = 0
        self.down = False

    def get_claim(self, namespace: str, name: str) -> Any:
        self.calls += 1
        if self.down:
            raise InfrastructureError("API server: connection refused")
        if (namespace, name) not in self.claims:
            raise NotFound(f"resourceclaims/{name}: not found")
        return copy.deepcopy(self.claims[(namespace, name)])


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[tuple[DraConfig, FakeApi, ClaimStore, DraPlugin]]:
    config = DraConfig(
        kubeconfig="/unused",
        plugins_registry_dir=str(tmp_path / "registry"),
        plugins_dir=str(tmp_path / "plugins"),
        networks=(NetworkAttachment("lan", "bridge", "br-lan", "192.168.50.0/24"),),
    )
    api = FakeApi()
    store = ClaimStore(tmp_path / "claims")
    plugin = DraPlugin(config, NODE, store, api)
    plugin.start()
    try:
        yield config, api, store, plugin
    finally:
        plugin.stop(0)


def endpoint(config: DraConfig) -> tuple[grpc.Channel, dra_grpc.DRAPluginStub, reg_pb.PluginInfo]:
    reg = grpc.insecure_channel(f"unix:{registration_socket(config)}")
    info = reg_grpc.RegistrationStub(reg).GetInfo(reg_pb.InfoRequest(), timeout=5)
    reg_grpc.RegistrationStub(reg).NotifyRegistrationStatus(reg_pb.RegistrationStatus(plugin_registered=True))
    reg.close()
    channel = grpc.insecure_channel(f"unix:{info.endpoint}")
    return channel, dra_grpc.DRAPluginStub(channel), info


def test_registration(setup: tuple[DraConfig, FakeApi, ClaimStore, DraPlugin]) -> None:
    config, _, _, plugin = setup
    channel, _, info = endpoint(config)
    channel.close()
    assert (info.type, info.name, list(info.supported_versions)) == ("DRAPlugin", DRIVER, ["v1.DRAPlugin"])
    assert info.endpoint == str(Path(config.plugins_dir) / DRIVER / "dra.sock")
    assert registration_socket(config).name == "vmsandbox.dev-reg.sock"
    assert plugin.registration.registered.is_set()


def test_prepare_and_unprepare(setup: tuple[DraConfig, FakeApi, ClaimStore, DraPlugin]) -> None:
    config, api, store, _ = setup
    api.claims[("ns", "good")] = claim_json("u-good", "good")
    api.claims[("ns", "replaced")] = claim_json("u-new", "replaced")
    channel, stub, _ = endpoint(config)
    claims = [
        dra_pb.Claim(namespace="ns", name="good", uid="u-good"),
        dra_pb.Claim(namespace="ns", name="replaced", uid="u-old"),
        dra_pb.Claim(namespace="ns", name="missing", uid="u-missing"),
        dra_pb.Claim(namespace="ns", name="x", uid="../escape"),
    ]
    reply = stub.NodePrepareResources(dra_pb.NodePrepareResourcesRequest(claims=claims), timeout=5)
    good = reply.claims["u-good"]
    assert good.error == ""
    got = [
        (list(d.request_names), d.pool_name, d.device_name, list(d.cdi_device_ids), d.share_id) for d in good.devices
    ]
    assert got == [(["net"], "node-a-networks", "lan", [], SHARE)]
    assert "the claim was replaced" in reply.claims["u-old"].error
    assert "not found" in reply.claims["u-missing"].error
    assert "is not a uid" in reply.claims["../escape"].error
    assert [c.uid for c in store.all()] == ["u-good"]
    assert store.for_pod(POD)[0].devices[0].device == "lan"

    calls = api.calls
    again = stub.NodePrepareResources(dra_pb.NodePrepareResourcesRequest(claims=claims[:1]), timeout=5)
    assert again.claims["u-good"] == good and api.calls == calls  # answered from the store

    un = dra_pb.NodeUnprepareResourcesRequest(claims=claims[:1] + claims[2:3])
    for _ in range(2):  # idempotent
        reply_un = stub.NodeUnprepareResources(un, timeout=5)
        assert {k: v.error for k, v in reply_un.claims.items()} == {"u-good": "", "u-missing": ""}
    assert store.all() == []
    channel.close()


def test_api_server_down_is_the_claims_error(setup: tuple[DraConfig, FakeApi, ClaimStore, DraPlugin]) -> None:
    config, api, store, _ = setup
    api.down = True
    channel, stub, _ = endpoint(config)
    reply = stub.NodePrepareResources(
        dra_pb.NodePrepareResourcesRequest(claims=[dra_pb.Claim(namespace="ns", name="a", uid="u-a")]), timeout=5
    )
    channel.close()
    assert "connection refused" in reply.claims["u-a"].error
    assert store.all() == []


def test_too_many_claims_refused(setup: tuple[DraConfig, FakeApi, ClaimStore, DraPlugin]) -> None:
    config, _, _, _ = setup
    channel, stub, _ = endpoint(config)
    claims = [dra_pb.Claim(namespace="ns", name=f"c{i}", uid=f"u{i}") for i in range(257)]
    with pytest.raises(grpc.RpcError) as err:
        stub.NodePrepareResources(dra_pb.NodePrepareResourcesRequest(claims=claims), timeout=5)
    channel.close()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_stop_removes_the_sockets(tmp_path: Path) -> None:
    config = DraConfig(plugins_registry_dir=str(tmp_path / "r"), plugins_dir=str(tmp_path / "p"))
    plugin = DraPlugin(config, NODE, ClaimStore(tmp_path / "c"), FakeApi())
    (tmp_path / "r").mkdir()
    registration_socket(config).touch()  # a stale file is not a socket: left, and the bind fails loudly
    with pytest.raises(InfrastructureError):
        plugin.start()
    registration_socket(config).unlink()
    plugin.start()
    assert registration_socket(config).is_socket()
    plugin.stop(0)
    assert list((tmp_path / "r").iterdir()) == [] and list((tmp_path / "p" / DRIVER).iterdir()) == []
