"""vmsandbox.dra_ipam: which devices host-local serves, what it is given, and what its answers and
allocation files mean."""

from __future__ import annotations

import json
from typing import Any

import pytest

from vmsandbox import dra_ipam
from vmsandbox.cni import CniError
from vmsandbox.dra import IPAM_ADDED, IPAM_ADDING, NetworkAttachment, NetworkConfig, PreparedClaim, PreparedDevice
from vmsandbox.dra_ipam import Allocation, IpamDevice

LAN = NetworkAttachment("lan", "bridge", "br-lan", "192.168.50.0/24")
RANGED = NetworkAttachment("lan", "bridge", "br-lan", "192.168.50.0/24", "192.168.50.1", "bridge", "192.168.50.100",
                           "192.168.50.199")  # fmt: skip


def claim(uid: str = "u1", ipam: str = IPAM_ADDED) -> PreparedClaim:
    return PreparedClaim(
        uid,
        "ns",
        "c",
        ("pod",),
        (
            PreparedDevice("a", "p", "lan", NetworkConfig("net1", ("192.168.50.7/24",))),
            PreparedDevice("b", "p", "lan", NetworkConfig("net2")),
            PreparedDevice("c", "p", "fast", NetworkConfig()),
        ),
        ipam,
    )


def test_devices_without_static_addresses_are_host_locals() -> None:
    assert dra_ipam.ipam_devices(claim()) == (
        IpamDevice(1, "lan", "dra-u1-1", "net2"),
        IpamDevice(2, "fast", "dra-u1-2", "dra2"),
    )


@pytest.mark.parametrize(
    ("network", "want"),
    [
        (LAN, {"subnet": "192.168.50.0/24"}),
        (RANGED, {"subnet": "192.168.50.0/24", "gateway": "192.168.50.1", "rangeStart": "192.168.50.100",
                  "rangeEnd": "192.168.50.199"}),
    ],
)  # fmt: skip
def test_plugin_input(network: NetworkAttachment, want: dict[str, str]) -> None:
    assert json.loads(dra_ipam.plugin_input(network, "/state/dra/ipam")) == {
        "cniVersion": "1.0.0",
        "name": "lan",
        "ipam": {"type": "host-local", "ranges": [[want]], "dataDir": "/state/dra/ipam"},
    }


def test_plugin_env() -> None:
    env = dra_ipam.plugin_env("DEL", IpamDevice(1, "lan", "dra-u1-1", "net2"), ["/opt/cni/bin", "/usr/lib/cni"])
    assert env == {"CNI_COMMAND": "DEL", "CNI_CONTAINERID": "dra-u1-1", "CNI_NETNS": "none", "CNI_IFNAME": "net2",
                   "CNI_PATH": "/opt/cni/bin:/usr/lib/cni"}  # fmt: skip


@pytest.mark.parametrize(
    ("result", "want"),
    [
        ({"ips": [{"address": "192.168.50.100/24", "gateway": "192.168.50.1"}]}, ("192.168.50.100/24",)),
        ({"ips": []}, "has no ips"),
        ({}, "has no ips"),
        ({"ips": [{"address": "10.0.0.1/8"}]}, "is not in 192.168.50.0/24"),
        ({"ips": [{"address": "nonsense"}]}, "is not a CIDR"),
        ({"ips": ["x"]}, "is not a CIDR"),
        ({"ips": [{"address": "192.168.50.100/24"}] * 17}, "has no ips"),
    ],
)
def test_added_addresses(result: dict[str, Any], want: Any) -> None:
    if isinstance(want, tuple):
        assert dra_ipam.added_addresses(result, LAN) == want
        return
    with pytest.raises(CniError, match=want):
        dra_ipam.added_addresses(result, LAN)


@pytest.mark.parametrize(
    ("name", "content", "want"),
    [
        ("192.168.50.100", b"dra-u1-1\r\nnet2", Allocation("lan", "192.168.50.100", "dra-u1-1", "net2")),
        ("192.168.50.100", b"dra-u1-1", Allocation("lan", "192.168.50.100", "dra-u1-1", "")),  # before 0.9
        ("fd00::5", b"dra-u1-1\nnet2\n", Allocation("lan", "fd00::5", "dra-u1-1", "net2")),
        ("lock", b"", None),
        ("last_reserved_ip.0", b"192.168.50.100", None),
        ("192.168.50.100", b"", None),
        ("192.168.50.100", b"x" * 2000, None),
    ],
)
def test_parse_allocation(name: str, content: bytes, want: Allocation | None) -> None:
    assert dra_ipam.parse_allocation("lan", name, content) == want


def test_stale_allocations() -> None:
    held = Allocation("lan", "192.168.50.100", "dra-u1-1", "net2")
    other_ifname = Allocation("lan", "192.168.50.101", "dra-u1-1", "eth9")
    static_index = Allocation("lan", "192.168.50.102", "dra-u1-0", "net1")
    no_claim = Allocation("lan", "192.168.50.103", "dra-u9-0", "dra0")
    adding = Allocation("lan", "192.168.50.104", "dra-u2-1", "net2")
    not_ours = Allocation("lan", "192.168.50.105", "f00ba7", "eth0")
    prepared = {"u1": claim("u1"), "u2": claim("u2", IPAM_ADDING)}
    got = dra_ipam.stale_allocations([held, other_ifname, static_index, no_claim, adding, not_ours], prepared)
    assert got == [other_ifname, static_index, no_claim, adding]


def test_a_passthrough_device_takes_no_address() -> None:
    pci = PreparedDevice("gpu", "node-a-pci", "pci-0000-3b-00-0")
    network = PreparedDevice("net", "node-a-networks", "lan")
    got = dra_ipam.ipam_devices(PreparedClaim("u1", "ns", "c", ("pod",), (pci, network)))
    assert got == (IpamDevice(1, "lan", "dra-u1-1", "dra1"),)
