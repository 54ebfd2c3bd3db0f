"""Per-shape guest snapshots, the pure part: what a snapshot's key is made of, which pods may be
restored from one, the domain a snapshot is made in and the one a pod is restored into, the
rewrite of a libvirt save image's header, and the arguments of the agent's ``personalize`` op.

A snapshot is a booted guest with no pod identity (no network configuration, no hostname), saved
by libvirt. Everything that changes the saved state is an input of its key (``SnapshotInputs``),
so a snapshot is found only for a guest that would be the same; a changed input (another guest
image, QEMU or libvirt version, machine type, shape) gives another key and the old snapshot is
simply not used. The store (``vmsandbox.adapters.snapshot_store``) keeps snapshots by key.

libvirt 9.0 restores a save image only into a domain with the name and uuid of the saved one
(its restore refuses a replacement XML that differs in either), and checks the replacement for
ABI stability (vCPUs, memory, machine, every device and its MAC and PCI address). So a pod's
restore uses a copy of the image whose header carries the pod's name and uuid (``retarget``) and
a replacement XML that is the pod's own domain (pinning, hugepage backing, console, shared
directories) with the snapshot's kernel command line and NIC MAC (``restore_domain``); the pod's
MAC, addresses, routes, MTU and hostname are then set in the guest by the agent.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import struct
from dataclasses import asdict, dataclass, replace
from typing import Any

from vmsandbox.domain import Domain, NetworkInterface, SandboxIdentity, SharedDir
from vmsandbox.errors import InfrastructureError
from vmsandbox.network import GuestNic, guest_network_args

FORMAT = 3
"""Version of what a snapshot holds and how it is made; bumped when the recipe changes (2: the
domain's virtio-serial controller has 2 ports, not QEMU's 31; a guest saved with 31 does not
restore into it. 3: the store keeps what the snapshot's agent reported before it was saved, which
a restore's one-round-trip ``personalize`` checks against)."""

SNAPSHOT_DOMAIN_PREFIX = "vmsnapshot-"
"""Prefix of the domains snapshots are made in (not ``DOMAIN_PREFIX``: never taken for a sandbox)."""

PLACEHOLDER_MAC = "52:54:00:00:5a:fe"
"""The MAC of a snapshot guest's NIC. libvirt's ABI check keeps a restored NIC's MAC as saved, so
the agent gives the guest's NIC the pod's MAC after the restore (virtio-net lets a guest set it)."""

SEED_BYTES = 64
"""Host randomness given to each restored guest's random pool."""


@dataclass(frozen=True)
class SnapshotInputs:
    """Everything that makes two saved guests differ; the key is the hash of all of it."""

    vcpus: int
    memory_kib: int
    page_size_kib: int  # 4 for ordinary memory
    guest_hugepages: tuple[tuple[int, int], ...]  # reserved inside the guest (kernel command line)
    nic: str  # the NIC's kind (ethernet: a tap or macvtap; user: QEMU's user network, saved with it), "" for none
    machine: str
    domain_type: str  # kvm or qemu (TCG)
    cpu_mode: str
    cpu_features: tuple[str, ...]
    tcg_tb_cache_mib: int
    cmdline: str  # the guest's kernel command line, without any pod's network or hostname
    shared_dirs: tuple[tuple[str, str, bool], ...]  # (tag, accessmode, readonly): the 9p devices
    image_digest: str  # sha256 of the guest's kernel and initramfs
    qemu_version: str
    libvirt_version: str
    format: int = FORMAT

    def to_doc(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_doc(doc: dict[str, Any]) -> SnapshotInputs:
        args = dict(doc)
        args["guest_hugepages"] = tuple(tuple(p) for p in args["guest_hugepages"])
        args["cpu_features"] = tuple(args["cpu_features"])
        args["shared_dirs"] = tuple(tuple(s) for s in args["shared_dirs"])
        return SnapshotInputs(**args)

    @property
    def key(self) -> str:
        return snapshot_key(self)

    def describe(self) -> str:
        page = "4Ki" if self.page_size_kib == 4 else f"{self.page_size_kib // 1024}Mi"
        return (
            f"{self.vcpus} vCPU, {self.memory_kib >> 10} MiB on {page} pages, "
            f"{self.nic + ' NIC' if self.nic else 'no NIC'}, {self.machine}/{self.domain_type}, "
            f"image {self.image_digest[:12]}, QEMU {self.qemu_version}, libvirt {self.libvirt_version}"
        )


def snapshot_key(inputs: SnapshotInputs) -> str:
    """The content address of a snapshot: sha256 of its inputs' canonical JSON."""
    canonical = json.dumps(inputs.to_doc(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def base_cmdline(domain: Domain, network_args: tuple[str, ...]) -> str:
    """The domain's kernel command line without the pod's network and hostname parameters."""
    drop = set(network_args)
    return " ".join(p for p in domain.boot.cmdline.split(" ") if p not in drop)


def inputs_for(
    domain: Domain, network_args: tuple[str, ...], *, image_digest: str, qemu_version: str, libvirt_version: str
) -> SnapshotInputs:
    """The inputs of the snapshot a pod with ``domain`` would be restored from."""
    return SnapshotInputs(
        vcpus=domain.vcpus,
        memory_kib=domain.memory_kib,
        page_size_kib=domain.memory_backing.page_size_kib if domain.memory_backing else 4,
        guest_hugepages=_guest_hugepages(domain.boot.cmdline),
        nic=domain.interfaces[0].kind if domain.interfaces else "",
        machine=domain.boot.machine,
        domain_type=domain.type,
        cpu_mode=domain.cpu_mode,
        cpu_features=tuple(domain.cpu_features),
        tcg_tb_cache_mib=domain.tcg_tb_cache_mib or 0,
        cmdline=base_cmdline(domain, network_args),
        shared_dirs=tuple((s.tag, s.accessmode, s.readonly) for s in domain.shared_dirs),
        image_digest=image_digest,
        qemu_version=qemu_version,
        libvirt_version=libvirt_version,
    )


def _guest_hugepages(cmdline: str) -> tuple[tuple[int, int], ...]:
    out, size = [], ""
    for part in cmdline.split(" "):
        if part.startswith("hugepagesz="):
            size = part.split("=", 1)[1]
        elif part.startswith("hugepages=") and size:
            unit = 1 << 30 if size.endswith("G") else 1 << 20
            out.append((int(size[:-1]) * unit, int(part.split("=", 1)[1])))
    return tuple(out)


def restore_refusal(domain: Domain, *, enabled: bool) -> str:
    """Why a pod with ``domain`` must cold-boot rather than restore ("" when it may restore)."""
    if not enabled:
        return "the profile turns snapshots off"
    if domain.boot_vcpus or domain.max_memory_kib:
        return "the profile reserves resize headroom (snapshots are made for guests without hot-plug slots)"
    if domain.hostdevs:
        return "devices are passed through (VFIO state cannot be saved)"
    if domain.numa_cells:
        return "the guest spans NUMA nodes (snapshots are made for one-node guests only)"
    if len(domain.interfaces) > 1:
        return "the guest has more than one NIC"
    if any(nic.kind in ("bridge", "direct") for nic in domain.interfaces):
        return "the guest has a claimed network's NIC (its /init configures it at boot)"
    return ""


def snapshot_domain(
    pod_domain: Domain,
    network_args: tuple[str, ...],
    *,
    key: str,
    uuid: str,
    owner: str,
    shared_dirs: tuple[SharedDir, ...],
    console_log: str | None,
) -> Domain:
    """The domain a snapshot of ``pod_domain``'s shape is made in: the pod's devices, memory and
    pinning, no pod identity (kernel command line without network or hostname), a user-mode NIC
    of the pod's kind with the placeholder MAC (an ethernet NIC on a tap libvirt makes, connected to
    nothing), empty shared directories of its own."""
    identity = SandboxIdentity(
        sandbox_id=key,
        pod_name="",
        pod_namespace="",
        pod_uid="",
        attempt=0,
        runtime_handler="",
        owner=owner,
        state_dir=pod_domain.identity.state_dir,
    )
    nics = tuple(NetworkInterface(kind=nic.kind, mac=PLACEHOLDER_MAC) for nic in pod_domain.interfaces)
    return replace(
        pod_domain,
        name=snapshot_domain_name(key),
        uuid=uuid,
        identity=identity,
        boot=replace(pod_domain.boot, cmdline=base_cmdline(pod_domain, network_args)),
        interfaces=nics,
        shared_dirs=tuple(
            replace(mine, source=theirs.source)
            for mine, theirs in zip(pod_domain.shared_dirs, shared_dirs, strict=True)
        ),
        console=replace(pod_domain.console, path=console_log) if pod_domain.console and console_log else None,
    )


def snapshot_domain_name(key: str) -> str:
    return f"{SNAPSHOT_DOMAIN_PREFIX}{key[:32]}"


def restore_domain(pod_domain: Domain, network_args: tuple[str, ...]) -> Domain:
    """The replacement XML's domain for restoring a snapshot as ``pod_domain``: the pod's own
    name, uuid, pinning, hugepage backing, console and shared directories (none of them part of
    the guest's ABI), the snapshot's kernel command line and NIC MAC (both saved in the guest)."""
    return replace(
        pod_domain,
        boot=replace(pod_domain.boot, cmdline=base_cmdline(pod_domain, network_args)),
        interfaces=tuple(replace(nic, mac=PLACEHOLDER_MAC) for nic in pod_domain.interfaces),
    )


# -- libvirt save images ------------------------------------------------------------------------
SAVE_MAGIC = b"LibvirtQemudSave"
SAVE_HEADER_BYTES = 16 + 19 * 4  # magic, then version, data_len, was_running, compressed, cookie offset, 14 unused
_SAVE_XML_MAX = 1 << 20


@dataclass(frozen=True)
class SaveHeader:
    """The head of a libvirt QEMU save image (libvirt's ``virQEMUSaveHeader``) and its data: the
    domain XML and libvirt's cookie, NUL-terminated, padded to ``data_len``; QEMU's migration
    stream follows at ``stream_offset``."""

    fields: tuple[int, ...]  # the 19 little-endian uint32 after the magic
    xml: str
    cookie: bytes  # with its NUL

    @property
    def data_len(self) -> int:
        return self.fields[1]

    @property
    def stream_offset(self) -> int:
        return SAVE_HEADER_BYTES + self.data_len


def parse_save_header(head: bytes) -> SaveHeader:
    """Reads the header of a save image from its first bytes (at least ``SAVE_HEADER_BYTES`` plus
    the data); InfrastructureError for anything that is not an uncompressed version-2 image."""
    if len(head) < SAVE_HEADER_BYTES or head[:16] != SAVE_MAGIC:
        raise InfrastructureError("not a libvirt save image (bad magic)")
    fields = struct.unpack("<19I", head[16:SAVE_HEADER_BYTES])
    version, data_len, _running, compressed, cookie_offset = fields[:5]
    if version != 2 or compressed != 0:
        raise InfrastructureError(f"unsupported libvirt save image (version {version}, compression {compressed})")
    if not 0 < data_len <= _SAVE_XML_MAX or len(head) < SAVE_HEADER_BYTES + data_len:
        raise InfrastructureError(f"libvirt save image is truncated or its header is corrupt (data {data_len} bytes)")
    data = head[SAVE_HEADER_BYTES : SAVE_HEADER_BYTES + data_len]
    end = data.find(b"\0")
    if end <= 0 or not end < cookie_offset < data_len:
        raise InfrastructureError("libvirt save image header is corrupt (XML or cookie out of place)")
    cookie_end = data.find(b"\0", cookie_offset)
    if cookie_end < 0:
        raise InfrastructureError("libvirt save image header is corrupt (cookie not terminated)")
    try:
        xml = data[:end].decode()
    except UnicodeDecodeError:
        raise InfrastructureError("libvirt save image header is corrupt (XML is not UTF-8)") from None
    return SaveHeader(fields=fields, xml=xml, cookie=data[cookie_offset : cookie_end + 1])


def retarget(header: SaveHeader, name: str, uuid: str) -> bytes:
    """The header and data of a copy of the image that restores as domain ``name``/``uuid``: the
    saved XML with only those two changed, the cookie after it, padded to the same length, so the
    migration stream that follows stays where it was."""
    import xml.etree.ElementTree as ET

    try:
        root = ET.fromstring(header.xml)
    except ET.ParseError as exc:
        raise InfrastructureError(f"libvirt save image header is corrupt (its XML: {exc})") from None
    for tag, value in (("name", name), ("uuid", uuid)):
        el = root.find(tag)
        if el is None:
            raise InfrastructureError(f"libvirt save image XML has no <{tag}>")
        el.text = value
    xml = ET.tostring(root, encoding="unicode").encode() + b"\0"
    data = xml + header.cookie
    if len(data) > header.data_len:
        raise InfrastructureError("the pod's name does not fit the save image's header")
    fields = list(header.fields)
    fields[4] = len(xml)
    return SAVE_MAGIC + struct.pack("<19I", *fields) + data + b"\0" * (header.data_len - len(data))


# -- personalize --------------------------------------------------------------------------------
def personalize_args(nic: GuestNic | None, hostname: str, *, seed: bytes, time_ns: int) -> dict[str, Any]:
    """The arguments of the agent's ``personalize`` op, which makes a restored guest this pod's.
    Every network value is checked as for a cold boot's command line (``guest_network_args``)."""
    guest_network_args(nic, hostname)  # raises on anything the guest must not get
    args: dict[str, Any] = {
        "seed": base64.b64encode(seed).decode(),
        "time_ns": time_ns,
        "hostname": hostname,
    }
    if nic is not None:
        args["nic"] = {
            "from_mac": PLACEHOLDER_MAC,
            "mac": nic.mac.lower(),
            "addresses": [ipaddress.ip_interface(a).with_prefixlen for a in nic.addresses],
            "routes": [
                {"dst": ipaddress.ip_network(r.dst, strict=False).with_prefixlen, "gw": r.gw} for r in nic.routes
            ],
            "mtu": nic.mtu,
        }
    return args
