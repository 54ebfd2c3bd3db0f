"""The libvirt domain of a sandbox as typed, frozen values, and the pure builder that makes it.

``build_domain`` turns (sandbox identity, VM shape, placement, guest image, settings) into a
``Domain``; ``domain_xml.render`` turns a ``Domain`` into libvirt XML. Nothing here touches
libvirt or the filesystem: same input, same domain, same XML.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from vmsandbox.dra import ClaimedNic, claimed_nic_args
from vmsandbox.errors import InternalError
from vmsandbox.network import GuestNic, guest_network_args
from vmsandbox.placement import GuestCell
from vmsandbox.profile import HOTPLUG_BLOCK
from vmsandbox.sizing import VmShape

METADATA_NS = "https://vmsandbox.dev/xmlns/sandbox/1"
METADATA_PREFIX = "vmsandbox"
AGENT_CHANNEL = "io.vmsandbox.agent.0"
DOMAIN_PREFIX = "vmsandbox-"

DomainType = Literal["kvm", "qemu"]


@dataclass(frozen=True)
class SandboxIdentity:
    """Who the guest belongs to; written into the domain's metadata."""

    sandbox_id: str
    pod_name: str
    pod_namespace: str
    pod_uid: str
    attempt: int
    runtime_handler: str
    owner: str = ""  # the instance id of the state database that owns the domain (ledger.instance_id)
    # the directory of that state database: a domain whose state directory is gone has no shim left
    # to own it (``vmsandbox.domain_xml.read_identity``; ``make stop-host`` removes such domains)
    state_dir: str = ""


@dataclass(frozen=True)
class CpuTune:
    vcpupins: tuple[tuple[int, tuple[int, ...]], ...]  # (vcpu, host cpus)
    emulatorpin: tuple[int, ...]


@dataclass(frozen=True)
class HugepageBacking:
    page_size_kib: int
    host_nodes: tuple[int, ...] = ()  # NUMA nodes the pages come from (numatune strict)


@dataclass(frozen=True)
class NumaCell:
    """A guest NUMA cell: its vCPUs and its memory, bound to one host node (``<memnode>`` strict)."""

    vcpus: tuple[int, ...]  # empty: a memory-only cell
    memory_kib: int
    host_node: int


@dataclass(frozen=True)
class KernelBoot:
    kernel: str
    initrd: str
    cmdline: str
    machine: str


VIRTIO_SERIAL_PORTS = 2
"""Ports of the guest's virtio-serial controller: 0 (reserved for a console, unused) and the
agent's channel, 1. QEMU's default of 31 keeps a pair of virtqueues and their state for each port
(bench/vmm_memory.py: about 0.4 MiB of QEMU's memory per pod)."""


@dataclass(frozen=True)
class AgentChannel:
    """A virtio-serial port; libvirt picks the host socket path when ``path`` is empty."""

    name: str = AGENT_CHANNEL
    path: str = ""


@dataclass(frozen=True)
class SharedDir:
    """A host directory the guest mounts over virtio-9p by ``tag`` (libvirt ``<filesystem
    type='mount'>``; Debian 12's QEMU has no virtiofsd).

    ``accessmode`` is libvirt's 9p security model. ``passthrough``: the guest's owners, modes and
    file types are the host's own (what the guest creates is created so on the host). ``mapped``:
    QEMU keeps what the guest sets (owner, mode, symlink, device node) in ``user.virtfs.*``
    extended attributes and creates every file on the host as a plain regular file or directory,
    mode ``fmode``/``dmode`` and owned by QEMU's own user, so nothing a guest writes becomes a
    setuid/setgid file, a file capability, a symlink or a device node on the host."""

    source: str
    tag: str
    readonly: bool = False
    accessmode: Literal["passthrough", "mapped"] = "passthrough"
    fmode: int = 0o600
    dmode: int = 0o700


@dataclass(frozen=True)
class ImageDiskDevice:
    """An image's read-only disk in a running guest (hot-plugged as virtio-blk): the file, the
    serial the guest agent finds it by, and libvirt's target name (``vdb``...), which libvirt needs
    but the guest never relies on."""

    source: str
    serial: str
    target_dev: str


IMAGE_DISK_SLOTS = 8
"""How many images' disks one pod's guest can hold: its domain has this many empty PCIe root ports."""
IMAGE_DISK_TARGETS = tuple(f"vd{c}" for c in "bcdefghijklmnopqrstuvwxyz")
"""libvirt target names for image disks, in the order they are handed out."""


def free_disk_target(used: set[str]) -> str | None:
    """The first image-disk target name not in ``used`` (the live domain's disks, including ones
    whose removal the guest has not finished); None when all are taken."""
    return next((t for t in IMAGE_DISK_TARGETS if t not in used), None)


@dataclass(frozen=True)
class NetworkInterface:
    """A guest NIC. ``ethernet``: an existing host device handed to libvirt unmanaged (the pod's
    macvtap on its CNI ``eth0``, ``target_dev``; without one, a tap libvirt makes and connects to
    nothing); ``user``: QEMU's user-mode network; ``bridge``: a tap libvirt makes on bridge
    ``source`` and removes with the domain; ``direct``: a macvtap libvirt makes on host interface
    ``source`` in ``mode`` and removes with the domain (a claimed network's NIC)."""

    kind: Literal["ethernet", "user", "bridge", "direct"]
    mac: str
    target_dev: str = ""
    source: str = ""  # bridge, direct
    mode: str = ""  # direct


@dataclass(frozen=True)
class RngDevice:
    """A virtio-rng device: the guest's ``/dev/hwrng``, and a source its kernel mixes into its
    random pool, so guests restored from one snapshot do not stay on the saved pool alone."""

    source: str = "/dev/urandom"
    bytes_per_period: int = 1 << 20  # rate limit, per ``period_ms``
    period_ms: int = 1000


@dataclass(frozen=True)
class ConsoleLog:
    path: str


@dataclass(frozen=True)
class Domain:
    name: str
    uuid: str
    type: DomainType
    memory_kib: int
    vcpus: int
    cputune: CpuTune | None
    memory_backing: HugepageBacking | None
    boot: KernelBoot
    cpu_mode: Literal["host-passthrough", "qemu64"]
    identity: SandboxIdentity
    shape_json: str
    channel: AgentChannel
    console: ConsoleLog | None
    # CPU features required on top of the custom model (TCG): pdpe1gb when the guest reserves 1 GiB pages
    cpu_features: tuple[str, ...] = ()
    # TCG only: cap on QEMU's translation-block cache (its largest memory cost under emulation)
    tcg_tb_cache_mib: int | None = None
    # guest NUMA cells, when the guest's memory spans host nodes (one cell per node, in order)
    numa_cells: tuple[NumaCell, ...] = ()
    # PCI functions passed through with VFIO (<hostdev managed='yes'>), whole IOMMU groups
    hostdevs: tuple[str, ...] = ()
    # directories shared into the guest (containers' root file systems, logs, mounts)
    shared_dirs: tuple[SharedDir, ...] = ()
    # the pod's NIC (none: no network device at all)
    interfaces: tuple[NetworkInterface, ...] = ()
    # a virtio-rng device fed from the host's /dev/urandom (the guest's /dev/hwrng)
    rng: RngDevice | None = None
    # empty PCIe root ports (q35) for the images' disks hot-plugged while the guest runs
    hotplug_ports: int = 0
    # the host uid and gid (same number) QEMU runs as; 0: host root (a sandbox of an earlier version)
    qemu_uid: int = 0
    # resize headroom: the vCPUs the guest's kernel brings online at boot (its ``maxcpus=``; 0: all
    # of ``vcpus``; the others are present, each with its QEMU thread, and offline until a resize
    # onlines them through the agent), and the most RAM memory DIMMs may bring the guest to in
    # ``memory_slots`` slots (0: no memory hot-plug)
    boot_vcpus: int = 0
    max_memory_kib: int = 0
    memory_slots: int = 0


def domain_name(sandbox_id: str) -> str:
    """Domain names are derived from ids we generate, never from pod names."""
    return f"{DOMAIN_PREFIX}{sandbox_id[:32]}"


def claimed_interface(nic: ClaimedNic) -> NetworkInterface:
    """A claimed network's NIC as libvirt makes it: a tap on a bridge, a macvtap on a host interface."""
    if nic.kind == "bridge":
        return NetworkInterface("bridge", nic.mac, source=nic.host_interface)
    return NetworkInterface("direct", nic.mac, source=nic.host_interface, mode=nic.mode)


def guest_cmdline(shape: VmShape, extra: str, network: tuple[str, ...] = ()) -> str:
    """Kernel command line: serial console, the vCPUs to bring up (``maxcpus=``, with vCPU
    headroom), the containers' hugepages, the pod's network and hostname
    (``vmsandbox.network.guest_network_args``), then the profile's extra."""
    # cryptomgr.notests: skip the crypto self-tests, a third of a TCG boot (measured: 1.8 s vs 2.1 s)
    parts = ["console=ttyS0", "panic=-1", "quiet", "cryptomgr.notests"]
    if shape.headroom_vcpus:  # the headroom's vCPUs are present but stay offline until a resize
        parts.append(f"maxcpus={shape.vcpus}")
    if shape.headroom_memory_bytes:  # hot-plugged memory blocks come online as they arrive
        parts.append("memhp_default_state=online")
    for size, count in shape.guest_hugepages:
        parts.append(f"hugepagesz={size // (1024 * 1024)}M" if size < 1 << 30 else f"hugepagesz={size >> 30}G")
        parts.append(f"hugepages={count}")
    parts.extend(network)
    if extra.strip():
        parts.append(extra.strip())
    return " ".join(parts)


def build_domain(
    *,
    identity: SandboxIdentity,
    uuid: str,
    shape: VmShape,
    host_cpus: tuple[int, ...],
    emulator_cpus: tuple[int, ...],
    hugepage_nodes: tuple[int, ...],
    accel: Literal["kvm", "tcg"],
    kernel: str,
    initrd: str,
    machine: str,
    extra_cmdline: str,
    shape_json: str,
    console_log: str | None,
    tcg_tb_cache_mib: int | None = None,
    numa_cells: tuple[GuestCell, ...] = (),
    hostdevs: tuple[str, ...] = (),
    shared_dirs: tuple[SharedDir, ...] = (),
    interfaces: tuple[NetworkInterface, ...] = (),
    guest_nic: GuestNic | None = None,
    claimed_nics: tuple[ClaimedNic, ...] = (),
    hostname: str = "",
    hotplug_ports: int = 0,
    qemu_uid: int = 0,
) -> Domain:
    """Assemble the domain. With pinning, vCPU i runs on ``host_cpus[i]``; shared pods float. The
    claimed NICs follow ``interfaces`` (the pod network's NIC), in their order."""
    pins: tuple[tuple[int, tuple[int, ...]], ...]
    # the headroom's vCPUs are present and pinned from the start (a QEMU thread each), offline in
    # the guest (``maxcpus=``) until a resize onlines them
    vcpus = shape.reserved_vcpus
    if shape.cpu_policy == "exclusive":
        if len(host_cpus) != vcpus:
            raise InternalError(f"{vcpus} vCPUs need {vcpus} host CPUs, got {len(host_cpus)}")
        pins = tuple((i, (cpu,)) for i, cpu in enumerate(host_cpus))
    else:
        pins = tuple((i, tuple(sorted(host_cpus))) for i in range(vcpus))
    cputune = CpuTune(vcpupins=pins, emulatorpin=tuple(sorted(emulator_cpus or host_cpus))) if host_cpus else None
    if numa_cells:
        cell_pages = sum(c.pages for c in numa_cells)
        if cell_pages != shape.backing_pages:
            raise InternalError(f"NUMA cells hold {cell_pages} pages, the guest has {shape.backing_pages}")
        if sorted(v for c in numa_cells for v in c.vcpus) != list(range(vcpus)):
            raise InternalError(f"NUMA cells must hold each of the {vcpus} vCPUs once")
    cells = tuple(
        NumaCell(vcpus=c.vcpus, memory_kib=c.pages * shape.backing_page_size // 1024, host_node=c.host_node)
        for c in numa_cells
    )
    if shape.headroom_memory_bytes and not cells:
        # libvirt plugs memory DIMMs only into a guest with NUMA cells: one, holding it all
        node = hugepage_nodes[0] if len(hugepage_nodes) == 1 else 0
        cells = (NumaCell(vcpus=tuple(range(vcpus)), memory_kib=shape.memory_bytes // 1024, host_node=node),)
    backing = (
        HugepageBacking(page_size_kib=shape.backing_page_size // 1024, host_nodes=hugepage_nodes)
        if shape.hugepage_backed
        else None
    )
    return Domain(
        name=domain_name(identity.sandbox_id),
        uuid=uuid,
        type="kvm" if accel == "kvm" else "qemu",
        memory_kib=shape.memory_bytes // 1024,
        vcpus=vcpus,
        cputune=cputune,
        memory_backing=backing,
        boot=KernelBoot(
            kernel=kernel,
            initrd=initrd,
            cmdline=guest_cmdline(
                shape, extra_cmdline, guest_network_args(guest_nic, hostname) + claimed_nic_args(claimed_nics)
            ),
            machine=machine,
        ),
        cpu_mode="host-passthrough" if accel == "kvm" else "qemu64",
        identity=identity,
        shape_json=shape_json,
        channel=AgentChannel(),
        console=ConsoleLog(console_log) if console_log else None,
        tcg_tb_cache_mib=tcg_tb_cache_mib if accel == "tcg" else None,
        cpu_features=("pdpe1gb",) if accel != "kvm" and any(s >= 1 << 30 for s, _ in shape.guest_hugepages) else (),
        numa_cells=cells,
        hostdevs=tuple(hostdevs),
        shared_dirs=tuple(shared_dirs),
        interfaces=tuple(interfaces) + tuple(claimed_interface(n) for n in claimed_nics),
        rng=RngDevice(),
        hotplug_ports=hotplug_ports if "q35" in machine else 0,
        qemu_uid=qemu_uid,
        boot_vcpus=shape.vcpus if shape.headroom_vcpus else 0,
        max_memory_kib=shape.reserved_memory_bytes // 1024 if shape.headroom_memory_bytes else 0,
        memory_slots=shape.headroom_memory_bytes // hotplug_block(shape.backing_page_size),
    )


def hotplug_block(page_size: int) -> int:
    """The unit of memory hot-plug: the guest kernel's memory block, or the backing page if larger."""
    return max(HOTPLUG_BLOCK, page_size)
