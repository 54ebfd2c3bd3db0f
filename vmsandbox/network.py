"""A pod's network as the core sees it (pure): what the pod asked for and what it was given.

Asked for (from ``PodSandboxConfig``): the namespace modes (``NamespaceOptions``), port mappings
and DNS settings. Given (by CNI, through ``shim.network``): the guest NIC's MAC, addresses and
routes (``GuestNic``) and the pod's IPs. ``resolv_conf`` renders the pod's DNS settings the way a
container's ``/etc/resolv.conf`` holds them.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any, Literal

NamespaceMode = Literal["POD", "CONTAINER", "NODE", "TARGET"]
"""The CRI's ``NamespaceMode`` names."""
NAMESPACE_MODES: tuple[NamespaceMode, ...] = ("POD", "CONTAINER", "NODE", "TARGET")

Protocol = Literal["tcp", "udp", "sctp"]
PROTOCOLS: tuple[Protocol, ...] = ("tcp", "udp", "sctp")


@dataclass(frozen=True)
class NamespaceOptions:
    """``LinuxSandboxSecurityContext.namespace_options``: echoed back in PodSandboxStatus."""

    network: NamespaceMode = "POD"
    pid: NamespaceMode = "POD"
    ipc: NamespaceMode = "POD"
    target_id: str = ""

    @property
    def host_network(self) -> bool:
        return self.network == "NODE"


@dataclass(frozen=True)
class PortMapping:
    """One ``PortMapping``: traffic to ``host_ip:host_port`` goes to the pod's ``container_port``."""

    protocol: Protocol
    container_port: int
    host_port: int = 0
    host_ip: str = ""


@dataclass(frozen=True)
class DnsConfig:
    """``DNSConfig``: what the containers' ``/etc/resolv.conf`` holds (empty: the guest default)."""

    servers: tuple[str, ...] = ()
    searches: tuple[str, ...] = ()
    options: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.servers or self.searches or self.options)


@dataclass(frozen=True)
class Route:
    dst: str  # CIDR, "0.0.0.0/0" for the default route
    gw: str = ""  # empty: on-link


@dataclass(frozen=True)
class GuestNic:
    """The guest's NIC for the pod network: the MAC and addresses CNI gave the pod's ``eth0``."""

    mac: str
    addresses: tuple[str, ...]  # CIDRs, e.g. "10.88.0.5/16"
    routes: tuple[Route, ...] = ()
    mtu: int = 0  # 0: the guest's default

    @property
    def ips(self) -> tuple[str, ...]:
        return tuple(str(ipaddress.ip_interface(a).ip) for a in self.addresses)


@dataclass(frozen=True)
class PodNetwork:
    """What the pod got: a NIC with the CNI result's addresses, or none (host-network pods)."""

    nic: GuestNic | None = None
    ips: tuple[str, ...] = field(default=())  # the pod's IPs, the primary first (PodSandboxNetworkStatus)

    def to_doc(self) -> dict[str, Any]:
        nic = self.nic
        return {
            "ips": list(self.ips),
            "nic": None
            if nic is None
            else {
                "mac": nic.mac,
                "addresses": list(nic.addresses),
                "routes": [{"dst": r.dst, "gw": r.gw} for r in nic.routes],
                "mtu": nic.mtu,
            },
        }

    @staticmethod
    def from_doc(doc: dict[str, Any]) -> PodNetwork:
        nic = doc.get("nic")
        return PodNetwork(
            ips=tuple(doc.get("ips", ())),
            nic=None
            if nic is None
            else GuestNic(
                mac=nic["mac"],
                addresses=tuple(nic["addresses"]),
                routes=tuple(Route(r["dst"], r.get("gw", "")) for r in nic.get("routes", ())),
                mtu=int(nic.get("mtu", 0)),
            ),
        )


def resolv_conf(dns: DnsConfig) -> str:
    """The ``/etc/resolv.conf`` text for ``dns`` (one line per kind, as the kubelet's own writer)."""
    lines = [f"nameserver {s}" for s in dns.servers]
    if dns.searches:
        lines.append("search " + " ".join(dns.searches))
    if dns.options:
        lines.append("options " + " ".join(dns.options))
    return "".join(line + "\n" for line in lines)
