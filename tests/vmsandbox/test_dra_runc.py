"""vmsandbox.dra_runc: an ordinary pod's claimed devices as links of its namespace, the record of
what was made, and the link read back."""

from __future__ import annotations

import json
from typing import Any

import pytest

from vmsandbox.dra import NetworkAttachment, NetworkConfig, PreparedClaim, PreparedDevice, claimed_mac
from vmsandbox.dra_runc import (
    Made,
    RuncPod,
    check_netns,
    host_link_name,
    made_from_record,
    made_record,
    nic_report,
    pod_netns,
    runc_nics,
)
from vmsandbox.errors import InvalidArgument, Unsupported, WrongState
from vmsandbox.given_netns import IpOutputError

SB = "a" * 64
LAN = NetworkAttachment("lan", "bridge", "br-lan", "192.168.50.0/24")
FAST = NetworkAttachment("fast", "macvlan", "eth1", "10.9.0.0/16", mode="vepa")


def _claim(uid: str, *devices: tuple[str, str, tuple[str, ...]]) -> PreparedClaim:
    return PreparedClaim(
        uid,
        "default",
        f"claim-{uid}",
        ("pod-uid",),
        tuple(
            PreparedDevice(f"r{i}", "n-networks", d, NetworkConfig(name, addrs))
            for i, (d, name, addrs) in enumerate(devices)
        ),
    )


@pytest.mark.parametrize(
    ("claims", "want"),
    [
        (
            (_claim("u1", ("lan", "", ("192.168.50.7/24",))),),
            (
                (
                    "bridge",
                    "br-lan",
                    "net1",
                    ("192.168.50.7/24",),
                    claimed_mac(SB, "u1", 0),
                    host_link_name(SB, "u1", 0),
                ),
            ),
        ),
        (
            (_claim("u1", ("lan", "data", ("192.168.50.7/24",))), _claim("u2", ("fast", "", ("10.9.0.7/16",)))),
            (
                (
                    "bridge",
                    "br-lan",
                    "data",
                    ("192.168.50.7/24",),
                    claimed_mac(SB, "u1", 0),
                    host_link_name(SB, "u1", 0),
                ),
                ("macvlan", "eth1", "net1", ("10.9.0.7/16",), claimed_mac(SB, "u2", 1), ""),
            ),
        ),
    ],
)
def test_runc_nics(claims: tuple[PreparedClaim, ...], want: tuple[Any, ...]) -> None:
    got = runc_nics("default/web", SB, claims, (LAN, FAST))
    assert (
        tuple((n.nic.kind, n.nic.host_interface, n.nic.name, n.nic.addresses, n.nic.mac, n.host_link) for n in got)
        == want
    )


@pytest.mark.parametrize(
    ("claims", "error", "says"),
    [
        ((_claim("u1", ("lan", "net1", ())),), WrongState, "has no static addresses and none from host-local"),
        (
            (PreparedClaim("u1", "default", "c", ("p",), (PreparedDevice("gpu", "n-pci", "0000-65-00-0"),)),),
            Unsupported,
            "is a PCI passthrough device; vmsandbox passes devices through to VM pods only",
        ),
        ((_claim("u1", ("gone", "net1", ("192.168.50.7/24",))),), WrongState, "network gone is not configured"),
        (
            (_claim("u1", ("lan", "net1", ("10.9.0.7/16",))),),
            InvalidArgument,
            '"10.9.0.7/16" is not in 192.168.50.0/24',
        ),
        (
            (_claim("u1", ("lan", "x", ("192.168.50.7/24",)), ("lan", "x", ("192.168.50.8/24",))),),
            InvalidArgument,
            "interface name x is given to two",
        ),
    ],
)
def test_runc_nics_refused(claims: tuple[PreparedClaim, ...], error: type[Exception], says: str) -> None:
    with pytest.raises(error) as err:
        runc_nics("default/web", SB, claims, (LAN, FAST))
    assert says in str(err.value) and "default/web" in str(err.value)


def test_host_link_names_fit_linux_and_differ() -> None:
    names = {host_link_name(s, c, i) for s in ("a", "b") for c in ("u1", "u2") for i in (0, 1)}
    assert len(names) == 8
    assert all(len(n) == 15 and n.startswith("vdr") for n in names)


@pytest.mark.parametrize(
    ("namespaces", "want"),
    [
        ((("ipc", "/x"), ("network", "/run/netns/cni-1")), "/run/netns/cni-1"),
        ((("ipc", "/x"),), ""),
        ((), ""),
    ],
)
def test_pod_netns(namespaces: tuple[tuple[str, str], ...], want: str) -> None:
    assert pod_netns(namespaces) == want


def test_a_pod_without_a_namespace_of_its_own_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="default/web has no network namespace of its own"):
        check_netns(RuncPod(SB, "uid", "default", "web"))
    assert check_netns(RuncPod(SB, "uid", "default", "web", netns="/n")) == "/n"


def test_made_record_round_trip() -> None:
    made = Made(SB, "pod-uid", (host_link_name(SB, "u1", 0),))
    assert made_from_record(json.loads(json.dumps(made_record(made)))) == made


@pytest.mark.parametrize(
    ("record", "says"),
    [
        ([], "not a mapping"),
        ({"sandboxID": "../x", "podUID": "u", "hostLinks": []}, "is not an id"),
        ({"sandboxID": SB, "podUID": 3, "hostLinks": []}, "podUID"),
        ({"sandboxID": SB, "podUID": "u", "hostLinks": ["eth0"]}, "not a link vmsandbox makes"),
        ({"sandboxID": SB, "podUID": "u", "hostLinks": ["vdr000000000000"] * 9}, "at most 8"),
    ],
)
def test_made_record_refused(record: object, says: str) -> None:
    with pytest.raises(InvalidArgument, match=says):
        made_from_record(record)


ADDR = json.dumps(
    [
        {
            "ifname": "net1",
            "address": "02:AA:bb:cc:dd:ee",
            "mtu": 1500,
            "addr_info": [
                {"family": "inet", "local": "10.240.0.22", "prefixlen": 24},
                {"family": "inet6", "local": "fe80::1", "prefixlen": 64, "scope": "link"},
            ],
        }
    ]
)


def test_nic_report() -> None:
    got = nic_report(ADDR, "net1")
    assert (got.name, got.mac, got.addresses, got.up) == (
        "net1",
        "02:aa:bb:cc:dd:ee",
        ("10.240.0.22/24", "fe80::1/64"),
        True,
    )


@pytest.mark.parametrize("text", ["[]", "not json", json.dumps([{"ifname": "net1"}]), ADDR.replace("net1", "net2")])
def test_nic_report_refused(text: str) -> None:
    with pytest.raises(IpOutputError):
        nic_report(text, "net1")


def test_a_runc_nic_takes_the_addresses_host_local_gave() -> None:
    device = PreparedDevice("net", "n-networks", "lan", NetworkConfig("net1", ()), allocated=("192.168.50.9/24",))
    claim = PreparedClaim("u1", "default", "c", ("p",), (device,), ipam="added")
    (nic,) = runc_nics("default/web", SB, (claim,), (LAN, FAST))
    assert (nic.nic.name, nic.nic.addresses) == ("net1", ("192.168.50.9/24",))
