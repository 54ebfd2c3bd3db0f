"""vmsandbox.dra: the driver's settings, the ResourceSlice it publishes, and claims as it prepares them."""

from __future__ import annotations

import contextlib
import copy
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vmsandbox.agent_protocol import NicReport
from vmsandbox.dra import (
    IPAM_ADDED,
    IPAM_ADDING,
    ClaimedNic,
    DraConfig,
    NetworkAttachment,
    NetworkConfig,
    PlannedRequest,
    PreparedClaim,
    PreparedDevice,
    claim_failure_status,
    claim_from_record,
    claim_record,
    claim_status,
    claimed_mac,
    claimed_nic_args,
    claimed_nics,
    network_slice,
    parse_dra_config,
    plan_claims,
    prepared_claim,
    slice_differs,
)
from vmsandbox.errors import InvalidArgument, Unsupported, WrongState

DRIVER, NODE = "vmsandbox.dev", "node-a"
NET = {"name": "lan", "kind": "bridge", "interface": "br-lan", "subnet": "192.168.50.0/24"}


@pytest.mark.parametrize(
    ("data", "want"),
    [
        (None, DraConfig()),
        ({"kubeconfig": "/etc/k.conf"}, DraConfig(kubeconfig="/etc/k.conf")),
        ({"kubeconfig": "/k", "networks": [NET]},
         DraConfig(kubeconfig="/k", networks=(NetworkAttachment("lan", "bridge", "br-lan", "192.168.50.0/24"),))),
        ({"networks": [dict(NET, kind="macvlan", mode="vepa", gateway="192.168.50.1")]},
         DraConfig(networks=(NetworkAttachment("lan", "macvlan", "br-lan", "192.168.50.0/24", "192.168.50.1",
                                               "vepa"),))),
        ({"driver_name": "net.example.com", "node_name": "n1", "kubelet_plugins_dir": "/p",
          "kubelet_plugins_registry_dir": "/r"},
         DraConfig(driver_name="net.example.com", node_name="n1", plugins_dir="/p", plugins_registry_dir="/r")),
        ({"ipam_dir": "/var/lib/ipam",
          "networks": [dict(NET, range_start="192.168.50.100", range_end="192.168.50.199")]},
         DraConfig(ipam_dir="/var/lib/ipam", networks=(NetworkAttachment("lan", "bridge", "br-lan", "192.168.50.0/24",
                                                                         range_start="192.168.50.100",
                                                                         range_end="192.168.50.199"),))),
    ],
)  # fmt: skip
def test_config(data: object, want: DraConfig) -> None:
    assert parse_dra_config(data, "c.yaml") == want


def test_enabled_only_with_a_kubeconfig() -> None:
    assert not DraConfig().enabled
    assert DraConfig(kubeconfig="/k").enabled


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([], "must be a mapping"),
        ({"nope": 1}, "dra.nope: unknown key"),
        ({"kubeconfig": "rel/k"}, "kubeconfig: must be an absolute path"),
        ({"driver_name": "Not_A_Domain"}, "driver_name"),
        ({"networks": {}}, "networks: must be a list"),
        ({"networks": [dict(NET, name="Bad_Name")]}, "networks[0].name"),
        ({"networks": [dict(NET, kind="ipvlan")]}, "networks[0].kind: must be one of bridge, macvlan"),
        ({"networks": [dict(NET, interface="a/b")]}, "networks[0].interface"),
        ({"networks": [dict(NET, interface="x" * 16)]}, "networks[0].interface"),
        ({"networks": [dict(NET, subnet="10.0.0.1/8")]}, "networks[0].subnet"),
        ({"networks": [dict(NET, gateway="10.9.9.9")]}, "networks[0].gateway"),
        ({"networks": [dict(NET, mode="vepa")]}, "networks[0].mode: macvlan only"),
        ({"networks": [dict(NET, extra=1)]}, "networks[0].extra: unknown key"),
        ({"networks": [NET, NET]}, "lan is defined twice"),
        ({"networks": [dict(NET, range_start="10.0.0.1")]}, "networks[0].range_start"),
        ({"networks": [dict(NET, range_end="nonsense")]}, "networks[0].range_end"),
        ({"networks": [dict(NET, range_start="192.168.50.9", range_end="192.168.50.8")]}, "is after range_end"),
        ({"ipam_dir": "rel"}, "ipam_dir: must be an absolute path"),
        ({"networks": [dict(NET, name=f"n{i}") for i in range(65)]}, "at most 64"),
    ],
)  # fmt: skip
def test_config_refused(data: object, message: str) -> None:
    with pytest.raises(InvalidArgument, match=None) as err:
        parse_dra_config(data, "c.yaml")
    assert message in str(err.value)


def test_network_slice() -> None:
    nets = (NetworkAttachment("lan", "bridge", "br-lan", "192.168.50.0/24"),)
    body = network_slice(DRIVER, NODE, nets, 3)
    assert body["metadata"]["name"] == "node-a-vmsandbox.dev-networks"
    assert body["spec"]["pool"] == {"name": "node-a-networks", "generation": 3, "resourceSliceCount": 1}
    assert body["spec"]["nodeName"] == NODE and body["spec"]["driver"] == DRIVER
    assert body["spec"]["devices"] == [
        {
            "name": "lan",
            "allowMultipleAllocations": True,
            "attributes": {
                "vmsandbox.dev/type": {"string": "network"},
                "vmsandbox.dev/kind": {"string": "bridge"},
                "vmsandbox.dev/interface": {"string": "br-lan"},
                "vmsandbox.dev/subnet": {"string": "192.168.50.0/24"},
            },
        }
    ]
    assert not slice_differs(body, network_slice(DRIVER, NODE, nets, 4))  # the generation is ours to raise
    assert slice_differs(body, network_slice(DRIVER, NODE, (), 3))
    assert slice_differs({}, body)
    dropped = copy.deepcopy(body)  # an API server without DRAConsumableCapacity drops the field
    del dropped["spec"]["devices"][0]["allowMultipleAllocations"]
    assert not slice_differs(dropped, body)


POD = "0f4c5b5e-1111-2222-3333-444455556666"
UID = "c1a1b2c3-0000-1111-2222-333344445555"


def claim(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "metadata": {"namespace": "ns", "name": "pod-net", "uid": UID},
        "status": {
            "reservedFor": [{"resource": "pods", "name": "p", "uid": POD}],
            "allocation": {
                "devices": {
                    "results": [
                        {"request": "net", "driver": DRIVER, "pool": "node-a-networks", "device": "lan"},
                        {"request": "gpu", "driver": "gpu.example.com", "pool": "x", "device": "g0"},
                    ],
                    "config": [
                        {"source": "FromClass", "opaque": {"driver": DRIVER, "parameters": {"interfaceName": "cls0"}}},
                        {"source": "FromClaim", "requests": ["net"],
                         "opaque": {"driver": DRIVER, "parameters": {"interfaceName": "net1",
                                                                     "addresses": ["192.168.50.7/24"]}}},
                        {"source": "FromClaim", "opaque": {"driver": "gpu.example.com", "parameters": {"x": 1}}},
                    ],
                }
            },
        },
    }  # fmt: skip
    for path, value in changes.items():
        node = base
        keys = path.split("__")
        for k in keys[:-1]:
            node = node[k]
        if value is ...:
            del node[keys[-1]]
        else:
            node[keys[-1]] = value
    return base


def prepare(c: object) -> PreparedClaim:
    return prepared_claim(c, "ns", "pod-net", UID, DRIVER, NODE, frozenset({"lan"}))


def test_prepared_claim() -> None:
    assert prepare(claim()) == PreparedClaim(
        UID, "ns", "pod-net", (POD,),
        (PreparedDevice("net", "node-a-networks", "lan", NetworkConfig("net1", ("192.168.50.7/24",))),),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("changes", "want"),
    [
        ({"status__allocation__devices__config": []}, NetworkConfig()),
        ({"status__allocation__devices__config": [
            {"source": "FromClass", "opaque": {"driver": DRIVER, "parameters": {"interfaceName": "cls0"}}}]},
         NetworkConfig("cls0")),
        ({"status__allocation__devices__config": [
            {"source": "FromClaim", "requests": ["other"],
             "opaque": {"driver": DRIVER, "parameters": {"interfaceName": "x1"}}}]},
         NetworkConfig()),
    ],
)  # fmt: skip
def test_config_that_applies(changes: dict[str, Any], want: NetworkConfig) -> None:
    assert prepare(claim(**changes)).devices[0].config == want


def test_share_of_a_device() -> None:
    c = claim()
    c["status"]["allocation"]["devices"]["results"][0]["shareID"] = "9d7c0a4e-0000-4000-8000-000000000001"
    prepared = prepare(c)
    assert prepared.devices[0].share_id == "9d7c0a4e-0000-4000-8000-000000000001"
    assert claim_from_record(claim_record(prepared)) == prepared


def test_subrequest_takes_its_request_config() -> None:
    c = claim()
    c["status"]["allocation"]["devices"]["results"][0]["request"] = "net/bridge"
    assert prepare(c).devices[0].config.interface_name == "net1"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"metadata__uid": "other"}, "the claim was replaced"),
        ({"metadata__name": "x"}, "another object"),
        ({"status__allocation": ...}, "not allocated"),
        ({"status__reservedFor": []}, "reserved for no pod"),
        ({"status__reservedFor": [{"resource": "deployments", "apiGroup": "apps", "uid": "x"}]}, "reserved for no pod"),
        ({"status__reservedFor": [{"resource": "pods", "uid": "a/b"}]}, "reservedFor[0].uid"),
        ({"status__reservedFor": "x"}, "reservedFor: must be a list"),
        ({"status__reservedFor": [{"resource": "pods", "uid": "a"}, {"resource": "pods", "uid": "b"}]},
         "reserved for 2 pods"),
        ({"status__allocation__devices__results": [
            {"request": "net", "driver": DRIVER, "pool": "node-b-networks", "device": "lan"}]}, "not this node's"),
        ({"status__allocation__devices__results": [
            {"request": "net", "driver": DRIVER, "pool": "node-a-networks", "device": "wan"}]}, "not published"),
        ({"status__allocation__devices__results": [{"driver": DRIVER}]}, "request, pool and device"),
        ({"status__allocation__devices__results": [
            {"request": "net", "driver": DRIVER, "pool": "node-a-networks", "device": "lan", "shareID": "../x"}]},
         "shareID"),
        ({"status__allocation__devices__results": []}, "no device of driver vmsandbox.dev"),
        ({"status__allocation__devices__results": [{}] * 65}, "at most 64"),
        ({"status__allocation__devices__config": [{"source": "FromClaim",
          "opaque": {"driver": DRIVER, "parameters": {"interfaceName": "eth0"}}}]}, "interfaceName"),
        ({"status__allocation__devices__config": [{"source": "FromClaim",
          "opaque": {"driver": DRIVER, "parameters": {"addresses": ["10.0.0.1"]}}}]}, "not a CIDR"),
        ({"status__allocation__devices__config": [{"source": "FromClaim",
          "opaque": {"driver": DRIVER, "parameters": {"mtu": 9000}}}]}, "unknown field"),
    ],
)  # fmt: skip
def test_prepared_claim_refused(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        prepare(claim(**changes))
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("namespace", "name", "uid"),
    [("NS", "pod-net", UID), ("ns", "a/b", UID), ("ns", "pod-net", "../x"), ("ns", "pod-net", "")],
)
def test_claim_reference_refused(namespace: str, name: str, uid: str) -> None:
    with pytest.raises(InvalidArgument):
        prepared_claim(claim(), namespace, name, uid, DRIVER, NODE, frozenset({"lan"}))


def test_record_round_trip() -> None:
    prepared = prepare(claim())
    assert claim_from_record(copy.deepcopy(claim_record(prepared))) == prepared
    assert "ipam" not in claim_record(prepared) and "allocated" not in claim_record(prepared)["devices"][0]
    allocated = replace(prepared, devices=(replace(prepared.devices[0], allocated=("192.168.50.100/24",)),))
    for state in (IPAM_ADDING, IPAM_ADDED):
        record = claim_record(replace(allocated, ipam=state))
        assert record["ipam"] == state and record["devices"][0]["allocated"] == ["192.168.50.100/24"]
        assert claim_from_record(copy.deepcopy(record)) == replace(allocated, ipam=state)


@pytest.mark.parametrize(
    "record",
    [
        None,
        {},
        dict(claim_record(prepare(claim())), uid="../../etc"),
        dict(claim_record(prepare(claim())), podUIDs=[]),
        dict(claim_record(prepare(claim())), devices=[{"request": "net"}]),
        dict(claim_record(prepare(claim())), devices=[{"request": "n", "pool": "p", "device": "d", "addresses": [1]}]),
        dict(claim_record(prepare(claim())), devices=[{"request": "n", "pool": "p", "device": "d", "allocated": [1]}]),
        dict(claim_record(prepare(claim())), ipam="halfway"),
    ],
)
def test_record_refused(record: object) -> None:
    with pytest.raises(InvalidArgument):
        claim_from_record(record)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(JSON)
def test_any_json_is_a_claim_or_refused(data: object) -> None:
    with contextlib.suppress(InvalidArgument):
        prepare(data)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["metadata", "status", "reservedFor", "allocation", "devices", "results", "config"]), JSON)
def test_any_part_replaced_is_a_claim_or_refused(key: str, value: object) -> None:
    c = claim()

    def replace(node: Any) -> None:
        if isinstance(node, dict):
            for k in list(node):
                if k == key:
                    node[k] = value
                else:
                    replace(node[k])

    replace(c)
    try:
        prepared = prepare(c)
    except InvalidArgument:
        return
    assert prepared.uid == UID and prepared.pod_uids and prepared.devices


@settings(max_examples=200, deadline=None)
@given(JSON)
def test_any_json_is_a_record_or_refused(data: object) -> None:
    with contextlib.suppress(InvalidArgument):
        claim_from_record(data)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["name", "kind", "interface", "subnet", "gateway", "mode"]), JSON))
def test_any_network_is_parsed_or_refused(data: dict[str, Any]) -> None:
    with contextlib.suppress(InvalidArgument):
        parse_dra_config({"networks": [data]}, "c")


TEMPLATE = {
    "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "t"},
    "spec": {"spec": {"devices": {
        "requests": [{"name": "net", "exactly": {"deviceClassName": "vmsandbox-network"}},
                     {"name": "gpu", "exactly": {"deviceClassName": "gpu.example.com"}},
                     {"name": "any", "firstAvailable": [{"name": "fast", "deviceClassName": "vmsandbox-network"}]}],
        "config": [{"requests": ["net"], "opaque": {"driver": DRIVER, "parameters": {"interfaceName": "net1"}}}],
    }}},
}  # fmt: skip
NETS = (NetworkAttachment("lan", "bridge", "br-lan", "192.168.50.0/24"),)


@pytest.mark.parametrize(
    ("claims", "docs", "want"),
    [
        ((("c", "t", ""),), [TEMPLATE], (
            PlannedRequest("c", "template t", "net", "vmsandbox-network", ("lan",), NetworkConfig("net1")),
            PlannedRequest("c", "template t", "gpu", "gpu.example.com", ()),
            PlannedRequest("c", "template t", "any/fast", "vmsandbox-network", ("lan",)),
        )),
        ((("c", "", "shared"),), [TEMPLATE], (PlannedRequest("c", "", "", "", ()),)),
        ((("c", "", "shared"),), [{"kind": "ResourceClaim", "metadata": {"name": "shared"},
                                  "spec": TEMPLATE["spec"]["spec"]}],  # type: ignore[index]
         (PlannedRequest("c", "claim shared", "net", "vmsandbox-network", ("lan",), NetworkConfig("net1")),
          PlannedRequest("c", "claim shared", "gpu", "gpu.example.com", ()),
          PlannedRequest("c", "claim shared", "any/fast", "vmsandbox-network", ("lan",)))),
        # a DeviceClass in the manifest decides whether the class is ours
        ((("c", "t", ""),), [TEMPLATE, {"kind": "DeviceClass", "metadata": {"name": "vmsandbox-network"},
                                        "spec": {"selectors": [{"cel": {"expression": 'device.driver == "x"'}}]}}],
         (PlannedRequest("c", "template t", "net", "vmsandbox-network", ()),
          PlannedRequest("c", "template t", "gpu", "gpu.example.com", ()),
          PlannedRequest("c", "template t", "any/fast", "vmsandbox-network", ()))),
    ],
)  # fmt: skip
def test_plan_claims(
    claims: tuple[tuple[str, str, str], ...], docs: list[Any], want: tuple[PlannedRequest, ...]
) -> None:
    assert plan_claims(claims, docs, "default", DRIVER, NETS) == want


def test_plan_claims_refuses_a_malformed_template() -> None:
    bad = copy.deepcopy(TEMPLATE)
    bad["spec"]["spec"]["devices"]["requests"] = [{"exactly": {}}]  # type: ignore[index]
    with pytest.raises(InvalidArgument, match="name: missing"):
        plan_claims((("c", "t", ""),), [bad], "default", DRIVER, NETS)


# ---- the NICs a pod's prepared claims put in its VM ---------------------------------------------

LAN = NetworkAttachment("lan", "bridge", "br-lan", "192.168.50.0/24")
FAST = NetworkAttachment("fast", "macvlan", "eth1", "10.9.0.0/16", mode="vepa")
SB = "ab" * 32


def _claim(uid: str, *devices: tuple[str, str, tuple[str, ...]]) -> PreparedClaim:
    return PreparedClaim(
        uid,
        "default",
        f"c-{uid}",
        ("pod-uid",),
        tuple(
            PreparedDevice(f"r{i}", "node-a-networks", dev, NetworkConfig(name, addrs))
            for i, (dev, name, addrs) in enumerate(devices)
        ),
    )


@pytest.mark.parametrize(
    ("claims", "want"),
    [
        ((), ()),
        (
            (_claim("u1", ("lan", "net1", ("192.168.50.7/24",))),),
            (("bridge", "br-lan", "net1", ("192.168.50.7/24",), claimed_mac(SB, "u1", 0)),),
        ),
        # no name given: net1, net2, ... skipping the names other devices were given
        (
            (_claim("u1", ("lan", "", ("192.168.50.7/24",)), ("fast", "net1", ("10.9.0.7/16",))),),
            (
                ("bridge", "br-lan", "net2", ("192.168.50.7/24",), claimed_mac(SB, "u1", 0)),
                ("macvlan", "eth1", "net1", ("10.9.0.7/16",), claimed_mac(SB, "u1", 1)),
            ),
        ),
        (
            (_claim("u1", ("lan", "a", ("192.168.50.7/24",))), _claim("u2", ("fast", "b", ("10.9.0.7/16",)))),
            (
                ("bridge", "br-lan", "a", ("192.168.50.7/24",), claimed_mac(SB, "u1", 0)),
                ("macvlan", "eth1", "b", ("10.9.0.7/16",), claimed_mac(SB, "u2", 1)),
            ),
        ),
    ],
)
def test_claimed_nics(claims: tuple[PreparedClaim, ...], want: tuple[Any, ...]) -> None:
    got = claimed_nics("default/web", SB, claims, (LAN, FAST))
    assert tuple((n.kind, n.host_interface, n.name, n.addresses, n.mac) for n in got) == want
    assert all(n.mode == ("vepa" if n.kind == "macvlan" else "bridge") for n in got)


def test_claimed_nics_take_host_locals_addresses_without_static_ones() -> None:
    (unallocated,) = _claim("u1", ("lan", "net1", ())).devices
    allocated = PreparedClaim("u1", "default", "c-u1", ("pod-uid",),
                              (replace(unallocated, allocated=("192.168.50.100/24",)),), IPAM_ADDED)  # fmt: skip
    (nic,) = claimed_nics("default/web", SB, (allocated,), (LAN, FAST))
    assert (nic.name, nic.addresses) == ("net1", ("192.168.50.100/24",))
    # vmsandbox plan's NIC: host-local has not run, the NIC has no address yet
    (planned,) = claimed_nics("default/web", SB, (_claim("u1", ("lan", "net1", ())),), (LAN,), planned=True)
    assert planned.addresses == ()


@pytest.mark.parametrize(
    ("claims", "error", "says"),
    [
        ((_claim("u1", ("gone", "net1", ("192.168.50.7/24",))),), WrongState, "network gone is not configured"),
        ((_claim("u1", ("lan", "net1", ())),), WrongState, "has no static addresses and none from host-local"),
        (
            (_claim("u1", ("lan", "net1", ("10.9.0.7/16",))),),
            InvalidArgument,
            '"10.9.0.7/16" is not in 192.168.50.0/24',
        ),
        (
            (_claim("u1", ("lan", "x", ("192.168.50.7/24",)), ("fast", "x", ("10.9.0.7/16",))),),
            InvalidArgument,
            "interface name x is given to two",
        ),
        ((_claim("u1", *[("lan", f"n{i}", ("192.168.50.7/24",)) for i in range(9)]),), Unsupported, "at most 8"),
        (
            (_claim("u1", *[("lan", f"n{i}", tuple(f"192.168.50.{j}/24" for j in range(16))) for i in range(5)]),),
            Unsupported,
            "kernel command line",
        ),
    ],
)
def test_claimed_nics_refused(claims: tuple[PreparedClaim, ...], error: type[Exception], says: str) -> None:
    with pytest.raises(error) as err:
        claimed_nics("default/web", SB, claims, (LAN, FAST))
    assert says in str(err.value)


def test_claimed_macs_are_local_unicast_and_differ_by_sandbox_claim_and_index() -> None:
    macs = {claimed_mac(s, c, i) for s in ("a", "b") for c in ("u1", "u2") for i in (0, 1)}
    assert len(macs) == 8
    assert all(int(m[:2], 16) & 0b11 == 0b10 for m in macs)


@pytest.mark.parametrize(
    ("nic", "want"),
    [
        (
            ClaimedNic("d/c", "lan", "bridge", "br", "bridge", "02:00:00:00:00:01", "net1", ("192.168.50.7/24",)),
            ("vmsandbox.xnic=02:00:00:00:00:01,net1,192.168.50.7/24",),
        ),
        (
            ClaimedNic("d/c", "lan", "bridge", "br", "bridge", "02:00:00:00:00:01", "net1", ("fd00::0007/64",)),
            ("vmsandbox.xnic=02:00:00:00:00:01,net1,fd00::7/64",),
        ),
    ],
)
def test_claimed_nic_args(nic: ClaimedNic, want: tuple[str, ...]) -> None:
    assert claimed_nic_args((nic,)) == want


@pytest.mark.parametrize(
    "nic",
    [
        ClaimedNic("d/c", "lan", "bridge", "br", "bridge", "02:00:00:00:00:01", "net1 x", ()),
        ClaimedNic("d/c", "lan", "bridge", "br", "bridge", "02:00:00:00:00:01", "net1\n", ()),
        ClaimedNic("d/c", "lan", "bridge", "br", "bridge", "02:00:00:00:00:01", "eth0", ()),
        ClaimedNic("d/c", "lan", "bridge", "br", "bridge", "02:00:00:00:00:0G", "net1", ()),
        ClaimedNic("d/c", "lan", "bridge", "br", "bridge", "02:00:00:00:00:01", "net1", ("1.2.3.4/24 x=y",)),
    ],
)
def test_claimed_nic_args_never_split_the_command_line(nic: ClaimedNic) -> None:
    with pytest.raises(InvalidArgument):
        claimed_nic_args((nic,))


def test_claim_status_says_what_the_guest_reports_of_each_nic() -> None:
    claim = PreparedClaim(
        "u1", "default", "c1", ("pod-uid",),
        (PreparedDevice("a", "node-a-networks", "lan", NetworkConfig("net1", ("192.168.50.7/24",)), share_id="s-1"),
         PreparedDevice("b", "node-a-networks", "fast", NetworkConfig("net2", ("10.9.0.7/16",)))),
    )  # fmt: skip
    nics = claimed_nics("default/web", SB, (claim,), (LAN, FAST))
    reported = (NicReport("net1", nics[0].mac.upper(), ("192.168.50.7/24", "fe80::1/64", "junk"), True),)
    doc = claim_status(claim, DRIVER, nics, reported, "2026-01-01T00:00:00Z")
    assert doc["metadata"] == {"name": "c1", "namespace": "default", "uid": "u1"}
    first, second = doc["status"]["devices"]
    assert first == {
        "driver": DRIVER, "pool": "node-a-networks", "device": "lan", "shareID": "s-1",
        "conditions": [{"type": "Ready", "status": "True", "reason": "NicUp",
                        "lastTransitionTime": "2026-01-01T00:00:00Z", "message": "net1 is up in the pod's VM"}],
        "networkData": {"interfaceName": "net1", "ips": ["192.168.50.7/24", "fe80::1/64"],
                        "hardwareAddress": nics[0].mac},
    }  # fmt: skip
    assert "shareID" not in second and "networkData" not in second
    assert [(c["status"], c["reason"]) for c in second["conditions"]] == [("False", "NotInGuest")]


def test_claim_failure_status_sets_each_device_not_ready_with_the_reason() -> None:
    claim = _claim("u1", ("lan", "net1", ()), ("fast", "net2", ()))
    claim = replace(claim, devices=(replace(claim.devices[0], share_id="s-1"), claim.devices[1]))
    body = claim_failure_status(claim, DRIVER, "AttachFailed", "RunPodSandbox failed:\n " + "x" * 2000, "T")
    assert body["metadata"] == {"name": "c-u1", "namespace": "default", "uid": "u1"}
    first, second = body["status"]["devices"]
    assert (first["device"], first["shareID"], second["device"]) == ("lan", "s-1", "fast") and "shareID" not in second
    for device in (first, second):
        assert "networkData" not in device
        (cond,) = device["conditions"]
        assert (cond["type"], cond["status"], cond["reason"], cond["lastTransitionTime"]) == (
            "Ready", "False", "AttachFailed", "T")  # fmt: skip
        assert cond["message"].startswith("RunPodSandbox failed: xxx") and len(cond["message"]) == 1024
    with pytest.raises(InvalidArgument):
        claim_failure_status(claim, DRIVER, "not a reason", "m", "T")
