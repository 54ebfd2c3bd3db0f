"""The DRA driver's passthrough devices on this host: the IOMMU groups of the device pools that
``dra.pci_pools`` names, resolved from sysfs as the profile pools are (``HostPolicy.device_pools``),
and which sandbox holds a group, from the one placement ledger (``ResourceManager``). The slices
publish ``groups``; the plugin checks a claim's devices against ``devices`` and ``holder``."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from vmsandbox.devices import DeviceGroup, DevicePools
from vmsandbox.dra_pci import published_groups


class PciDevices:
    def __init__(
        self,
        pci_pools: Sequence[str],
        device_pools: Callable[[], DevicePools],
        holder_of: Callable[[Sequence[str]], str | None],
    ) -> None:
        self._names = tuple(pci_pools)
        self._pools = device_pools
        self._holder_of = holder_of

    def devices(self) -> dict[str, DeviceGroup]:
        return published_groups(self._pools(), self._names)

    def groups(self) -> list[DeviceGroup]:
        return list(self.devices().values())

    def holder(self, group: DeviceGroup) -> str | None:
        return self._holder_of(group.addresses)
