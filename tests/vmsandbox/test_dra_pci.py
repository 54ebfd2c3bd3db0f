"""vmsandbox.dra_pci and the PCI parts of vmsandbox.dra: the passthrough devices the driver publishes
(fixture sysfs tree ``vfio-two-node``), claims of them as prepared and as RunPodSandbox places them
(NUMA-aligned, one ledger with the profile pools), their status, what ``vmsandbox plan`` shows, and
the golden XML of a domain with a claimed device."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from vmsandbox.adapters.sysfs import read_inventory
from vmsandbox.claims import Claim
from vmsandbox.devices import NO_DEVICES, DeviceRequest, resolve_pools
from vmsandbox.domain import SandboxIdentity, build_domain
from vmsandbox.domain_xml import read_hostdevs, render
from vmsandbox.dra import (
    DraConfig,
    NetworkConfig,
    PlannedRequest,
    PreparedClaim,
    PreparedDevice,
    claim_from_record,
    claim_record,
    claim_status,
    is_pci,
    parse_dra_config,
    pci_address_of,
    pci_device_name,
    plan_claims,
    prepared_claim,
)
from vmsandbox.dra_pci import (
    check_pci_pools,
    claimed_groups,
    network_claims,
    pci_slice,
    planned_groups,
    published_groups,
    with_claimed_groups,
)
from vmsandbox.errors import CannotFit, InvalidArgument, WrongState
from vmsandbox.host_pools import FreeState, HugepageBudget, host_pools
from vmsandbox.placement import decide
from vmsandbox.record_docs import shape_doc
from vmsandbox.sizing import PodDemand, VmShape

FIXTURE = Path(__file__).parents[1] / "fixtures" / "sysfs" / "vfio-two-node"
VFIO = read_inventory(FIXTURE / "sys", FIXTURE / "proc")
GOLDEN = Path(__file__).parents[1] / "golden"
DRIVER, NODE, POD = "vmsandbox.dev", "node-a", "pod-uid"
CONFIG = {"gpu": ("10de:2330", "10de:22a3"), "accel": ("8086:0b25",), "nic": ("0000:86:00.0",)}
POOLS = resolve_pools(CONFIG, VFIO)
PUBLISHED = published_groups(POOLS, ("gpu", "accel"))
MI = 1 << 20
P2M = 2 * MI


# -- settings ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("data", "want"),
    [
        ({"pci_pools": ["gpu"]}, ("gpu",)),
        ({"pci_pools": ["gpu", "accel"]}, ("gpu", "accel")),
        ({"pci_pools": None}, ()),
        ({}, ()),
    ],
)
def test_pci_pools_parsed(data: dict[str, Any], want: tuple[str, ...]) -> None:
    assert parse_dra_config(data, "c.yaml") == DraConfig(pci_pools=want)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"pci_pools": "gpu"}, "pci_pools: must be a list of at most 16 device_pools names"),
        ({"pci_pools": [""]}, "pci_pools: must be a list"),
        ({"pci_pools": [1]}, "pci_pools: must be a list"),
        ({"pci_pools": [f"p{i}" for i in range(17)]}, "at most 16"),
        ({"pci_pools": ["gpu", "gpu"]}, "pci_pools: a pool is named twice"),
    ],
)
def test_pci_pools_refused(data: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        parse_dra_config(data, "c.yaml")


@pytest.mark.parametrize(
    ("names", "pools", "message"),
    [
        (("gpu",), CONFIG, None),
        ((), {}, None),
        (("gpu",), {}, r"dra.pci_pools: \"gpu\" is not a device pool \(device_pools: none\)"),
        (("gpu", "fpga"), CONFIG, r"\"fpga\" is not a device pool \(device_pools: accel, gpu, nic\)"),
    ],
)
def test_pci_pools_must_be_device_pools(names: tuple[str, ...], pools: dict[str, Any], message: str | None) -> None:
    if message is None:
        check_pci_pools(names, pools, "c.yaml")
    else:
        with pytest.raises(InvalidArgument, match=message):
            check_pci_pools(names, pools, "c.yaml")


# -- the published devices --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("address", "name"),
    [
        ("0000:3b:00.0", "pci-0000-3b-00-0"),
        ("0000:af:00.1", "pci-0000-af-00-1"),
        ("0001:00:1f.7", "pci-0001-00-1f-7"),
    ],
)
def test_device_names_round_trip(address: str, name: str) -> None:
    assert pci_device_name(address) == name
    assert pci_address_of(name) == address


@pytest.mark.parametrize(
    "name",
    [
        "lan",
        "pci-0000-3b-00",
        "pci-0000-3b-00-0-1",
        "pci-0000-3b-00-0/x",
        "gpu-0000-3b-00-0",
        "pci-0000-zz-00-0",
        "pci-0000-3B-00-0",
        "pci-0000-3b-00-9",
    ],
)
def test_other_names_are_not_pci_devices(name: str) -> None:
    with pytest.raises(InvalidArgument, match="is not a PCI device name"):
        pci_address_of(name)


def test_published_groups_are_whole_usable_groups_of_the_named_pools() -> None:
    assert {n: (g.group, g.pool, g.node, g.addresses) for n, g in PUBLISHED.items()} == {
        "pci-0000-17-00-0": (7, "accel", -1, ("0000:17:00.0",)),
        "pci-0000-3b-00-0": (12, "gpu", 0, ("0000:3b:00.0", "0000:3b:00.1")),
        "pci-0000-af-00-0": (40, "gpu", 1, ("0000:af:00.0", "0000:af:00.1")),
        "pci-0000-d8-00-0": (41, "gpu", 1, ("0000:d8:00.0",)),  # its bridge stays with the host
    }
    # group 30 is half the host's (a function on ice): the profile pools' rules leave it out here too
    assert published_groups(POOLS, ("nic",)) == {}
    assert published_groups(POOLS, ()) == {}


def test_pci_slice() -> None:
    doc = pci_slice(DRIVER, NODE, list(PUBLISHED.values()), 3)
    assert doc["metadata"] == {"name": "node-a-vmsandbox.dev-pci", "labels": {"app.kubernetes.io/managed-by": DRIVER}}
    assert doc["spec"]["pool"] == {"name": "node-a-pci", "generation": 3, "resourceSliceCount": 1}
    assert (doc["spec"]["driver"], doc["spec"]["nodeName"]) == (DRIVER, NODE)
    by_name = {d["name"]: d for d in doc["spec"]["devices"]}
    assert by_name["pci-0000-3b-00-0"] == {
        "name": "pci-0000-3b-00-0",
        "attributes": {
            "vmsandbox.dev/type": {"string": "pci"},
            "vmsandbox.dev/pool": {"string": "gpu"},
            "vmsandbox.dev/vendor": {"string": "10de"},
            "vmsandbox.dev/deviceID": {"string": "2330"},
            "vmsandbox.dev/class": {"string": "030200"},
            "vmsandbox.dev/iommuGroup": {"int": 12},
            "vmsandbox.dev/functions": {"int": 2},
            "resource.kubernetes.io/pciBusID": {"string": "0000:3b:00.0"},
            "resource.kubernetes.io/numaNode": {"int": 0},
        },
    }
    # no NUMA node: the standard attribute is left out; never shared (no allowMultipleAllocations)
    assert "resource.kubernetes.io/numaNode" not in by_name["pci-0000-17-00-0"]["attributes"]
    assert all("allowMultipleAllocations" not in d for d in doc["spec"]["devices"])


# -- prepared claims --------------------------------------------------------------------------------
def allocated(*results: dict[str, Any]) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "ns", "name": "c", "uid": "u1"},
        "status": {
            "reservedFor": [{"resource": "pods", "name": "p", "uid": POD}],
            "allocation": {
                "devices": {
                    "results": list(results),
                    "config": [
                        {"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": {"interfaceName": "x1"}}}
                    ],
                }
            },
        },
    }


def pci_result(device: str = "pci-0000-3b-00-0", **more: Any) -> dict[str, Any]:
    return {"request": "gpu", "driver": DRIVER, "pool": "node-a-pci", "device": device, **more}


def prepare(doc: dict[str, Any]) -> PreparedClaim:
    return prepared_claim(doc, "ns", "c", "u1", DRIVER, NODE, frozenset({"lan"}), frozenset(PUBLISHED))


@pytest.mark.parametrize(
    ("results", "devices"),
    [
        ((pci_result(),), (PreparedDevice("gpu", "node-a-pci", "pci-0000-3b-00-0"),)),
        (
            (pci_result(), {"request": "net", "driver": DRIVER, "pool": "node-a-networks", "device": "lan"}),
            (
                PreparedDevice("gpu", "node-a-pci", "pci-0000-3b-00-0"),  # no network config for a PCI device
                PreparedDevice("net", "node-a-networks", "lan", NetworkConfig("x1")),
            ),
        ),
    ],
)
def test_prepared_pci_claim(results: tuple[dict[str, Any], ...], devices: tuple[PreparedDevice, ...]) -> None:
    got = prepare(allocated(*results))
    assert got == PreparedClaim("u1", "ns", "c", (POD,), devices)
    assert [is_pci(d) for d in got.devices] == [d.pool == "node-a-pci" for d in devices]
    assert claim_from_record(json.loads(json.dumps(claim_record(got)))) == got


@pytest.mark.parametrize(
    ("result", "message"),
    [
        (pci_result("pci-0000-99-00-0"), 'PCI device "pci-0000-99-00-0" is not published by this node'),
        (pci_result("pci-0000-86-00-0"), 'PCI device "pci-0000-86-00-0" is not published'),  # half given away
        (pci_result("lan"), 'PCI device "lan" is not published'),
        (pci_result(shareID="s-1"), "has a shareID; a passthrough device is not shared"),
        (pci_result(pool="node-b-pci"), 'pool "node-b-pci" is not this node\'s'),
    ],
)
def test_prepared_pci_claim_refused(result: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        prepare(allocated(result))


def test_a_node_without_pci_pools_prepares_no_pci_device() -> None:
    with pytest.raises(InvalidArgument, match="is not published by this node"):
        prepared_claim(allocated(pci_result()), "ns", "c", "u1", DRIVER, NODE, frozenset({"lan"}))


# -- at RunPodSandbox -------------------------------------------------------------------------------
def claim_of(name: str, *devices: str, network: bool = False) -> PreparedClaim:
    out = tuple(PreparedDevice(f"r{i}", "node-a-pci", d) for i, d in enumerate(devices))
    if network:
        out += (PreparedDevice("net", "node-a-networks", "lan", NetworkConfig("net1", ("10.0.0.2/24",))),)
    return PreparedClaim(f"u-{name}", "ns", name, (POD,), out)


@pytest.mark.parametrize(
    ("claims", "groups"),
    [
        ((), ()),
        ((claim_of("a", network=True),), ()),
        ((claim_of("a", "pci-0000-af-00-0"),), (40,)),
        ((claim_of("a", "pci-0000-af-00-0", network=True), claim_of("b", "pci-0000-17-00-0")), (40, 7)),
        ((claim_of("a", "pci-0000-d8-00-0", "pci-0000-3b-00-0"),), (41, 12)),
    ],
)
def test_claimed_groups(claims: tuple[PreparedClaim, ...], groups: tuple[int, ...]) -> None:
    got = claimed_groups("ns/p", claims, PUBLISHED)
    assert tuple(g.group for g in got) == groups
    assert with_claimed_groups(DeviceRequest(named=(41,)), got).named == tuple(sorted({41, *groups}))
    nets = network_claims(claims)
    assert [d.device for c in nets for d in c.devices] == ["lan"] * sum(
        1 for c in claims for d in c.devices if not is_pci(d)
    )


def test_with_no_claimed_groups_the_request_is_unchanged() -> None:
    assert with_claimed_groups(NO_DEVICES, ()) is NO_DEVICES
    assert with_claimed_groups(DeviceRequest(counts=(("gpu", 1),)), list(PUBLISHED.values())[:1]) == DeviceRequest(
        named=(7,), counts=(("gpu", 1),)
    )


@pytest.mark.parametrize(
    ("claims", "error", "message"),
    [
        ((claim_of("a", "pci-0000-86-00-0"),), WrongState,
         r"pod ns/p: claim ns/a device pci-0000-86-00-0 \(request r0\): this node does not publish that PCI "
         "device now"),
        ((claim_of("a", "pci-0000-3b-00-0"), claim_of("b", "pci-0000-3b-00-0")), InvalidArgument,
         r"claim ns/b device pci-0000-3b-00-0 \(request r0\): the device is in claim ns/a too"),
    ],
)  # fmt: skip
def test_claimed_groups_refused(claims: tuple[PreparedClaim, ...], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        claimed_groups("ns/p", claims, PUBLISHED)


def placed(claims: tuple[PreparedClaim, ...], held: tuple[Claim, ...] = (), request: DeviceRequest = NO_DEVICES) -> Any:
    pools = host_pools(
        VFIO,
        range(8),
        shared_cpus=(3, 7),
        budgets={(n, P2M): HugepageBudget(n, P2M, 512, 512) for n in (0, 1)},
        devices=POOLS,
    )
    state = FreeState.from_claims(pools, held)
    devices = with_claimed_groups(request, claimed_groups("ns/p", claims, PUBLISHED))
    return decide(SHAPE, pools, state, devices=devices, packing="best-fit")


SHAPE = VmShape(
    vcpus=2,
    memory_bytes=256 * MI,
    backing_page_size=P2M,
    guest_hugepages=(),
    cpu_policy="exclusive",
    demand=PodDemand(2000, 256 * MI),
)


@pytest.mark.parametrize(
    ("device", "cpus", "node", "hostdevs"),
    [
        ("pci-0000-3b-00-0", (0, 4), 0, ("0000:3b:00.0", "0000:3b:00.1")),
        ("pci-0000-af-00-0", (2, 6), 1, ("0000:af:00.0", "0000:af:00.1")),
        ("pci-0000-d8-00-0", (2, 6), 1, ("0000:d8:00.0",)),
        ("pci-0000-17-00-0", (2, 6), 1, ("0000:17:00.0",)),  # no NUMA node: any node (best-fit's choice)
    ],
)
def test_claimed_devices_are_numa_aligned_with_vcpus_and_pages(
    device: str, cpus: tuple[int, ...], node: int, hostdevs: tuple[str, ...]
) -> None:
    p = placed((claim_of("a", device),))
    assert (tuple(sorted(p.cpus)), p.nodes, p.hostdevs) == (cpus, (node,), hostdevs)
    assert {n for n, _, _ in p.hugepages} == {node}


def test_one_ledger_with_the_profile_pools() -> None:
    """A group a sandbox holds (through its device pool or a claim) is not placed again; the pool's
    count requests skip a group a claim takes in the same pod."""
    taken = Claim.of(pci=("0000:3b:00.0", "0000:3b:00.1"))
    with pytest.raises(
        CannotFit, match=r"IOMMU group 12 \(0000:3b:00.0 10de:2330 \+ 1 more, pool gpu, node 0\) is held"
    ):
        placed((claim_of("a", "pci-0000-3b-00-0"),), held=(taken,))
    both = placed((claim_of("a", "pci-0000-d8-00-0"),), request=DeviceRequest(counts=(("gpu", 1),)))
    assert both.hostdevs == ("0000:d8:00.0", "0000:af:00.0", "0000:af:00.1")  # node 1: the claimed group's


# -- status -----------------------------------------------------------------------------------------
def test_status_of_a_passthrough_device() -> None:
    claim = claim_of("a", "pci-0000-af-00-0")
    doc = claim_status(claim, DRIVER, (), (), "2026-01-01T00:00:00Z")
    assert doc["status"]["devices"] == [
        {
            "driver": DRIVER,
            "pool": "node-a-pci",
            "device": "pci-0000-af-00-0",
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "Attached",
                    "lastTransitionTime": "2026-01-01T00:00:00Z",
                    "message": "0000:af:00.0 is passed through to the pod's VM",
                }
            ],
            "data": {"pciAddress": "0000:af:00.0"},
        }
    ]
    with pytest.raises(ValueError, match="1 network devices, 0 NICs"):
        claim_status(claim_of("b", "pci-0000-af-00-0", network=True), DRIVER, (), (), "now")


# -- vmsandbox plan ---------------------------------------------------------------------------------
TEMPLATE = {
    "kind": "ResourceClaimTemplate",
    "metadata": {"name": "gpu"},
    "spec": {"spec": {"devices": {"requests": [
        {"name": "gpu", "exactly": {"deviceClassName": "vmsandbox-pci"}},
        {"name": "net", "exactly": {"deviceClassName": "vmsandbox-network"}},
        {"name": "other", "exactly": {"deviceClassName": "custom"}},
    ]}}},
}  # fmt: skip
CUSTOM = {
    "kind": "DeviceClass",
    "metadata": {"name": "custom"},
    "spec": {"selectors": [{"cel": {"expression": 'device.driver == "vmsandbox.dev" && '
                                                  "device.attributes[\"vmsandbox.dev\"].type == 'pci'"}}]},
}  # fmt: skip


def test_plan_tells_passthrough_requests_from_network_ones() -> None:
    got = plan_claims((("gpu", "gpu", ""),), [TEMPLATE, CUSTOM], "default", DRIVER, ())
    assert [(r.request, r.pci, r.networks) for r in got] == [("gpu", True, ()), ("net", False, ()), ("other", True, ())]


def test_planned_groups() -> None:
    requests = [
        PlannedRequest("gpu", "template gpu", "gpu", "vmsandbox-pci", (), pci=True),
        PlannedRequest("net", "template net", "net", "vmsandbox-network", ("lan",)),
        PlannedRequest("gpu", "template gpu", "gpu2", "vmsandbox-pci", (), pci=True),
    ]
    chosen = planned_groups(requests, PUBLISHED, held=("0000:17:00.0",))
    assert [(r.request, name) for r, name in chosen] == [("gpu", "pci-0000-3b-00-0"), ("gpu2", "pci-0000-af-00-0")]
    held = [a for g in PUBLISHED.values() for a in g.addresses][1:]
    with pytest.raises(CannotFit, match="resourceClaims gpu request gpu2: no free passthrough device on this node"):
        planned_groups(requests, PUBLISHED, held=held)


# -- golden XML ------------------------------------------------------------------------------------
def test_golden_xml_of_a_domain_with_a_claimed_device() -> None:
    """A pod claiming group 40 (node 1): pinned to node 1's exclusive CPUs, its pages from node 1,
    the GPU and its audio function as ``<hostdev>``s."""
    p = placed((claim_of("a", "pci-0000-af-00-0"),))
    domain = build_domain(
        identity=SandboxIdentity("d4" * 32, "train", "ml", "uid-g", 0, "vmsandbox"),
        uuid="6f1f3f3e-6b0d-4a5e-9c58-0b0f9e1f2a3b",
        shape=SHAPE,
        host_cpus=p.cpus,
        emulator_cpus=p.cpus,
        hugepage_nodes=tuple(n for n, _, _ in p.hugepages),
        accel="kvm",
        kernel="/var/lib/vmsandbox/images/default/vmlinux",
        initrd="/var/lib/vmsandbox/images/default/initramfs.img",
        machine="q35",
        extra_cmdline="",
        shape_json=json.dumps(shape_doc(SHAPE), sort_keys=True, separators=(",", ":")),
        console_log=None,
        hostdevs=p.hostdevs,
    )
    xml = render(domain)
    assert read_hostdevs(xml) == ("0000:af:00.0", "0000:af:00.1")
    path = GOLDEN / "kvm-dra-hostdev.xml"
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_text(xml)
    assert path.exists(), f"{path} is missing; run with UPDATE_GOLDEN=1 to create it"
    assert xml == path.read_text(), f"{path} differs; review the change, then UPDATE_GOLDEN=1"
