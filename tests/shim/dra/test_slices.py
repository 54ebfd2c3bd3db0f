"""shim.dra.slices against a fake API server: created, kept current, strays deleted, gone at stop."""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import pytest

from shim.dra.kube import Conflict
from shim.dra.slices import Slices
from vmsandbox.adapters.sysfs import read_inventory
from vmsandbox.devices import resolve_pools
from vmsandbox.dra import DraConfig, NetworkAttachment, network_slice, pci_device_name
from vmsandbox.dra_pci import published_groups
from vmsandbox.errors import InfrastructureError, NotFound

DRIVER, NODE = "vmsandbox.dev", "node-a"
LAN = NetworkAttachment("lan", "bridge", "br-lan", "192.168.50.0/24")
WAN = NetworkAttachment("wan", "macvlan", "eth1", "10.9.0.0/16")


class FakeApi:
    def __init__(self) -> None:
        self.slices: dict[str, Any] = {}
        self.log: list[str] = []
        self.conflict = False

    def list_slices(self, driver: str, node: str) -> list[Any]:
        return [
            copy.deepcopy(s)
            for s in self.slices.values()
            if s["spec"]["driver"] == driver and s["spec"]["nodeName"] == node
        ]

    def create_slice(self, body: Any) -> Any:
        self.log.append(f"create {body['metadata']['name']}")
        stored = copy.deepcopy(body)
        stored["metadata"]["resourceVersion"] = "1"
        self.slices[body["metadata"]["name"]] = stored
        return body

    def update_slice(self, name: str, body: Any) -> Any:
        if self.conflict:
            raise Conflict(409, "changed")
        assert body["metadata"]["resourceVersion"] == self.slices[name]["metadata"]["resourceVersion"]
        self.log.append(f"update {name} {body['spec']['pool']['generation']}")
        self.slices[name] = copy.deepcopy(body)
        return body

    def delete_slice(self, name: str) -> None:
        self.log.append(f"delete {name}")
        if self.slices.pop(name, None) is None:
            raise NotFound(name)


def slices(api: FakeApi, *networks: NetworkAttachment) -> Slices:
    return Slices(DraConfig(networks=networks), NODE, api, interval_s=3600)  # type: ignore[arg-type]


def test_created_then_left_alone() -> None:
    api = FakeApi()
    owner = slices(api, LAN)
    owner.sync()
    owner.sync()
    assert api.log == ["create node-a-vmsandbox.dev-networks"]
    assert api.slices[owner.name]["spec"]["devices"][0]["name"] == "lan"


def test_devices_changed_raise_the_generation() -> None:
    api = FakeApi()
    slices(api, LAN).sync()
    slices(api, LAN, WAN).sync()
    assert api.log[-1] == "update node-a-vmsandbox.dev-networks 2"
    assert [d["name"] for d in api.slices["node-a-vmsandbox.dev-networks"]["spec"]["devices"]] == ["lan", "wan"]


def test_conflict_waits_for_the_next_sync() -> None:
    api = FakeApi()
    slices(api, LAN).sync()
    api.conflict = True
    slices(api, WAN).sync()
    assert api.log == ["create node-a-vmsandbox.dev-networks"]


def test_strays_of_this_node_deleted_others_kept() -> None:
    api = FakeApi()
    stray = network_slice(DRIVER, NODE, (LAN,), 1)
    stray["metadata"]["name"] = "node-a-old-pool"
    other = network_slice(DRIVER, "node-b", (LAN,), 1)
    api.slices = {"node-a-old-pool": stray, other["metadata"]["name"]: other}
    slices(api, LAN).sync()
    assert sorted(api.slices) == ["node-a-vmsandbox.dev-networks", "node-b-vmsandbox.dev-networks"]


def test_stop_deletes_and_tolerates_gone() -> None:
    api = FakeApi()
    owner = slices(api, LAN)
    owner.start()
    owner.stop()
    assert api.slices == {}
    owner.stop()  # already gone: nothing raised


def test_a_failed_sync_is_retried_soon() -> None:
    class Refusing(FakeApi):
        def __init__(self) -> None:
            super().__init__()
            self.refusals = 2

        def list_slices(self, driver: str, node: str) -> list[Any]:
            if self.refusals:
                self.refusals -= 1
                raise InfrastructureError("403 forbidden")
            return super().list_slices(driver, node)

    api = Refusing()
    owner = Slices(DraConfig(networks=(LAN,)), NODE, api, interval_s=3600, retry_s=0.05)  # type: ignore[arg-type]
    owner.start()
    deadline = time.monotonic() + 10
    while not api.slices and time.monotonic() < deadline:
        time.sleep(0.02)
    owner.stop()
    assert api.log == ["create node-a-vmsandbox.dev-networks", "delete node-a-vmsandbox.dev-networks"]


# -- the PCI pool's slice beside the networks' ------------------------------------------------------
FIXTURE = Path(__file__).parents[2] / "fixtures" / "sysfs" / "vfio-two-node"
POOLS = resolve_pools({"gpu": ("10de:2330", "10de:22a3")}, read_inventory(FIXTURE / "sys", FIXTURE / "proc"))
GROUPS = list(published_groups(POOLS, ("gpu",)).values())  # IOMMU groups 12, 40 and 41
PCI = "node-a-vmsandbox.dev-pci"


@pytest.mark.parametrize(
    ("before", "after", "log"),
    [
        (GROUPS, GROUPS, [f"create {PCI}"]),
        (GROUPS[:1], GROUPS, [f"create {PCI}", f"update {PCI} 2"]),  # a group came back: generation 2
        (GROUPS, GROUPS[1:], [f"create {PCI}", f"update {PCI} 2"]),
        (GROUPS, [], [f"create {PCI}", f"update {PCI} 2"]),  # an empty pool is still published
    ],
)
def test_pci_slice_published_and_kept_current(before: list[Any], after: list[Any], log: list[str]) -> None:
    api = FakeApi()
    groups = list(before)
    owner = Slices(DraConfig(networks=(LAN,)), NODE, api, interval_s=3600, pci=lambda: groups)  # type: ignore[arg-type]
    owner.sync()
    groups[:] = after
    owner.sync()
    assert [e for e in api.log if "pci" in e] == log
    assert api.log[0] == "create node-a-vmsandbox.dev-networks"
    spec = api.slices[PCI]["spec"]
    assert spec["pool"]["name"] == "node-a-pci"
    assert [d["name"] for d in spec["devices"]] == [pci_device_name(g.primary.address) for g in after]
    assert api.slices["node-a-vmsandbox.dev-networks"]["spec"]["pool"]["generation"] == 1


def test_pci_slice_deleted_when_no_longer_configured_and_at_stop() -> None:
    api = FakeApi()
    Slices(DraConfig(), NODE, api, interval_s=3600, pci=lambda: GROUPS).sync()  # type: ignore[arg-type]
    assert sorted(api.slices) == ["node-a-vmsandbox.dev-networks", PCI]
    slices(api).sync()  # dra.pci_pools emptied: the PCI slice is a stray now
    assert sorted(api.slices) == ["node-a-vmsandbox.dev-networks"]
    owner = Slices(DraConfig(), NODE, api, interval_s=3600, pci=lambda: GROUPS)  # type: ignore[arg-type]
    owner.start()
    owner.stop()
    assert api.slices == {}
