"""The DRA driver's passthrough devices (pure): which IOMMU groups it publishes, their ResourceSlice,
and what a pod's prepared claims add to what its VM is given.

* The devices are the usable IOMMU groups (``vmsandbox.devices.resolve_pools``: whole groups, every
  function selected, bridges left to the host) of the ``device_pools`` that ``dra.pci_pools``
  names: the same rules as the profile pools, and **one ledger**. A group published here is still
  a group of its device pool: a pod's extended resource, ``/dev/vfio/<N>`` device or CDI device may
  take it too, and whichever pod's RunPodSandbox comes second is refused by the placement ledger,
  which holds each PCI function for one sandbox at most. Nothing is handed out twice.
* ``pci_slice``: the node's PCI pool, ``<node>-pci``, one ResourceSlice with a device per group,
  named from its primary function's address (``pci-0000-3b-00-0``), with its vendor, device id and
  class, IOMMU group, function count and device pool, and the standard attributes
  ``resource.kubernetes.io/pciBusID`` and (when the platform says) ``resource.kubernetes.io/numaNode``.
* ``claimed_groups`` / ``with_claimed_groups``: at RunPodSandbox the groups of a pod's prepared
  claims join the groups the pod names itself (``DeviceRequest.named``), so the placement aligns
  them with the pod's vCPUs and hugepages (its NUMA policy), the ledger holds them for the sandbox
  and the domain gets one ``<hostdev>`` per function, as for the profile pools' devices.
* ``network_claims``: the same claims reduced to their network devices (``vmsandbox.dra.claimed_nics``).
* ``planned_groups``: the device ``vmsandbox plan`` shows for each request of the passthrough class.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace
from typing import Any

from vmsandbox import validation
from vmsandbox.devices import DeviceGroup, DevicePools, DeviceRequest
from vmsandbox.dra import PCI_POOL_SUFFIX, PlannedRequest, PreparedClaim, is_pci, pci_device_name, pci_pool
from vmsandbox.errors import CannotFit, InvalidArgument, WrongState

STANDARD = "resource.kubernetes.io"  # the standard device attributes' domain


def check_pci_pools(pci_pools: Sequence[str], device_pools: Mapping[str, object], where: str) -> None:
    """``dra.pci_pools`` must name configured ``device_pools`` (InvalidArgument naming the first that is not)."""
    for name in pci_pools:
        if name not in device_pools:
            configured = ", ".join(sorted(device_pools)) or "none"
            raise InvalidArgument(
                f"{where}: dra.pci_pools: {validation.quote(name)} is not a device pool (device_pools: {configured})"
            )


def published_groups(pools: DevicePools, pci_pools: Sequence[str]) -> dict[str, DeviceGroup]:
    """The groups the driver publishes, by device name, in group order."""
    groups = sorted((g for name in pci_pools for g in pools.pools.get(name, ())), key=lambda g: g.group)
    return {pci_device_name(g.primary.address): g for g in groups}


def pci_device(driver: str, group: DeviceGroup) -> dict[str, Any]:
    """One ResourceSlice device (resource.k8s.io/v1 ``Device``) for an IOMMU group: allocated to one
    claim at a time (no ``allowMultipleAllocations``)."""
    primary = group.primary
    attributes: dict[str, Any] = {
        f"{driver}/type": {"string": "pci"},
        f"{driver}/pool": {"string": group.pool},
        f"{driver}/vendor": {"string": primary.vendor},
        f"{driver}/deviceID": {"string": primary.device},
        f"{driver}/class": {"string": primary.pci_class},
        f"{driver}/iommuGroup": {"int": group.group},
        f"{driver}/functions": {"int": len(group.functions)},
        f"{STANDARD}/pciBusID": {"string": primary.address},
    }
    if group.node >= 0:  # a device without NUMA affinity does not publish it
        attributes[f"{STANDARD}/numaNode"] = {"int": group.node}
    return {"name": pci_device_name(primary.address), "attributes": attributes}


def pci_slice_name(driver: str, node: str) -> str:
    name = f"{node}-{driver}-{PCI_POOL_SUFFIX}"
    validation.dns1123_subdomain(name, "resourceslice name")
    return name


def pci_slice(driver: str, node: str, groups: Sequence[DeviceGroup], generation: int) -> dict[str, Any]:
    """The node's PCI pool as one ResourceSlice (the whole pool: resourceSliceCount 1)."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": pci_slice_name(driver, node), "labels": {"app.kubernetes.io/managed-by": driver}},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": pci_pool(node), "generation": generation, "resourceSliceCount": 1},
            "devices": [pci_device(driver, g) for g in groups],
        },
    }


def network_claims(claims: Sequence[PreparedClaim]) -> list[PreparedClaim]:
    """The claims with their network devices only; claims with none left out."""
    out = []
    for claim in claims:
        devices = tuple(d for d in claim.devices if not is_pci(d))
        if devices:
            out.append(replace(claim, devices=devices))
    return out


def claimed_groups(
    pod: str, claims: Sequence[PreparedClaim], published: Mapping[str, DeviceGroup]
) -> tuple[DeviceGroup, ...]:
    """The IOMMU groups of a pod's prepared claims, in the claims' order. A device this node does not
    publish now (its pool no longer in ``dra.pci_pools``, the group gone or no longer usable) is
    refused by name (WrongState); so is one device in two of the pod's claims (InvalidArgument)."""
    out: list[DeviceGroup] = []
    seen: dict[str, str] = {}
    for claim in claims:
        for device in claim.devices:
            if not is_pci(device):
                continue
            what = f"claim {claim.namespace}/{claim.name} device {device.device} (request {device.request})"
            group = published.get(device.device)
            if group is None:
                raise WrongState(
                    f"pod {pod}: {what}: this node does not publish that PCI device now (dra.pci_pools: its "
                    "device pool, or the IOMMU group, is gone)"
                )
            if device.device in seen:
                raise InvalidArgument(f"pod {pod}: {what}: the device is in claim {seen[device.device]} too")
            seen[device.device] = f"{claim.namespace}/{claim.name}"
            out.append(group)
    return tuple(out)


def with_claimed_groups(request: DeviceRequest, groups: Sequence[DeviceGroup]) -> DeviceRequest:
    """``request`` with the claimed groups among those the pod names (the placement holds them all)."""
    if not groups:
        return request
    return replace(request, named=tuple(sorted({*request.named, *(g.group for g in groups)})))


def planned_groups(
    requests: Sequence[PlannedRequest],
    published: Mapping[str, DeviceGroup],
    held: Collection[str],
    candidates: Mapping[str, tuple[tuple[str, ...], int]] | None = None,
) -> tuple[tuple[PlannedRequest, str], ...]:
    """What ``vmsandbox plan`` shows for each request of this driver's passthrough class: the device
    the scheduler could allocate it, the first published one none of whose functions is ``held``
    (by a running sandbox) nor given to an earlier request. With ``candidates`` ("claim/request" ->
    the devices its selectors match and how many it takes, ``vmsandbox.dra_select``) a request
    takes that many, of those only. RunPodSandbox takes the device the scheduler allocated; the
    plan shows where such a device puts the VM. A request no free device is left for is refused
    (CannotFit) by name."""
    out = []
    given: set[str] = set()
    for r in requests:
        if not r.pci:
            continue
        matching, count = (candidates or {}).get(f"{r.claim}/{r.request}", (tuple(published), 1))
        for _ in range(count):
            name = next(
                (
                    n
                    for n, g in published.items()
                    if n in matching and n not in given and not set(g.addresses) & set(held)
                ),
                None,
            )
            if name is None:
                have = ", ".join(published) or "none"
                chosen = "" if candidates is None else f"; its selectors match: {', '.join(matching) or 'none'}"
                raise CannotFit(
                    f"resourceClaims {r.claim} request {r.request}: no free passthrough device on this node "
                    f"(published: {have}){chosen}"
                )
            given.add(name)
            out.append((r, name))
    return tuple(out)
