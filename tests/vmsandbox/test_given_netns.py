"""vmsandbox.given_netns: ``ip -j``'s listings of a namespace the caller made, parsed, and the
guest's NIC chosen from them (eth0's global addresses, the routes the guest adds itself)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from vmsandbox.errors import InvalidArgument
from vmsandbox.given_netns import (
    MAX_ADDRESSES,
    MAX_OUTPUT,
    MAX_ROUTES,
    Address,
    GivenNetnsError,
    Interface,
    IpOutputError,
    NsRoute,
    check_path,
    guest_network,
    guest_routes,
    parse_interfaces,
    parse_routes,
)
from vmsandbox.network import GuestNic, PodNetwork, Route

WHERE = "network namespace /run/netns/cni-1"
MAC = "2e:a7:9e:ef:bf:ad"

# what iproute2 6.1 printed in a namespace made with `ip netns add`, a veth end as eth0, two IPv4
# addresses, one IPv6, a default route each, a Calico-style on-link gateway, a blackhole and a
# multipath route through eth0
ADDR_SHOW = json.dumps(
    [
        {
            "ifindex": 1,
            "ifname": "lo",
            "flags": ["LOOPBACK", "UP", "LOWER_UP"],
            "mtu": 65536,
            "link_type": "loopback",
            "address": "00:00:00:00:00:00",
            "addr_info": [
                {"family": "inet", "local": "127.0.0.1", "prefixlen": 8, "scope": "host", "label": "lo"},
                {"family": "inet6", "local": "::1", "prefixlen": 128, "scope": "host"},
            ],
        },
        {
            "ifindex": 2,
            "link_index": 5556,
            "ifname": "eth0",
            "flags": ["BROADCAST", "MULTICAST", "UP", "LOWER_UP"],
            "mtu": 1450,
            "link_type": "ether",
            "address": MAC,
            "addr_info": [
                {"family": "inet", "local": "10.77.0.5", "prefixlen": 24, "scope": "global", "label": "eth0"},
                {"family": "inet", "local": "10.78.0.5", "prefixlen": 16, "scope": "global", "label": "eth0"},
                {"family": "inet6", "local": "2001:db8::5", "prefixlen": 64, "scope": "global", "nodad": True},
                {"family": "inet6", "local": "fe80::2ca7:9eff:feef:bfad", "prefixlen": 64, "scope": "link"},
            ],
        },
    ]
)
ROUTES4 = json.dumps(
    [
        {"dst": "default", "gateway": "10.77.0.1", "dev": "eth0", "flags": []},
        {
            "dst": "10.55.0.0/16",
            "flags": [],
            "nexthops": [{"gateway": "10.8.0.2", "dev": "net1", "weight": 1}, {"gateway": "10.8.0.3", "dev": "net1"}],
        },
        {"type": "blackhole", "dst": "10.66.0.0/16", "flags": []},
        {"dst": "10.77.0.0/24", "dev": "eth0", "protocol": "kernel", "scope": "link", "prefsrc": "10.77.0.5"},
        {"dst": "10.78.0.0/16", "dev": "eth0", "protocol": "kernel", "scope": "link", "prefsrc": "10.78.0.5"},
        {"dst": "10.99.0.0/16", "gateway": "169.254.1.1", "dev": "eth0", "flags": ["onlink"]},
        {"dst": "169.254.1.1", "dev": "eth0", "scope": "link", "flags": []},
        {"dst": "192.168.9.0/24", "gateway": "192.168.8.1", "dev": "net1", "flags": []},
    ]
)
ROUTES6 = json.dumps(
    [
        {"dst": "2001:db8::/64", "dev": "eth0", "protocol": "kernel", "metric": 256, "pref": "medium"},
        {"dst": "fe80::/64", "dev": "eth0", "protocol": "kernel", "metric": 256, "pref": "medium"},
        {"dst": "default", "gateway": "2001:db8::1", "dev": "eth0", "metric": 1024, "pref": "medium"},
    ]
)


def test_a_namespace_as_ip_lists_it_gives_the_guest_eth0s_network() -> None:
    interfaces = parse_interfaces(ADDR_SHOW)
    routes = parse_routes(ROUTES4, 4) + parse_routes(ROUTES6, 6)
    assert interfaces[1] == Interface(
        "eth0",
        MAC,
        1450,
        (
            Address(4, "10.77.0.5/24"),
            Address(4, "10.78.0.5/16"),
            Address(6, "2001:db8::5/64", flags=("nodad",)),
            Address(6, "fe80::2ca7:9eff:feef:bfad/64", "link"),
        ),
    )
    assert routes[0] == NsRoute(4, "0.0.0.0/0", "eth0", "10.77.0.1")
    assert routes[1].nexthops == ("net1", "net1") and routes[2].kind == "blackhole"
    assert routes[6] == NsRoute(4, "169.254.1.1/32", "eth0", flags=())
    assert guest_network(interfaces, routes, WHERE) == PodNetwork(
        nic=GuestNic(
            mac=MAC,
            addresses=("10.77.0.5/24", "10.78.0.5/16", "2001:db8::5/64"),
            routes=(
                Route("169.254.1.1/32"),
                Route("0.0.0.0/0", "10.77.0.1"),
                Route("10.99.0.0/16", "169.254.1.1"),
                Route("::/0", "2001:db8::1"),
            ),
            mtu=1450,
        ),
        ips=("10.77.0.5", "10.78.0.5", "2001:db8::5"),
    )


def eth0(*addresses: Address, mac: str = MAC) -> Interface:
    return Interface("eth0", mac, 1500, addresses)


V4 = Address(4, "10.88.0.5/16")
V6 = Address(6, "fd00::5/64")
LINK6 = Address(6, "fe80::1/64", "link")
DEFAULT4 = NsRoute(4, "0.0.0.0/0", "eth0", "10.88.0.1")
DEFAULT6 = NsRoute(6, "::/0", "eth0", "fe80::1")


@pytest.mark.parametrize(
    ("case", "interfaces", "routes", "addresses", "guest", "ips"),
    [
        ("IPv4 only", [eth0(V4)], [DEFAULT4], ("10.88.0.5/16",), (Route("0.0.0.0/0", "10.88.0.1"),), ("10.88.0.5",)),
        (
            "IPv6 only: the primary IP is IPv6, a link-local gateway is kept",
            [eth0(LINK6, V6)],
            [DEFAULT6, NsRoute(6, "fe80::/64", "eth0")],
            ("fd00::5/64",),
            (Route("::/0", "fe80::1"),),
            ("fd00::5",),
        ),
        (
            "a default route and the prefix's own on-link route, which the guest's kernel makes",
            [eth0(V4)],
            [DEFAULT4, NsRoute(4, "10.88.0.0/16", "eth0")],
            ("10.88.0.5/16",),
            (Route("0.0.0.0/0", "10.88.0.1"),),
            ("10.88.0.5",),
        ),
        (
            "dual stack with a route through a gateway and another interface's default",
            [eth0(Address(6, "fd00::5/64"), Address(4, "10.1.0.5/24"))],
            [
                NsRoute(6, "::/0", "eth0", "fd00::1"),
                NsRoute(4, "0.0.0.0/0", "eth0", "10.1.0.1"),
                NsRoute(4, "192.168.0.0/16", "eth0", "10.1.0.254"),
                NsRoute(4, "0.0.0.0/0", "other", "172.16.0.1"),
            ],
            ("10.1.0.5/24", "fd00::5/64"),
            (Route("::/0", "fd00::1"), Route("0.0.0.0/0", "10.1.0.1"), Route("192.168.0.0/16", "10.1.0.254")),
            ("10.1.0.5", "fd00::5"),
        ),
        (
            "dual stack, IPv6 listed first: IPv4 is the primary IP",
            [eth0(V6, V4)],
            [DEFAULT6, DEFAULT4],
            ("10.88.0.5/16", "fd00::5/64"),
            (Route("::/0", "fe80::1"), Route("0.0.0.0/0", "10.88.0.1")),
            ("10.88.0.5", "fd00::5"),
        ),
        (
            "no route at all: the address's prefix only",
            [eth0(V4)],
            [],
            ("10.88.0.5/16",),
            (),
            ("10.88.0.5",),
        ),
        (
            "a duplicate address (dadfailed) and a host-scope one are not the pod's",
            [eth0(Address(6, "fd00::9/64", flags=("dadfailed",)), Address(4, "10.1.1.1/32", "host"), V4)],
            [],
            ("10.88.0.5/16",),
            (),
            ("10.88.0.5",),
        ),
        (
            "a tentative address is the pod's (its guest runs duplicate detection again)",
            [eth0(Address(6, "fd00::5/64", flags=("tentative",)))],
            [],
            ("fd00::5/64",),
            (),
            ("fd00::5",),
        ),
        (
            "a static on-link route to the address's own prefix is the guest kernel's to make",
            [eth0(V4)],
            [NsRoute(4, "10.88.0.0/16", "eth0", protocol="static"), DEFAULT4],
            ("10.88.0.5/16",),
            (Route("0.0.0.0/0", "10.88.0.1"),),
            ("10.88.0.5",),
        ),
        (
            "an onlink gateway outside every prefix gets its host route first",
            [eth0(Address(4, "10.244.1.7/32"))],
            [
                NsRoute(4, "10.0.0.0/8", "eth0", "192.0.2.1", flags=("onlink",)),
                NsRoute(4, "0.0.0.0/0", "eth0", "192.0.2.1", flags=("onlink",)),
            ],
            ("10.244.1.7/32",),
            (Route("192.0.2.1/32"), Route("10.0.0.0/8", "192.0.2.1"), Route("0.0.0.0/0", "192.0.2.1")),
            ("10.244.1.7",),
        ),
        (
            "an on-link default route stays on-link",
            [eth0(Address(4, "10.244.1.7/32"))],
            [NsRoute(4, "0.0.0.0/0", "eth0", protocol="boot")],
            ("10.244.1.7/32",),
            (Route("0.0.0.0/0"),),
            ("10.244.1.7",),
        ),
        (
            "of two routes to one destination the first listed (the lower metric) only",
            [eth0(V4)],
            [DEFAULT4, NsRoute(4, "0.0.0.0/0", "eth0", "10.88.0.2"), NsRoute(4, "0.0.0.0/0", "eth0")],
            ("10.88.0.5/16",),
            (Route("0.0.0.0/0", "10.88.0.1"),),
            ("10.88.0.5",),
        ),
        (
            "routes through other interfaces, of other types, or of a family eth0 has no address of",
            [eth0(V4), Interface("net1", "aa:bb:cc:dd:ee:ff", 1500, (Address(4, "10.9.0.2/24"),))],
            [
                NsRoute(4, "10.10.0.0/16", "net1", "10.9.0.1"),
                NsRoute(4, "10.11.0.0/16", kind="unreachable"),
                NsRoute(4, "10.12.0.0/16", "eth0", kind="prohibit"),
                NsRoute(6, "::/0", "eth0", "fe80::1"),
                NsRoute(4, "10.13.0.0/16", nexthops=("net1", "net2")),
                DEFAULT4,
            ],
            ("10.88.0.5/16",),
            (Route("0.0.0.0/0", "10.88.0.1"),),
            ("10.88.0.5",),
        ),
    ],
)
def test_the_guest_gets_eth0s_global_addresses_and_the_routes_it_does_not_make_itself(
    case: str,
    interfaces: list[Interface],
    routes: list[NsRoute],
    addresses: tuple[str, ...],
    guest: tuple[Route, ...],
    ips: tuple[str, ...],
) -> None:
    got = guest_network(interfaces, routes, WHERE)
    assert got.nic is not None
    assert (got.nic.addresses, got.nic.routes, got.ips, got.nic.mac) == (addresses, guest, ips, MAC), case


@pytest.mark.parametrize(
    ("case", "interfaces", "routes", "says"),
    [
        ("no interfaces", [], [], "there is no eth0 (its interfaces: none)"),
        (
            "no eth0",
            [Interface("lo", "00:00:00:00:00:00", 65536), Interface("net1", MAC, 1500, (V4,))],
            [],
            "there is no eth0 (its interfaces: lo, net1)",
        ),
        ("no address", [eth0()], [], "eth0 has no global IPv4 or IPv6 address for the pod (its addresses: none)"),
        ("only a link-local address", [eth0(LINK6)], [], "(its addresses: fe80::1/64 (scope link))"),
        ("eth0 is not Ethernet", [eth0(V4, mac="")], [], "eth0 has no Ethernet address ('')"),
        (
            "too many addresses",
            [eth0(*(Address(4, f"10.0.0.{i}/24") for i in range(MAX_ADDRESSES + 1)))],
            [],
            f"eth0 has {MAX_ADDRESSES + 1} addresses, more than the {MAX_ADDRESSES}",
        ),
        (
            "too many routes",
            [eth0(V4)],
            [NsRoute(4, f"10.{i}.0.0/16", "eth0", "10.88.0.1") for i in range(MAX_ROUTES + 1)],
            f"{MAX_ROUTES + 1} routes through eth0, more than the {MAX_ROUTES}",
        ),
        (
            "a multipath route through eth0",
            [eth0(V4)],
            [NsRoute(4, "0.0.0.0/0", nexthops=("eth0", "eth0"))],
            "route 0.0.0.0/0 has 2 next hops",
        ),
    ],
)
def test_a_namespace_the_guest_cannot_take_is_refused_naming_it(
    case: str, interfaces: list[Interface], routes: list[NsRoute], says: str
) -> None:
    with pytest.raises(GivenNetnsError) as err:
        guest_network(interfaces, routes, WHERE)
    assert str(err.value).startswith(WHERE + ": ") and says in str(err.value), case


def test_the_same_route_read_twice_is_added_once() -> None:
    onlink = NsRoute(4, "10.0.0.0/8", "eth0", "192.0.2.1", flags=("onlink",))
    assert guest_routes([onlink, onlink], ["10.244.1.7/32"], WHERE) == (
        Route("192.0.2.1/32"),
        Route("10.0.0.0/8", "192.0.2.1"),
    )


def _entry(**kw: Any) -> str:
    return json.dumps([kw])


@pytest.mark.parametrize(
    ("case", "parse", "text", "says"),
    [
        ("not JSON", parse_interfaces, "Device not found", "not JSON"),
        ("not a list", parse_interfaces, "{}", "not a list of objects"),
        ("an entry is no object", parse_interfaces, "[1]", "not a list of objects"),
        ("no ifname", parse_interfaces, _entry(mtu=1500), "unexpected entry"),
        ("a bad mtu", parse_interfaces, _entry(ifname="eth0", mtu="big"), "unexpected entry"),
        (
            "a bad address",
            parse_interfaces,
            _entry(ifname="eth0", mtu=1500, addr_info=[{"family": "inet", "local": "10.1", "prefixlen": 99}]),
            "unexpected entry",
        ),
        ("a route without dst", lambda t: parse_routes(t, 4), _entry(dev="eth0"), "unexpected entry"),
        ("a bad gateway", lambda t: parse_routes(t, 4), _entry(dst="default", gateway="x"), "unexpected entry"),
        ("too long", parse_interfaces, " " * (MAX_OUTPUT + 1), f"more than {MAX_OUTPUT} bytes"),
    ],
)
def test_ip_output_that_is_not_what_iproute2_prints_is_an_error(case: str, parse: Any, text: str, says: str) -> None:
    with pytest.raises(IpOutputError) as err:
        parse(text)
    assert says in str(err.value), case


def test_empty_listings_are_empty() -> None:
    assert parse_interfaces("") == () and parse_routes("[]", 6) == ()


def test_addresses_of_other_families_are_not_read() -> None:
    text = _entry(
        ifname="eth0",
        mtu=1500,
        address=MAC,
        addr_info=[{"family": "mpls"}, {"family": "inet", "local": "10.1.2.3", "prefixlen": 8}],
    )
    assert parse_interfaces(text)[0].addresses == (Address(4, "10.1.2.3/8"),)


@pytest.mark.parametrize(
    ("path", "says"),
    [
        ("", "is empty"),
        ("run/netns/x", "is not absolute"),
        ("/run/netns/a\0b", "is not a path"),
        ("/" + "a" * 4096, "is not a path"),
    ],
)
def test_a_path_that_is_not_one_is_refused(path: str, says: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        check_path(path)
    assert says in str(err.value)


def test_an_absolute_path_is_taken_as_given() -> None:
    assert check_path("/var/run/netns/cni-0a1b") == "/var/run/netns/cni-0a1b"
