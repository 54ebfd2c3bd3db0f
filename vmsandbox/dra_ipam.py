"""CNI host-local IPAM for the DRA driver's claimed network devices (pure): which devices of a
prepared claim take their addresses from host-local (those without static ``addresses``), the
identity each allocation is kept under, what the plugin is given, and what its answers and its
allocation files mean.

Each device's allocation is host-local's under container id ``dra-<claim uid>-<index>`` (its index
among the claim's devices) and the device's interface name (``CNI_IFNAME``: the claim's
``interfaceName``, else ``dra<index>``), in a directory per network under the driver's dataDir.
The plugin is run on its own, for its IPAM only: nothing is made in a network namespace
(``CNI_NETNS`` is a placeholder the plugin requires and never opens).
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vmsandbox.cni import CniError
from vmsandbox.dra import IPAM_ADDED, MAX_ADDRESSES, NetworkAttachment, PreparedClaim, is_pci

PLUGIN = "host-local"
CNI_VERSION = "1.0.0"
NETNS_PLACEHOLDER = "none"  # host-local requires CNI_NETNS for ADD and CHECK, and never opens it
MAX_ALLOCATION_FILE = 1024
_CONTAINER = re.compile(r"dra-([A-Za-z0-9][A-Za-z0-9._-]{0,127})-([0-9]{1,2})")


@dataclass(frozen=True)
class IpamDevice:
    """One device of a claim whose addresses come from host-local."""

    index: int  # among the claim's devices
    network: str
    container_id: str
    ifname: str


@dataclass(frozen=True)
class Allocation:
    """One of host-local's allocation files: ``address`` held by ``container_id`` on ``ifname``."""

    network: str
    address: str
    container_id: str
    ifname: str


def container_id(claim_uid: str, index: int) -> str:
    return f"dra-{claim_uid}-{index}"


def claim_of(container: str) -> str | None:
    """The claim uid of one of this driver's container ids, else None (not ours)."""
    got = _CONTAINER.fullmatch(container)
    return got.group(1) if got else None


def ipam_devices(claim: PreparedClaim) -> tuple[IpamDevice, ...]:
    """The claim's network devices without static addresses: host-local gives theirs (a passthrough
    device has no address)."""
    return tuple(
        IpamDevice(i, d.device, container_id(claim.uid, i), d.config.interface_name or f"dra{i}")
        for i, d in enumerate(claim.devices)
        if not d.config.addresses and not is_pci(d)
    )


def plugin_input(network: NetworkAttachment, data_dir: str) -> bytes:
    """host-local's configuration (its stdin) for ``network``: one range, the network's subnet
    (within ``range_start``..``range_end`` when given, its gateway left out of it), the allocations
    under ``data_dir``/<network>."""
    allocation_range: dict[str, str] = {"subnet": network.subnet}
    if network.gateway:
        allocation_range["gateway"] = network.gateway
    if network.range_start:
        allocation_range["rangeStart"] = network.range_start
    if network.range_end:
        allocation_range["rangeEnd"] = network.range_end
    conf = {
        "cniVersion": CNI_VERSION,
        "name": network.name,
        "ipam": {"type": PLUGIN, "ranges": [[allocation_range]], "dataDir": data_dir},
    }
    return json.dumps(conf).encode()


def plugin_env(command: str, device: IpamDevice, bin_dirs: Sequence[str]) -> dict[str, str]:
    return {
        "CNI_COMMAND": command,
        "CNI_CONTAINERID": device.container_id,
        "CNI_NETNS": NETNS_PLACEHOLDER,
        "CNI_IFNAME": device.ifname,
        "CNI_PATH": ":".join(bin_dirs),
    }


def added_addresses(result: Mapping[str, Any], network: NetworkAttachment) -> tuple[str, ...]:
    """The CIDRs of host-local's ADD result, each checked to be of ``network``'s subnet; CniError
    when there is none, one is not, or there are too many."""
    ips = result.get("ips")
    if not isinstance(ips, list) or not ips or len(ips) > MAX_ADDRESSES:
        raise CniError(f"host-local on network {network.name}: its result has no ips (or more than {MAX_ADDRESSES})")
    subnet = ipaddress.ip_network(network.subnet)
    out = []
    for entry in ips:
        text = entry.get("address") if isinstance(entry, dict) else None
        try:
            address = ipaddress.ip_interface(str(text))
        except ValueError:
            raise CniError(f"host-local on network {network.name}: {str(text)[:64]!r} is not a CIDR") from None
        if address.ip not in subnet:
            raise CniError(f"host-local on network {network.name}: {address} is not in {network.subnet}")
        out.append(address.with_prefixlen)
    return tuple(out)


def parse_allocation(network: str, name: str, content: bytes) -> Allocation | None:
    """One file of host-local's directory for ``network``: an allocation when its name is an address
    and it names a container id (and, from host-local 0.9, an interface), else None (its lock, its
    last reserved address, anything else)."""
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return None
    if len(content) > MAX_ALLOCATION_FILE:
        return None
    lines = content.decode(errors="replace").replace("\r\n", "\n").split("\n")
    container = lines[0].strip()
    ifname = lines[1].strip() if len(lines) > 1 else ""
    if not container:
        return None
    return Allocation(network, str(address), container, ifname)


def stale_allocations(allocations: Sequence[Allocation], prepared: Mapping[str, PreparedClaim]) -> list[Allocation]:
    """The allocations of this driver's container ids whose claim is not prepared with them now
    (no claim, or one still ``adding`` them): each is DELeted at start."""
    out = []
    for a in allocations:
        uid = claim_of(a.container_id)
        if uid is None:
            continue  # not this driver's
        claim = prepared.get(uid)
        if claim is None or claim.ipam != IPAM_ADDED:
            out.append(a)
            continue
        if not any(d.container_id == a.container_id and d.ifname == a.ifname for d in ipam_devices(claim)):
            out.append(a)
    return out
