"""What this shim may hand out on this host, and the one way a pod's domain is built.

``HostPolicy`` joins the shim's configuration (owned, shared and housekeeping CPUs, hugepage
caps, reserved memory, device pools, CDI spec directories) with a host inventory into the pools
the ResourceManager (``shim.host_resources``) hands out. RunPodSandbox (``shim.rpc.run_pod_sandbox``) and
``vmsandbox plan`` (``cli.plan``) both place pods through that manager and build domains with
``domain_for``, so what ``plan`` predicts is what the shim does. ``qemu_reaches`` lists what those
domains' QEMUs, as unprivileged uids, must reach on this host (checked at start and by ``validate``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping

from shim.config import ShimConfig
from vmsandbox.adapters.cdi_specs import load_registry
from vmsandbox.adapters.passable_walk import image_reach, state_reach
from vmsandbox.claims import Claim
from vmsandbox.devices import DevicePools, resolve_pools
from vmsandbox.domain import IMAGE_DISK_SLOTS, Domain, NetworkInterface, SandboxIdentity, SharedDir, build_domain
from vmsandbox.dra import ClaimedNic
from vmsandbox.errors import InvalidArgument
from vmsandbox.host import HostInventory, format_cpulist
from vmsandbox.host_pools import HostPools, HugepageBudget, host_pools
from vmsandbox.lifecycle import HostFacts, wants_cdi
from vmsandbox.network import GuestNic
from vmsandbox.passable import Reach
from vmsandbox.placement import Placement
from vmsandbox.profile import Profile
from vmsandbox.record_docs import shape_doc
from vmsandbox.resources import PodDeclaration
from vmsandbox.sizing import VmShape

log = logging.getLogger(__name__)

GUEST_BOOT_FILES = ("vmlinux", "initramfs.img")
"""The files of a profile's ``guest.image_dir`` each domain boots (its QEMU opens them)."""


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

    def budgets(
        self, inventory: HostInventory, held: Mapping[tuple[int, int], int] | None = None
    ) -> dict[tuple[int, int], HugepageBudget]:
        """Pages the shim may hand out per (node, page size): what the host reserved, within the caps,
        less what others than the shim use (the kernel's used pages beyond ``held``, the shim's own)."""
        caps: Mapping[int, int] | None = self.config.hugepages
        remaining = dict(caps or {})
        out = {}
        for pool in inventory.hugepages:
            pages = pool.total
            if caps is not None:
                pages = min(pages, remaining.get(pool.page_size, 0))
                remaining[pool.page_size] = remaining.get(pool.page_size, 0) - pages
            others = max(pool.total - pool.free - (held or {}).get((pool.node, pool.page_size), 0), 0)
            out[(pool.node, pool.page_size)] = HugepageBudget(
                node=pool.node, page_size=pool.page_size, pages=min(pages, pool.total - others), host_free=pool.free
            )
        return out

    def memory(self, inventory: HostInventory) -> dict[int, int]:
        """Ordinary memory per node guests may take: MemTotal less the node's hugepage pools and what
        the admin reserved ({} when the inventory has no memory figures: not counted)."""
        pages: dict[int, int] = {}
        for pool in inventory.hugepages:
            pages[pool.node] = pages.get(pool.node, 0) + pool.total * pool.page_size
        return {
            node: max(total - pages.get(node, 0) - self.config.memory_reserved_on(node), 0)
            for node, total in inventory.memory
        }

    def pools(self, inventory: HostInventory, held: Iterable[Claim] = ()) -> HostPools:
        """Everything the shim may hand out on ``inventory``, given what it holds already."""
        held_pages: dict[tuple[int, int], int] = {}
        for claim in held:
            for node, size, count in claim.pages:
                held_pages[(node, size)] = held_pages.get((node, size), 0) + count
        return host_pools(
            inventory,
            self.owned_cpus,
            shared_cpus=self.shared_cpus,
            housekeeping_cpus=self.housekeeping_cpus,
            budgets=self.budgets(inventory, held_pages),
            devices=self.device_pools(inventory),
            memory=self.memory(inventory),
        )

    def device_pools(self, inventory: HostInventory) -> DevicePools:
        """The admin's device pools resolved on this inventory (whole IOMMU groups only)."""
        return resolve_pools(self.config.device_pools, inventory)

    def facts(self, inventory: HostInventory, declaration: PodDeclaration | None, *, kvm_device: bool) -> HostFacts:
        """What ``lifecycle.plan_sandbox`` needs of this host; reads the CDI specs only for pods naming CDI devices."""
        registry = load_registry(self.config.cdi_spec_dirs) if wants_cdi(declaration) else None
        if registry is not None:
            for problem in registry.problems:
                log.warning("CDI: %s", problem)
        return HostFacts(
            hw_virt=inventory.hw_virt, kvm_device=kvm_device, device_pools=self.device_pools(inventory), cdi=registry
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
    interfaces: tuple[NetworkInterface, ...] = (),
    guest_nic: GuestNic | None = None,
    claimed_nics: tuple[ClaimedNic, ...] = (),
    hostname: str = "",
    qemu_uid: int = 0,
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
        kernel=f"{image}/{GUEST_BOOT_FILES[0]}",
        initrd=f"{image}/{GUEST_BOOT_FILES[1]}",
        machine=profile.machine,
        extra_cmdline=profile.kernel_cmdline,
        shape_json=json.dumps(shape_doc(shape), sort_keys=True),
        console_log=console_log,
        tcg_tb_cache_mib=profile.tcg_tb_cache_mib,
        numa_cells=placement.cells,
        hostdevs=placement.hostdevs,
        shared_dirs=shared_dirs,
        interfaces=interfaces,
        guest_nic=guest_nic,
        claimed_nics=claimed_nics,
        hostname=hostname,
        hotplug_ports=IMAGE_DISK_SLOTS,
        qemu_uid=qemu_uid,
    )


def qemu_reaches(state_dir: str, profiles: Iterable[Profile]) -> list[Reach]:
    """What each sandbox's QEMU opens as its unprivileged uid: directories below the state
    directory (its own, a snapshot guest's shares) and each profile's kernel and initramfs."""
    reaches = [state_reach(state_dir)]
    for image_dir, names in _by_image_dir(profiles).items():
        reaches.append(image_reach(f"guest.image_dir of profile {', '.join(names)}", image_dir, GUEST_BOOT_FILES))
    return reaches


def _by_image_dir(profiles: Iterable[Profile]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for p in profiles:
        out.setdefault(p.image_dir.rstrip("/") or "/", []).append(repr(p.name))
    return out
