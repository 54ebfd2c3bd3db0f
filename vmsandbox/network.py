"""A pod's network as the core sees it (pure): what the pod asked for and what it was given.

Asked for (from ``PodSandboxConfig``): the namespace modes (``NamespaceOptions``), port mappings
and DNS settings. Given (by CNI, or read from a namespace the caller made, through
``shim.pod_networks``): the guest NIC's MAC, addresses and routes (``GuestNic``) and the pod's IPs,
put together by ``pod_network_of``. ``guest_network_args`` turns the NIC and hostname into the
guest's kernel command-line parameters; ``resolv_conf`` renders the pod's DNS settings the way a
container's ``/etc/resolv.conf`` holds them.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from vmsandbox.errors import InfrastructureError, InvalidArgument

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


NET_BIND_SERVICE = "CAP_NET_BIND_SERVICE"


@dataclass(frozen=True)
class NodePort:
    """Where the node listens for a TCP mapping of a host-network VM pod, relayed to the guest."""

    address: str
    port: int
    guest_port: int
    privileged: bool
    """Below the node's first unprivileged port: only for a pod a container of which holds
    ``CAP_NET_BIND_SERVICE`` (as a runc container on the node's network would need it)."""


def node_ports(mappings: tuple[PortMapping, ...], unprivileged_start: int) -> tuple[NodePort, ...]:
    """The node listeners of a host-network pod's TCP mappings, one per address and port (the
    first mapping's guest port wins); others' protocols are the caller's to report.

    What a runc container on the node's network could listen on: the wildcard (empty
    ``host_ip``), or one unicast address of the node, loopback included (whether the node has it,
    only the bind can tell); a port below ``unprivileged_start`` (the node's
    ``net.ipv4.ip_unprivileged_port_start``) is ``privileged``. Raises InvalidArgument for a
    multicast or broadcast address, or a scoped IPv6 address, which no listener can take."""
    out: dict[tuple[str, int], NodePort] = {}
    for m in mappings:
        if m.protocol != "tcp":
            continue
        address = m.host_ip or "0.0.0.0"
        port = m.host_port or m.container_port
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            raise InvalidArgument(
                f"port_mappings: host_ip {address[:64]!r} is not an IP address: give one of the node's, or none"
            ) from None
        if "%" in address or ip.is_multicast or address == "255.255.255.255":
            raise InvalidArgument(
                f"port_mappings: host_ip {address[:64]} (port {port}) is not a unicast address of the node: a "
                "host-network pod listens only on the node's own addresses (leave host_ip empty for all of them)"
            )
        out.setdefault((address, port), NodePort(address, port, m.container_port, port < unprivileged_start))
    return tuple(out.values())


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


def pod_network_of(mac: str, addresses: Sequence[str], routes: Sequence[Route], mtu: int = 0) -> PodNetwork:
    """The pod's network from what its ``eth0`` carries, however that was learnt (a CNI result, or
    a namespace the caller made and the shim read): the addresses (CIDRs, each checked by the
    caller) IPv4 first, the first of them the pod's primary IP; the routes in the order the guest
    adds them."""
    ordered = sorted(addresses, key=lambda a: ipaddress.ip_interface(a).version)
    pod_ips = tuple(str(ipaddress.ip_interface(a).ip) for a in ordered)
    return PodNetwork(nic=GuestNic(mac=mac, addresses=tuple(ordered), routes=tuple(routes), mtu=mtu), ips=pod_ips)


_MAC = re.compile(r"[0-9a-f]{2}(:[0-9a-f]{2}){5}")
HOSTNAME_MAX = 64  # the kernel's HOST_NAME_MAX
_HOSTNAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?")


def valid_hostname(name: str) -> bool:
    """What the guest can take as its hostname: letters, digits, '.', '_' and '-', at most 64."""
    return len(name) <= HOSTNAME_MAX and _HOSTNAME.fullmatch(name) is not None


def guest_network_args(nic: GuestNic | None, hostname: str) -> tuple[str, ...]:
    """The kernel command-line parameters the guest's /init configures its network and hostname
    from (``images/guest/init``). Every value is checked here, so none can split or extend the
    command line: InvalidArgument for a bad hostname, InfrastructureError for a bad NIC (it comes
    from the CNI plugins' result)."""
    args: list[str] = []
    if hostname:
        if not valid_hostname(hostname):
            raise InvalidArgument(
                f"hostname {hostname[:80]!r} is not a host name (at most {HOSTNAME_MAX} letters, digits, '.', '_', '-')"
            )
        args.append(f"vmsandbox.hostname={hostname}")
    if nic is None:
        return tuple(args)
    mac = nic.mac.lower()
    if not _MAC.fullmatch(mac):
        raise InfrastructureError(f"the pod network gave the MAC address {nic.mac[:40]!r}, which is not one")
    args.append(f"vmsandbox.nic={mac}")
    try:
        for address in nic.addresses:
            args.append(f"vmsandbox.addr={ipaddress.ip_interface(address).with_prefixlen}")
        for route in nic.routes:
            dst = ipaddress.ip_network(route.dst, strict=False).with_prefixlen
            args.append(
                f"vmsandbox.route={dst},{ipaddress.ip_address(route.gw)}" if route.gw else f"vmsandbox.route={dst}"
            )
    except ValueError as exc:
        raise InfrastructureError(f"the pod network gave an address the guest cannot take: {exc}") from None
    if nic.mtu:
        if not 68 <= nic.mtu <= 65535:
            raise InfrastructureError(f"the pod network gave MTU {nic.mtu}, outside 68-65535")
        args.append(f"vmsandbox.mtu={nic.mtu}")
    return tuple(args)


def resolv_conf(dns: DnsConfig) -> str:
    """The ``/etc/resolv.conf`` text for ``dns`` (one line per kind, as the kubelet's own writer)."""
    lines = [f"nameserver {s}" for s in dns.servers]
    if dns.searches:
        lines.append("search " + " ".join(dns.searches))
    if dns.options:
        lines.append("options " + " ".join(dns.options))
    return "".join(line + "\n" for line in lines)


POD_FILES = {"/etc/resolv.conf": "resolv.conf", "/etc/hostname": "hostname"}
"""Files every container of a pod shares (container path -> file name in the pod's directory)."""


def pod_files(dns: DnsConfig, hostname: str, host_resolv_conf: str) -> dict[str, str]:
    """The pod's shared files by container path, as containerd writes them: ``resolv.conf`` from the
    pod's DNS settings, else the host's (the kubelet resolved the pod's DNS policy already);
    ``hostname`` when the pod has one."""
    files = {"/etc/resolv.conf": resolv_conf(dns) if not dns.empty else host_resolv_conf}
    if hostname:
        files["/etc/hostname"] = hostname + "\n"
    return files
