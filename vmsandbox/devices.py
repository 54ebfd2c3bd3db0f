"""Device pools, IOMMU group closure and what a pod asks for (pure).

The admin configures pools (``device_pools`` in the shim's configuration): a pool name maps to PCI
addresses (``0000:3b:00.0``, or ``3b:00.0``) and/or vendor:device ids (``10de:2330``). Only
functions of configured pools are ever passed through: a pod names pools indirectly
(an extended resource its profile maps to a pool), or names an IOMMU group that must belong to a
pool (``/dev/vfio/<group>`` as a device, or a CDI device whose spec injects that node).

**One device is one IOMMU group.** VFIO hands a guest whole groups, so the unit a pool holds and a
pod gets is a group: its primary function (the lowest address the pool selects) plus every other
function of the group. A group is usable only when every function in it (PCI bridges aside, they
stay with the host) is selected by the same pool: passing a group whole must never take a function
the admin did not give us (say, the host's NIC sharing a group with a GPU). Groups that fail that
rule, functions without an IOMMU group (IOMMU off) and selectors matching nothing are reported as
``problems`` and left out; they never fail the shim.

Claims: each passed function is held by one sandbox at most (``vmsandbox.claims.Claim.pci``, a unique
row in the ledger), so a group can never be given to two sandboxes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

from vmsandbox.cdi import CdiError, CdiRegistry, parse_qualified_name
from vmsandbox.errors import InvalidArgument
from vmsandbox.host import HostInventory, PciFunction, parse_pci_address
from vmsandbox.resources import PodDeclaration, is_extended

VFIO_DIR = "/dev/vfio/"
VFIO_CONTAINER = "/dev/vfio/vfio"  # the VFIO container node: no device of its own

_IDS = re.compile(r"([0-9a-f]{4}):([0-9a-f]{4})")
_POOL_NAME = re.compile(r"[a-z0-9]([a-z0-9._-]*[a-z0-9])?")

SelectorKind = Literal["address", "ids"]


def parse_selector(text: str) -> tuple[SelectorKind, str]:
    """A pool entry: a PCI address (canonicalised) or a ``vendor:device`` id pair; ValueError on junk."""
    value = text.strip().lower()
    m = _IDS.fullmatch(value)
    if m:
        return "ids", value
    try:
        return "address", parse_pci_address(value)
    except ValueError:
        raise ValueError(
            f"{text!r} is neither a PCI address ([dddd:]bb:ss.f) nor a vendor:device id (10de:2330)"
        ) from None


def parse_pool_config(data: object) -> dict[str, tuple[str, ...]]:
    """Validate ``device_pools`` (name -> list of selectors); ValueError naming the entry."""
    if not isinstance(data, Mapping):
        raise ValueError("must map pool names to lists of PCI addresses or vendor:device ids")
    out: dict[str, tuple[str, ...]] = {}
    for name, entries in data.items():
        if not isinstance(name, str) or not _POOL_NAME.fullmatch(name):
            raise ValueError(f"{name!r}: a pool name is lower-case letters, digits, '.', '_' and '-'")
        if not isinstance(entries, list) or not entries:
            raise ValueError(f"{name}: must be a non-empty list of PCI addresses or vendor:device ids")
        selectors = []
        for entry in entries:
            if not isinstance(entry, str):
                raise ValueError(f"{name}: {entry!r} is not a string")
            try:
                _, value = parse_selector(entry)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
            selectors.append(value)
        out[name] = tuple(dict.fromkeys(selectors))
    return out


@dataclass(frozen=True, order=True)
class DeviceGroup:
    """One passable unit: an IOMMU group of one pool, with the functions the guest gets."""

    group: int
    pool: str
    node: int  # NUMA node of the primary function; -1 when the platform does not say
    functions: tuple[PciFunction, ...]  # primary first; PCI bridges of the group are not in it

    @property
    def primary(self) -> PciFunction:
        return self.functions[0]

    @property
    def addresses(self) -> tuple[str, ...]:
        return tuple(f.address for f in self.functions)

    def to_doc(self) -> dict[str, object]:
        """What a sandbox record and the admin's tools show of a passed-through group."""
        return {"pool": self.pool, "iommu_group": self.group, "node": self.node, "functions": list(self.addresses)}

    def describe(self) -> str:
        more = f" + {len(self.functions) - 1} more" if len(self.functions) > 1 else ""
        where = f"node {self.node}" if self.node >= 0 else "no NUMA node"
        return f"IOMMU group {self.group} ({self.primary.address} {self.primary.ids}{more}, pool {self.pool}, {where})"


@dataclass(frozen=True)
class DevicePools:
    """The usable groups of every configured pool (a pool may be empty), and what was left out."""

    pools: Mapping[str, tuple[DeviceGroup, ...]] = field(default_factory=dict)
    problems: tuple[str, ...] = ()
    host_groups: frozenset[int] = frozenset()  # every IOMMU group the host has

    @cached_property
    def by_group(self) -> dict[int, DeviceGroup]:
        return {g.group: g for groups in self.pools.values() for g in groups}

    @cached_property
    def by_address(self) -> dict[str, DeviceGroup]:
        return {f.address: g for g in self.by_group.values() for f in g.functions}

    def group(self, number: int) -> DeviceGroup | None:
        return self.by_group.get(number)


NO_POOLS = DevicePools()


def resolve_pools(config: Mapping[str, Sequence[str]], inventory: HostInventory) -> DevicePools:
    """Match the admin's selectors against the host's PCI functions and close over IOMMU groups."""
    problems: list[str] = []
    pools_of: dict[str, set[str]] = {}
    for pool, selectors in sorted(config.items()):
        for selector in selectors:
            kind, value = parse_selector(selector)
            hits = [f for f in inventory.pci if (f.address if kind == "address" else f.ids) == value]
            if not hits:
                problems.append(f"device_pools.{pool}: {selector} matches no PCI function on this host")
            for f in hits:
                pools_of.setdefault(f.address, set()).add(pool)
    groups = inventory.iommu_groups()
    out: dict[str, list[DeviceGroup]] = {name: [] for name in config}
    done: set[int] = set()
    for f in inventory.pci:
        names = pools_of.get(f.address)
        if not names:
            continue
        label = ", ".join(sorted(names))
        if f.iommu_group is None:
            problems.append(
                f"device_pools.{label}: {f.describe()} has no IOMMU group (is the IOMMU on? intel_iommu=on or "
                "amd_iommu=on): it cannot be passed through"
            )
            continue
        if f.iommu_group in done:
            continue
        done.add(f.iommu_group)
        members = groups[f.iommu_group]
        owners = set().union(*(pools_of.get(m.address, set()) for m in members))
        if len(owners) > 1:
            problems.append(
                f"IOMMU group {f.iommu_group} has functions in pools {', '.join(sorted(owners))}: a group is "
                "passed through whole, to one pool only; it is left out"
            )
            continue
        pool = next(iter(owners))
        outside = [m for m in members if m.address not in pools_of and not m.is_bridge]
        if outside:
            problems.append(
                f"device_pools.{pool}: IOMMU group {f.iommu_group} also holds "
                f"{', '.join(m.describe() for m in outside)}, which no pool selects; a group is passed through "
                "whole, so it is left out"
            )
            continue
        passed = tuple(m for m in members if m.address in pools_of and not m.is_bridge)
        if not passed:
            problems.append(f"device_pools.{pool}: IOMMU group {f.iommu_group} holds only PCI bridges; left out")
            continue
        out[pool].append(DeviceGroup(group=f.iommu_group, pool=pool, node=passed[0].node, functions=passed))
    return DevicePools(
        pools={name: tuple(sorted(gs)) for name, gs in sorted(out.items())},
        problems=tuple(problems),
        host_groups=frozenset(groups),
    )


# -- what a pod asks for ----------------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceRequest:
    """The groups a pod names, and how many more each pool must supply (the placer chooses those)."""

    named: tuple[int, ...] = ()  # IOMMU group numbers, sorted
    counts: tuple[tuple[str, int], ...] = ()  # (pool, groups to choose), by pool name, counts > 0

    @property
    def empty(self) -> bool:
        return not self.named and not self.counts


NO_DEVICES = DeviceRequest()


def vfio_group(path: str) -> int | None:
    """``/dev/vfio/12`` -> 12; None for any other path (``/dev/vfio/vfio`` included)."""
    if path.startswith(VFIO_DIR):
        rest = path[len(VFIO_DIR) :]
        if rest.isascii() and rest.isdigit():  # str.isdigit() is true for "²", which int() refuses
            return int(rest)
    return None


def request_devices(
    declaration: PodDeclaration,
    extended: Sequence[tuple[str, int]],
    mapping: Mapping[str, str],
    profile_name: str,
    pools: DevicePools,
    cdi: CdiRegistry | None,
) -> DeviceRequest:
    """Resolve a pod's extended resources, devices and CDI devices to IOMMU groups of configured pools.

    ``extended`` is the pod's effective count per extended resource (``PodDemand.extended``) and
    ``mapping`` the profile's ``extended_resources`` (resource -> pool). An extended resource asks
    for that many groups of its pool; groups the pod also names explicitly (a device plugin's
    ``/dev/vfio/<N>`` or CDI device for the same resource) count towards it, so a pod is never
    given twice what it asked for once. Bad input is INVALID_ARGUMENT naming the container.
    """
    configured = ", ".join(pools.pools) or "none"
    named: dict[int, DeviceGroup] = {}

    def name_group(container: str, what: str, number: int) -> None:
        group = pools.group(number)
        if group is None:
            where = "" if number in pools.host_groups else f" (this host has no IOMMU group {number})"
            raise InvalidArgument(
                f'container "{container}": {what}: IOMMU group {number} is not in a configured device pool'
                f"{where} (device_pools: {configured})"
            )
        named[number] = group

    for c in declaration.all_containers():
        res = c.resources
        for key in sorted({*res.requests.names(), *res.limits.names()}):
            if not is_extended(key):
                continue
            pool = mapping.get(key)
            if pool is None:
                raise InvalidArgument(
                    f'container "{c.name}": extended resource {key} is not mapped to a device pool '
                    f"by profile {profile_name!r}"
                )
            if pool not in pools.pools:
                raise InvalidArgument(
                    f'container "{c.name}": extended resource {key} maps to device pool {pool!r}, '
                    f"which is not configured on this node (device_pools: {configured})"
                )
        for device in sorted(res.devices):
            path = device.host_path or device.container_path
            if path == VFIO_CONTAINER:
                continue
            number = vfio_group(path)
            if number is None:
                raise InvalidArgument(
                    f'container "{c.name}": device {path} cannot be passed into a VM: only VFIO groups '
                    "(/dev/vfio/<group>) of a configured device pool can"
                )
            name_group(c.name, f"device {path}", number)
        for cdi_device in sorted(res.cdi_devices):
            try:
                parse_qualified_name(cdi_device.name)
            except CdiError as exc:
                raise InvalidArgument(f'container "{c.name}": CDI device: {exc}') from None
            spec = cdi.resolve(cdi_device.name) if cdi is not None else None
            if spec is None:
                dirs = ", ".join(cdi.dirs) if cdi is not None else "no CDI spec directories"
                raise InvalidArgument(
                    f'container "{c.name}": CDI device "{cdi_device.name}" is not defined by any CDI spec '
                    f"(searched {dirs})"
                )
            numbers = [n for n in (vfio_group(p) for p in spec.node_paths) if n is not None]
            if not numbers:
                raise InvalidArgument(
                    f'container "{c.name}": CDI device "{cdi_device.name}" ({spec.source}) has no VFIO group '
                    "node (/dev/vfio/<group>); only VFIO devices can be passed into a VM"
                )
            for number in numbers:
                name_group(c.name, f'CDI device "{cdi_device.name}"', number)
    wanted: dict[str, int] = {}
    for resource, count in extended:
        pool = mapping.get(resource)
        if pool is not None and count > 0:
            wanted[pool] = wanted.get(pool, 0) + count
    for group in named.values():
        if group.pool in wanted:
            wanted[group.pool] -= 1
    return DeviceRequest(
        named=tuple(sorted(named)),
        counts=tuple((pool, n) for pool, n in sorted(wanted.items()) if n > 0),
    )
