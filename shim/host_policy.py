"""What this shim may hand out on this host, and the one way a pod is placed and its domain built.

``HostPolicy`` joins the shim's configuration (owned, shared and housekeeping CPUs, hugepage
caps, device pools, CDI spec directories) with a host inventory. RunPodSandbox
(``shim.sandboxes``) and ``vmsandbox plan`` (``shim.plan``) both place pods and build domains
through it, so what ``plan`` predicts is what the shim does.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping

from shim.config import ShimConfig
from vmsandbox.adapters.cdi_specs import load_registry
from vmsandbox.devices import NO_DEVICES, DevicePools, DeviceRequest, request_devices, resolve_pools
from vmsandbox.domain import Domain, SandboxIdentity, SharedDir, build_domain
from vmsandbox.errors import InvalidArgument
from vmsandbox.host import HostInventory, format_cpulist
from vmsandbox.placement import HugepageBudget, Placement, place
from vmsandbox.profile import Profile
from vmsandbox.records import shape_doc
from vmsandbox.resources import PodDeclaration, is_extended
from vmsandbox.sizing import PodDemand, VmShape

log = logging.getLogger(__name__)


class HostPolicy:
    def __init__(self, config: ShimConfig, inventory: HostInventory, *, label: str = "this host") -> None:
        self.config = config
        online = {c.id for c in inventory.cpus}
        owned = set(config.cpu_pool) if config.cpu_pool is not None else online
        missing = owned - online
        if missing:
            raise InvalidArgument(f"cpu_pool names CPUs that are not online on {label}: {format_cpulist(missing)}")
        self.owned_cpus = frozenset(owned)
        # of the owned CPUs: the shared pool (shared pods float over it) and the housekeeping CPUs
        # (emulator threads); exclusive pods get only the rest (vmsandbox.placement)
        for key in ("shared_cpus", "housekeeping_cpus"):
            outside = set(getattr(config, key)) - self.owned_cpus
            if outside:
                raise InvalidArgument(
                    f"{key} ({format_cpulist(outside)}) must be a subset of cpu_pool ({format_cpulist(owned)})"
                )
        self.shared_cpus = frozenset(config.shared_cpus)
        self.housekeeping_cpus = frozenset(config.housekeeping_cpus)

    def problems(self, inventory: HostInventory, profiles: Iterable[Profile]) -> list[str]:
        """Configuration that will refuse pods later; worth a warning at start."""
        out = [f"device_pools: {p}" for p in self.device_pools(inventory).problems]
        for p in profiles:
            if p.cpu_policy == "shared" and not self.shared_cpus:
                out.append(f"profile {p.name!r} is shared but shared_cpus is not configured: its pods will be refused")
            if p.emulator == "housekeeping" and not self.housekeeping_cpus:
                out.append(
                    f"profile {p.name!r} pins emulator threads to housekeeping CPUs but housekeeping_cpus is not "
                    "configured: its pods will be refused"
                )
        return out

    def budgets(self, inventory: HostInventory) -> dict[tuple[int, int], HugepageBudget]:
        """Pages the shim may hand out per (node, page size): what the host reserved, within the caps."""
        caps: Mapping[int, int] | None = self.config.hugepages
        remaining = dict(caps or {})
        out = {}
        for pool in inventory.hugepages:
            pages = pool.total
            if caps is not None:
                pages = min(pages, remaining.get(pool.page_size, 0))
                remaining[pool.page_size] = remaining.get(pool.page_size, 0) - pages
            out[(pool.node, pool.page_size)] = HugepageBudget(
                node=pool.node, page_size=pool.page_size, pages=pages, host_free=pool.free
            )
        return out

    def device_pools(self, inventory: HostInventory) -> DevicePools:
        """The admin's device pools resolved on this inventory (whole IOMMU groups only)."""
        return resolve_pools(self.config.device_pools, inventory)

    def device_request(
        self, declaration: PodDeclaration, demand: PodDemand, profile: Profile, inventory: HostInventory
    ) -> DeviceRequest:
        """The IOMMU groups the pod names (devices, CDI devices) and how many each pool must add
        (extended resources the profile maps to pools); INVALID_ARGUMENT naming the container for
        anything that is not a configured pool's VFIO group (DESIGN §10)."""
        containers = declaration.all_containers()
        wants_cdi = any(c.resources.cdi_devices for c in containers)
        if not (
            wants_cdi
            or any(c.resources.devices for c in containers)
            or any(
                is_extended(n) for c in containers for n in (*c.resources.requests.names(), *c.resources.limits.names())
            )
        ):
            return NO_DEVICES
        registry = load_registry(self.config.cdi_spec_dirs) if wants_cdi else None
        if registry is not None:
            for problem in registry.problems:
                log.warning("CDI: %s", problem)
        pools = self.device_pools(inventory)
        return request_devices(declaration, demand.extended, profile.extended_resources, profile.name, pools, registry)

    def place(
        self,
        shape: VmShape,
        profile: Profile,
        inventory: HostInventory,
        taken: Iterable[str],
        devices: DeviceRequest = NO_DEVICES,
    ) -> Placement:
        return place(
            shape,
            inventory,
            self.owned_cpus,
            taken,
            self.budgets(inventory),
            shared_cpus=self.shared_cpus,
            housekeeping_cpus=self.housekeeping_cpus,
            numa_policy=profile.numa_policy,
            emulator=profile.emulator,
            devices=devices,
            device_pools=self.device_pools(inventory) if not devices.empty else DevicePools(),
        )


def domain_for(
    *,
    identity: SandboxIdentity,
    uuid: str,
    shape: VmShape,
    placement: Placement,
    profile: Profile,
    accel: str,
    console_log: str | None,
    shared_dirs: tuple[SharedDir, ...] = (),
) -> Domain:
    """The domain of a placed pod: the profile's guest image and knobs, the placement's pinning."""
    image = profile.image_dir.rstrip("/")
    return build_domain(
        identity=identity,
        uuid=uuid,
        shape=shape,
        host_cpus=placement.cpus,
        emulator_cpus=placement.emulator_cpus,
        hugepage_nodes=tuple(n for n, _, _ in placement.hugepages),
        accel="kvm" if accel == "kvm" else "tcg",
        kernel=f"{image}/vmlinux",
        initrd=f"{image}/initramfs.img",
        machine=profile.machine,
        extra_cmdline=profile.kernel_cmdline,
        shape_json=json.dumps(shape_doc(shape), sort_keys=True),
        console_log=console_log,
        tcg_tb_cache_mib=profile.tcg_tb_cache_mib,
        numa_cells=placement.cells,
        hostdevs=placement.hostdevs,
        shared_dirs=shared_dirs,
    )
