"""A DRA passthrough claim from the published slice to the domain's ``<hostdev>``, in process: the
shim's owners over a real ledger, libvirt's test driver (``test:///default``) and the fixture sysfs
tree of a passthrough host (``tests/fixtures/sysfs/vfio-two-node``), a fake guest agent.

The slice the driver publishes is read back from a fake API server and its device names fed into
the claims' allocations; NodePrepareResources prepares them; RunPodSandbox puts their IOMMU groups
in the domain, NUMA-aligned, held in the ledger; StopPodSandbox frees them; a second pod claiming
the same device, a device no longer published and a group a pod's device pool gave away first are
refused with nothing held."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import grpc
import pytest

from gen.kubelet.dra.v1 import api_pb2 as dra_pb
from shim import faults
from shim.config import ShimConfig, config_from_mapping
from shim.dra.driver import DraDriver
from shim.dra.kube import KubeClient
from shim.dra.pci import PciDevices
from shim.dra.plugin import DraPlugin, DraService
from shim.dra.slices import Slices
from shim.dra.store import ClaimStore
from shim.model import PodMeta, RunPodSandbox, SandboxSpec, StopPodSandbox
from shim.pods import Pods
from shim.rpc.run_pod_sandbox import run_pod_sandbox
from shim.rpc.stop_pod_sandbox import stop_pod_sandbox
from shim.sandboxes import Sandboxes
from tests import fake_guest as fg
from tests.cri_server import pods_for
from vmsandbox.adapters.hypervisor import Hypervisor
from vmsandbox.adapters.ledger import Ledger
from vmsandbox.adapters.sysfs import read_inventory
from vmsandbox.agent_protocol import NicReport
from vmsandbox.domain_xml import read_hostdevs
from vmsandbox.dra import DraConfig, NetworkAttachment, NetworkConfig, PreparedClaim, PreparedDevice, claimed_nics
from vmsandbox.dra_pci import network_claims
from vmsandbox.errors import CannotFit, InvalidArgument, NotFound, WrongState
from vmsandbox.profile import Profile
from vmsandbox.resources import ContainerDeclaration, ContainerResources, PodDeclaration, ResourceList

FIXTURE = Path(__file__).parents[2] / "fixtures" / "sysfs" / "vfio-two-node"
VFIO = read_inventory(FIXTURE / "sys", FIXTURE / "proc")
DRIVER = "vmsandbox.dev"
NODE = "node-a"
POOLS = {"gpu": ("10de:2330", "10de:22a3"), "nic": ("0000:86:00.0",)}
LAN = NetworkAttachment("lan", "bridge", "br-lan", "10.0.0.0/24")


class FakeApi:
    """The API server as the driver uses it: ResourceSlices and ResourceClaims."""

    def __init__(self) -> None:
        self.slices: dict[str, Any] = {}
        self.claims: dict[tuple[str, str], Any] = {}
        self.status: list[Any] = []

    def list_slices(self, driver: str, node: str) -> list[Any]:
        return [copy.deepcopy(s) for s in self.slices.values()]

    def create_slice(self, body: Any) -> Any:
        self.slices[body["metadata"]["name"]] = copy.deepcopy(body)
        return body

    def update_slice(self, name: str, body: Any) -> Any:
        self.slices[name] = copy.deepcopy(body)
        return body

    def delete_slice(self, name: str) -> None:
        self.slices.pop(name, None)

    def apply_claim_status(self, namespace: str, name: str, body: Any, manager: str) -> None:
        self.status.append((namespace, name, body, manager))

    def get_claim(self, namespace: str, name: str) -> Any:
        if (namespace, name) not in self.claims:
            raise NotFound(f"resourceclaims/{name}: not found")
        return copy.deepcopy(self.claims[(namespace, name)])


@dataclass
class Node:
    sb: Sandboxes
    pods: Pods
    api: FakeApi
    store: ClaimStore
    service: DraService
    hypervisor: Hypervisor


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    pytest.importorskip("libvirt")
    images = tmp_path / "image"
    images.mkdir()
    for name in ("vmlinux", "initramfs.img"):
        (images / name).write_text("")
    dra = DraConfig(
        kubeconfig="/unused",
        plugins_registry_dir=str(tmp_path / "registry"),
        plugins_dir=str(tmp_path / "plugins"),
        node_name=NODE,
        pci_pools=("gpu",),
    )
    config = ShimConfig(
        state_dir=str(tmp_path / "state"),
        console_dir=str(tmp_path / "console"),
        libvirt_uri="test:///default",
        shared_cpus=(3, 7),
        device_pools=dict(POOLS),
        packing="best-fit",
        pod_network="none",
        dra=dra,
    )
    (tmp_path / "state").mkdir()
    profile = Profile(
        name="gpu",
        handler="vmsandbox",
        image_dir=str(images),
        boot_timeout_s=20,
        snapshots=False,
        memory_overhead_bytes=16 << 20,
        memory_min_bytes=32 << 20,
        default_memory_bytes=16 << 20,
        extended_resources={"nvidia.com/gpu": "gpu"},
    )
    ledger = Ledger(tmp_path / "state" / "state.db")
    hypervisor = Hypervisor("test:///default", attempts=1)
    sb = Sandboxes(config, ledger, hypervisor, {"vmsandbox": profile}, inventory=lambda: VFIO)
    guest = fg.FakeGuest(tmp_path / "agent.sock", lambda _n, peer: peer.serve(fg.agent()))
    hypervisor.channel_path = lambda _domain, _channel: str(guest.path)  # type: ignore[method-assign, assignment]
    api = FakeApi()
    pci = PciDevices(dra.pci_pools, lambda: sb.resources.pools.devices, sb.resources.pci_holder)
    Slices(dra, NODE, api, interval_s=3600, pci=pci.groups).sync()  # type: ignore[arg-type]
    store = ClaimStore(tmp_path / "claims")
    service = DraService(dra, NODE, store, api, pci)
    pods = pods_for(sb)
    pods.prepared_claims = store.for_pod
    driver = DraDriver(store, cast(DraPlugin, None), cast(Slices, None), cast(KubeClient, api), DRIVER)
    pods.claim_status = driver.write_status
    try:
        yield Node(sb, pods, api, store, service, hypervisor)
    finally:
        for s in list(sb.records.list_sandboxes()):
            stop_pod_sandbox(pods, StopPodSandbox(s.id))
        sb.dirs.sweep(set())
        guest.close()
        hypervisor.close()
        ledger.close()


def published(api: FakeApi) -> dict[str, Any]:
    """The PCI slice's devices by name, as the scheduler sees them."""
    slice_ = api.slices[f"{NODE}-{DRIVER}-pci"]
    assert slice_["spec"]["pool"]["name"] == f"{NODE}-pci"
    return {d["name"]: d for d in slice_["spec"]["devices"]}


def allocate(api: FakeApi, name: str, uid: str, pod_uid: str, *devices: str, pool: str = f"{NODE}-pci") -> None:
    """A claim as the scheduler leaves it: each device of ``devices`` allocated from ``pool``."""
    api.claims[("ml", name)] = {
        "metadata": {"namespace": "ml", "name": name, "uid": uid},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": f"gpu{i}", "driver": DRIVER, "pool": pool, "device": d}
                        for i, d in enumerate(devices)
                    ]
                }
            },
            "reservedFor": [{"resource": "pods", "name": f"pod-{pod_uid}", "uid": pod_uid}],
        },
    }


def prepare(node: Node, name: str, uid: str) -> str:
    request = dra_pb.NodePrepareResourcesRequest(claims=[dra_pb.Claim(namespace="ml", name=name, uid=uid)])
    reply = node.service.NodePrepareResources(request, cast(grpc.ServicerContext, None))
    return reply.claims[uid].error


def pod(uid: str, limits: dict[str, str] | None = None) -> RunPodSandbox:
    resources = ContainerResources(limits=ResourceList.parse(limits or {"cpu": "1", "memory": "64Mi"}, where="app"))
    decl = PodDeclaration(containers=(ContainerDeclaration("app", resources),))
    return RunPodSandbox(SandboxSpec(meta=PodMeta(f"pod-{uid}", "ml", uid), declaration=decl))


def held_pci(sb: Sandboxes) -> set[str]:
    return {a for c in sb.ledger.held().values() for a in c.pci}


def test_published_slice_to_hostdev_and_back(node: Node) -> None:
    devices = published(node.api)
    assert sorted(devices) == ["pci-0000-3b-00-0", "pci-0000-af-00-0", "pci-0000-d8-00-0"]
    gpu = devices["pci-0000-af-00-0"]  # IOMMU group 40 on node 1, GPU and its audio function
    assert gpu["attributes"]["resource.kubernetes.io/numaNode"] == {"int": 1}
    allocate(node.api, "gpu", "c-1", "p-1", gpu["name"])
    assert prepare(node, "gpu", "c-1") == ""
    sid = run_pod_sandbox(node.pods, pod("p-1"))
    record = node.sb.records.get(sid)
    xml = node.hypervisor.live_xml(record.domain)
    assert read_hostdevs(xml) == ("0000:af:00.0", "0000:af:00.1")
    assert "<hostdev mode='subsystem' type='pci' managed='yes'>" in xml
    # NUMA-aligned: the vCPU on node 1 (exclusive CPUs 2 and 6 there), as the GPU
    held = node.sb.ledger.held()[sid]
    assert set(held.cpus) <= {2, 6} and set(held.pci) == {"0000:af:00.0", "0000:af:00.1"}
    [(namespace, name, body, manager)] = node.api.status  # once READY
    assert (namespace, name, manager, body["metadata"]["uid"]) == ("ml", "gpu", DRIVER, "c-1")
    [entry] = body["status"]["devices"]
    assert (entry["pool"], entry["device"], entry["data"]) == (
        "node-a-pci",
        gpu["name"],
        {"pciAddress": "0000:af:00.0"},
    )
    assert [(c["type"], c["status"], c["reason"]) for c in entry["conditions"]] == [("Ready", "True", "Attached")]

    # a second pod whose claim names the same device: refused at prepare while the first has it
    allocate(node.api, "gpu2", "c-2", "p-2", gpu["name"])
    assert prepare(node, "gpu2", "c-2") == (
        "resourceclaim ml/gpu2: PCI device pci-0000-af-00-0 is prepared for claim ml/gpu already"
    )
    assert node.store.get("c-2") is None

    stop_pod_sandbox(node.pods, StopPodSandbox(sid))
    assert held_pci(node.sb) == set()
    assert node.sb.resources.pci_holder(("0000:af:00.0",)) is None


def test_second_pod_with_the_same_device_is_refused_at_run(node: Node) -> None:
    """Prepared for two claims (the first prepared before, the second's check bypassed as a
    restarted node's store might hold it): the second RunPodSandbox is refused by the ledger."""
    allocate(node.api, "a", "c-a", "p-a", "pci-0000-3b-00-0")
    assert prepare(node, "a", "c-a") == ""
    first = run_pod_sandbox(node.pods, pod("p-a"))
    prepared = node.store.get("c-a")
    assert prepared is not None
    node.store.put(replace(prepared, uid="c-b", name="b", pod_uids=("p-b",)))
    with pytest.raises(CannotFit, match=r"IOMMU group 12 .* is held by another sandbox"):
        run_pod_sandbox(node.pods, pod("p-b"))
    assert set(node.sb.ledger.held()) == {first}
    assert len(node.sb.records.list_sandboxes()) == 1


def test_a_device_the_node_no_longer_publishes_rolls_back(node: Node) -> None:
    allocate(node.api, "gone", "c-g", "p-g", "pci-0000-3b-00-0")
    assert prepare(node, "gone", "c-g") == ""
    prepared = node.store.get("c-g")
    assert prepared is not None
    stale = replace(prepared, devices=(replace(prepared.devices[0], device="pci-0000-86-00-0"),))
    node.store.put(stale)  # group 30 is half given away to the host: never published
    with pytest.raises(WrongState, match=r"claim ml/gone device pci-0000-86-00-0 .* does not publish"):
        run_pod_sandbox(node.pods, pod("p-g"))
    assert node.sb.ledger.held() == {} and node.sb.records.list_sandboxes() == []
    assert node.hypervisor.list_ours() == []


def test_a_group_a_device_pool_gave_away_first_is_refused_then_free(node: Node) -> None:
    """One ledger: a pod that took group 12 through its extended resource holds it; a claim of it
    is refused at prepare, and at RunPodSandbox (one prepared before that pod ran), until that pod
    stops."""
    by_pool = run_pod_sandbox(node.pods, pod("p-x", {"cpu": "1", "memory": "64Mi", "nvidia.com/gpu": "1"}))
    assert set(node.sb.ledger.held()[by_pool].pci) == {"0000:3b:00.0", "0000:3b:00.1"}  # best-fit: node 0's
    allocate(node.api, "later", "c-m", "p-m", "pci-0000-3b-00-0")
    assert prepare(node, "later", "c-m") == (
        "resourceclaim ml/later: PCI device pci-0000-3b-00-0 (IOMMU group 12 (0000:3b:00.0 10de:2330 + 1 more, "
        f"pool gpu, node 0)) is held by sandbox {by_pool[:12]}"
    )
    assert node.store.all() == []
    allocate(node.api, "late", "c-l", "p-l", "pci-0000-3b-00-0")  # prepared while group 12 is free
    stop_pod_sandbox(node.pods, StopPodSandbox(by_pool))
    assert prepare(node, "late", "c-l") == ""
    by_pool = run_pod_sandbox(node.pods, pod("p-x2", {"cpu": "1", "memory": "64Mi", "nvidia.com/gpu": "1"}))
    with pytest.raises(CannotFit, match=r"IOMMU group 12 .* is held by another sandbox"):
        run_pod_sandbox(node.pods, pod("p-l"))
    assert set(node.sb.ledger.held()) == {by_pool} and node.store.get("c-l") is not None
    stop_pod_sandbox(node.pods, StopPodSandbox(by_pool))
    sid = run_pod_sandbox(node.pods, pod("p-l"))
    assert set(node.sb.ledger.held()[sid].pci) == {"0000:3b:00.0", "0000:3b:00.1"}


def test_a_claim_of_another_pool_or_unknown_device_is_not_prepared(node: Node) -> None:
    allocate(node.api, "x", "c-x", "p-x", "pci-0000-99-00-0")
    assert 'PCI device "pci-0000-99-00-0" is not published by this node' in prepare(node, "x", "c-x")
    allocate(node.api, "y", "c-y", "p-y", "pci-0000-3b-00-0", pool="node-b-pci")
    assert "is not this node's" in prepare(node, "y", "c-y")
    assert node.store.all() == []


@pytest.mark.parametrize("point", ["RunPodSandbox:claim", "RunPodSandbox:define", "RunPodSandbox:guest-start"])
def test_a_failure_after_the_claim_rolls_back_the_device(node: Node, point: str) -> None:
    allocate(node.api, "gpu", "c-1", "p-1", "pci-0000-d8-00-0")
    assert prepare(node, "gpu", "c-1") == ""
    with faults.raising(point), pytest.raises(faults.InjectedFault):
        run_pod_sandbox(node.pods, pod("p-1"))
    assert node.sb.ledger.held() == {} and node.sb.records.list_sandboxes() == []
    assert node.hypervisor.list_ours() == []
    sid = run_pod_sandbox(node.pods, pod("p-1"))  # the group is free again
    assert read_hostdevs(node.hypervisor.live_xml(node.sb.records.get(sid).domain)) == ("0000:d8:00.0",)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"device_pools": {"gpu": ["10de:2330"]}, "dra": {"pci_pools": ["gpu"]}}, None),
        ({"dra": {"pci_pools": ["gpu"]}}, r'c.yaml: dra.pci_pools: "gpu" is not a device pool \(device_pools: none\)'),
        ({"device_pools": {"nic": ["86:00.0"]}, "dra": {"pci_pools": ["nic", "gpu"]}}, r'"gpu" is not a device pool'),
    ],
)
def test_config_names_device_pools_only(data: dict[str, Any], message: str | None) -> None:
    """One ledger: the driver publishes groups of configured device pools, nothing of its own."""
    if message is None:
        assert config_from_mapping(data, "c.yaml").dra.pci_pools == ("gpu",)
    else:
        with pytest.raises(InvalidArgument, match=message):
            config_from_mapping(data, "c.yaml")


def test_status_of_claims_with_both_kinds_of_device() -> None:
    """Each claim's network devices take their NICs in order; a passthrough device takes none."""
    api = FakeApi()
    driver = DraDriver(cast(ClaimStore, None), cast(DraPlugin, None), cast(Slices, None), cast(KubeClient, api), DRIVER)
    lan = PreparedDevice("net", "node-a-networks", "lan", NetworkConfig("net1", ("10.0.0.2/24",)))
    gpu = PreparedDevice("gpu", "node-a-pci", "pci-0000-3b-00-0")
    both = PreparedClaim("u-1", "ml", "both", ("p",), (gpu, lan))
    net = PreparedClaim("u-2", "ml", "net", ("p",), (replace(lan, config=NetworkConfig("net2", ("10.0.0.3/24",))),))
    nics = claimed_nics("ml/p", "s" * 64, network_claims([both, net]), (LAN,))
    reported = (NicReport("net1", nics[0].mac, ("10.0.0.2/24",), True), NicReport("net2", nics[1].mac, (), True))
    driver.write_status([both, net], nics, reported)
    first, second = (body["status"]["devices"] for _, _, body, _ in api.status)
    assert [e.get("data") for e in first] == [{"pciAddress": "0000:3b:00.0"}, None]
    assert first[1]["networkData"]["hardwareAddress"] == nics[0].mac
    assert second[0]["networkData"]["hardwareAddress"] == nics[1].mac
