"""A pod network in a network namespace the caller made (pure): containerd's CRI plugin, when it
runs vmsandbox as its sandbox shim, makes the pod's namespace and runs CNI ADD there itself, then
gives the shim the namespace's path. What ``ip -j`` printed in that namespace is parsed here into
frozen values (``Interface``, ``Address``, ``NsRoute``), and ``guest_network`` chooses from them
what the guest's NIC carries: ``eth0``'s MAC, MTU and global addresses, and the main table's routes
through ``eth0`` that the guest does not make itself — the same ``PodNetwork`` a CNI result gives
(``vmsandbox.network.pod_network_of``).

The namespace is the host's, but what is in it is whatever the caller's CNI plugins put there: each
case either gives a network or fails with an error that names the namespace and what is missing
(``GivenNetnsError``, FAILED_PRECONDITION), and what is read is bounded (``MAX_OUTPUT`` bytes of
``ip``'s output, ``MAX_ADDRESSES`` and ``MAX_ROUTES`` for the guest's kernel command line, which
carries them).
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vmsandbox.cni import IFNAME
from vmsandbox.errors import InfrastructureError, InvalidArgument, WrongState
from vmsandbox.network import PodNetwork, Route, pod_network_of

MAX_PATH = 4096  # the kernel's PATH_MAX
MAX_OUTPUT = 1 << 20  # bytes of one `ip -j` listing read from the namespace
MAX_ADDRESSES = 8
MAX_ROUTES = 16
# addr_info's boolean keys kept (an address that failed duplicate detection is not the pod's)
_ADDRESS_FLAGS = ("secondary", "tentative", "deprecated", "dadfailed", "nodad", "optimistic")
_FAMILIES = {"inet": 4, "inet6": 6}
_DEFAULT = {4: "0.0.0.0/0", 6: "::/0"}
_MAC = re.compile(r"[0-9a-f]{2}(:[0-9a-f]{2}){5}")


class GivenNetnsError(WrongState):
    """The given namespace holds no network the guest can carry (no eth0, no address, too much)."""


class IpOutputError(InfrastructureError):
    """``ip -j`` printed something that is not what iproute2 prints."""


@dataclass(frozen=True)
class Address:
    """One address of an interface (an ``addr_info`` entry)."""

    family: int  # 4 or 6
    cidr: str  # e.g. "10.88.0.5/16"
    scope: str = "global"  # global, link, host, site
    flags: tuple[str, ...] = ()  # those of _ADDRESS_FLAGS set


@dataclass(frozen=True)
class Interface:
    name: str
    mac: str
    mtu: int
    addresses: tuple[Address, ...] = ()


@dataclass(frozen=True)
class NsRoute:
    """One route of the namespace's main table."""

    family: int
    dst: str  # a CIDR ("default" is read as 0.0.0.0/0 or ::/0)
    dev: str = ""  # "" for a multipath route, whose devices are in ``nexthops``
    gateway: str = ""
    kind: str = "unicast"  # ip's "type": unicast, blackhole, unreachable, prohibit, local, ...
    protocol: str = ""  # "kernel": made by the kernel for an address's prefix
    flags: tuple[str, ...] = ()  # onlink, linkdown, ...
    nexthops: tuple[str, ...] = ()  # a multipath route's devices


def check_path(path: str) -> str:
    """The namespace path as given, or InvalidArgument: an absolute path of at most PATH_MAX bytes
    with no NUL (what it names is the adapter's to check)."""
    shown = repr(path[:200])
    if not path:
        raise InvalidArgument("the network namespace path is empty")
    if "\0" in path or len(path.encode(errors="surrogateescape")) > MAX_PATH:
        raise InvalidArgument(f"network namespace path {shown} is not a path (NUL, or longer than {MAX_PATH} bytes)")
    if not path.startswith("/"):
        raise InvalidArgument(f"network namespace path {shown} is not absolute")
    return path


def _listing(text: str, what: str) -> list[Mapping[str, Any]]:
    if len(text) > MAX_OUTPUT:
        raise IpOutputError(f"{what}: more than {MAX_OUTPUT} bytes")
    try:
        doc = json.loads(text) if text.strip() else []
    except ValueError:
        raise IpOutputError(f"{what}: not JSON: {text[:120]!r}") from None
    if not isinstance(doc, list) or not all(isinstance(e, dict) for e in doc):
        raise IpOutputError(f"{what}: not a list of objects: {text[:120]!r}")
    return doc


def parse_interfaces(text: str) -> tuple[Interface, ...]:
    """``ip -j addr show``: every interface with its MAC, MTU and addresses."""
    out = []
    for entry in _listing(text, "ip -j addr show"):
        try:
            addresses = []
            for a in entry.get("addr_info") or ():
                family = _FAMILIES.get(a.get("family"))
                if family is None or "local" not in a:
                    continue  # not an IP address (ip prints others for some link types)
                cidr = ipaddress.ip_interface(f"{a['local']}/{int(a['prefixlen'])}").with_prefixlen
                flags = tuple(f for f in _ADDRESS_FLAGS if a.get(f) is True)
                addresses.append(Address(family, cidr, str(a.get("scope", "global")), flags))
            out.append(
                Interface(str(entry["ifname"]), str(entry.get("address", "")), int(entry["mtu"]), tuple(addresses))
            )
        except (KeyError, TypeError, ValueError, AttributeError):
            raise IpOutputError(f"ip -j addr show: unexpected entry {json.dumps(entry)[:200]}") from None
    return tuple(out)


def parse_routes(text: str, family: int) -> tuple[NsRoute, ...]:
    """``ip -j -4 route show table main`` (or ``-6``)."""
    out = []
    for entry in _listing(text, f"ip -j -{family} route show"):
        try:
            dst = str(entry["dst"])
            dst = _DEFAULT[family] if dst == "default" else ipaddress.ip_network(dst, strict=False).with_prefixlen
            nexthops = tuple(str(h.get("dev", "")) for h in entry.get("nexthops") or ())
            out.append(
                NsRoute(
                    family=family,
                    dst=dst,
                    dev=str(entry.get("dev", "")),
                    gateway=str(ipaddress.ip_address(entry["gateway"])) if entry.get("gateway") else "",
                    kind=str(entry.get("type", "unicast")),
                    protocol=str(entry.get("protocol", "")),
                    flags=tuple(str(f) for f in entry.get("flags") or ()),
                    nexthops=nexthops,
                )
            )
        except (KeyError, TypeError, ValueError, AttributeError):
            raise IpOutputError(f"ip -j -{family} route show: unexpected entry {json.dumps(entry)[:200]}") from None
    return tuple(out)


def guest_addresses(eth0: Interface, where: str) -> tuple[str, ...]:
    """``eth0``'s addresses the guest takes: those of global scope (not the link-local ones the
    guest's kernel makes itself, not a duplicate the kernel found), as read."""
    chosen = tuple(a.cidr for a in eth0.addresses if a.scope == "global" and "dadfailed" not in a.flags)
    if not chosen:
        seen = ", ".join(f"{a.cidr} (scope {a.scope})" for a in eth0.addresses) or "none"
        raise GivenNetnsError(
            f"{where}: {IFNAME} has no global IPv4 or IPv6 address for the pod (its addresses: {seen}); "
            "the CNI ADD that made the namespace gave it none"
        )
    if len(chosen) > MAX_ADDRESSES:
        raise GivenNetnsError(
            f"{where}: {IFNAME} has {len(chosen)} addresses, more than the {MAX_ADDRESSES} a guest takes"
        )
    return chosen


def guest_routes(routes: Sequence[NsRoute], addresses: Sequence[str], where: str) -> tuple[Route, ...]:
    """The routes the guest adds after its addresses, on-link ones first (a gateway route needs
    its gateway reachable when it is added).

    Kept: the main table's unicast routes through ``eth0``. Left out: routes through other
    interfaces (the guest has only ``eth0``), the kernel's own (an address's prefix, IPv6's
    ``fe80::/64``, which the guest's kernel makes when it takes the address) and any on-link route
    to an address's own prefix, for the same reason; of several routes to one destination (of
    different metrics) the first, which ``ip`` lists first for having the lowest metric: the guest
    adds its routes without one. An ``onlink`` gateway outside every prefix
    gets an on-link host route first, which is what ``onlink`` means. A multipath route through
    ``eth0`` is refused: the guest's NIC takes one gateway per route."""
    prefixes = {ipaddress.ip_interface(a).network.with_prefixlen for a in addresses}
    families = {ipaddress.ip_interface(a).version for a in addresses}
    on_link: list[Route] = []
    via: list[Route] = []
    taken: set[str] = set()
    for r in routes:
        if r.nexthops:
            if IFNAME in r.nexthops:
                raise GivenNetnsError(
                    f"{where}: route {r.dst} has {len(r.nexthops)} next hops; the guest's NIC takes one gateway "
                    "per route"
                )
            continue
        if r.dev != IFNAME or r.kind != "unicast" or r.protocol == "kernel" or r.family not in families:
            continue
        if (r.family == 6 and ipaddress.ip_network(r.dst).is_link_local) or r.dst in taken:
            continue
        taken.add(r.dst)
        if not r.gateway:
            if r.dst not in prefixes:
                on_link.append(Route(r.dst))
            continue
        gateway = ipaddress.ip_address(r.gateway)
        if "onlink" in r.flags and not any(gateway in ipaddress.ip_network(p) for p in prefixes):
            host = ipaddress.ip_network(gateway).with_prefixlen
            if Route(host) not in on_link:
                on_link.append(Route(host))
        via.append(Route(r.dst, r.gateway))
    chosen = tuple(dict.fromkeys([*on_link, *via]))
    if len(chosen) > MAX_ROUTES:
        raise GivenNetnsError(
            f"{where}: {len(chosen)} routes through {IFNAME}, more than the {MAX_ROUTES} a guest takes"
        )
    return chosen


def guest_network(interfaces: Sequence[Interface], routes: Sequence[NsRoute], where: str) -> PodNetwork:
    """The pod's network as read from the namespace ``where`` (named in every error): ``eth0``'s
    MAC, MTU and addresses, and the routes the guest adds."""
    eth0 = next((i for i in interfaces if i.name == IFNAME), None)
    if eth0 is None:
        names = ", ".join(i.name for i in interfaces[:16]) or "none"
        raise GivenNetnsError(
            f"{where}: there is no {IFNAME} (its interfaces: {names}); the pod's interface must be named "
            f"{IFNAME} (CNI_IFNAME)"
        )
    if not _MAC.fullmatch(eth0.mac.lower()):
        raise GivenNetnsError(
            f"{where}: {IFNAME} has no Ethernet address ({eth0.mac[:40]!r}); the guest's NIC is a macvtap on it, "
            "which needs an Ethernet link"
        )
    addresses = guest_addresses(eth0, where)
    return pod_network_of(eth0.mac, addresses, guest_routes(routes, addresses, where), eth0.mtu)
