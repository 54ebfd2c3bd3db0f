"""Render a typed ``Domain`` to libvirt domain XML, and read our metadata back from XML.

Built with ElementTree only: every pod-supplied string (names, namespaces) reaches the XML as
element text or attribute values, escaped by the library, never pasted.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

from vmsandbox.domain import (
    METADATA_NS,
    METADATA_PREFIX,
    VIRTIO_SERIAL_PORTS,
    Domain,
    ImageDiskDevice,
    NetworkInterface,
    SandboxIdentity,
)
from vmsandbox.host import format_cpulist
from vmsandbox.qemu_user import dac_label

ET.register_namespace(METADATA_PREFIX, METADATA_NS)


_cpuset = format_cpulist


def _sub(parent: ET.Element, tag: str, text: str | None = None, **attrs: str) -> ET.Element:
    el = ET.SubElement(parent, tag, attrs)
    if text is not None:
        el.text = text
    return el


def _metadata(parent: ET.Element, domain: Domain) -> None:
    meta = _sub(parent, "metadata")
    ident = domain.identity
    sandbox = _sub(meta, f"{{{METADATA_NS}}}sandbox", id=ident.sandbox_id)
    _sub(sandbox, f"{{{METADATA_NS}}}pod", name=ident.pod_name, namespace=ident.pod_namespace, uid=ident.pod_uid)
    _sub(sandbox, f"{{{METADATA_NS}}}attempt", str(ident.attempt))
    _sub(sandbox, f"{{{METADATA_NS}}}handler", ident.runtime_handler)
    if ident.owner:
        _sub(sandbox, f"{{{METADATA_NS}}}owner", ident.owner)
    if ident.state_dir:
        _sub(sandbox, f"{{{METADATA_NS}}}state", ident.state_dir)
    _sub(sandbox, f"{{{METADATA_NS}}}shape", domain.shape_json)


def _interface(devices: ET.Element, nic: NetworkInterface) -> None:
    """``ethernet``: libvirt opens the existing macvtap (``/dev/tap<ifindex>``) and leaves it alone
    (``managed='no'``), as its owner (the pod network) made it; ``user``: QEMU's user-mode network;
    ``bridge`` and ``direct`` (a claimed network's NIC): a tap on the bridge, a macvtap on the host
    interface, which libvirt makes when the domain starts and removes when it stops."""
    el = _sub(devices, "interface", type=nic.kind)
    _sub(el, "mac", address=nic.mac)
    if nic.kind == "bridge":
        _sub(el, "source", bridge=nic.source)
    elif nic.kind == "direct":
        _sub(el, "source", dev=nic.source, mode=nic.mode)
    if nic.kind == "ethernet" and nic.target_dev:  # no target: a tap libvirt makes (a snapshot's guest)
        _sub(el, "target", dev=nic.target_dev, managed="no")
    _sub(el, "model", type="virtio")
    # no option ROM: the kernel boots directly, and firmware initialising the NIC's iPXE ROM costs
    # most of a second under TCG
    _sub(el, "rom", enabled="no")


def render(domain: Domain) -> str:
    root = ET.Element("domain", type=domain.type)
    _sub(root, "name", domain.name)
    _sub(root, "uuid", domain.uuid)
    _metadata(root, domain)
    if domain.max_memory_kib:
        _sub(root, "maxMemory", str(domain.max_memory_kib), slots=str(domain.memory_slots), unit="KiB")
    _sub(root, "memory", str(domain.memory_kib), unit="KiB")
    _sub(root, "currentMemory", str(domain.memory_kib), unit="KiB")
    if domain.memory_backing is not None:
        backing = _sub(root, "memoryBacking")
        pages = _sub(backing, "hugepages")
        _sub(pages, "page", size=str(domain.memory_backing.page_size_kib), unit="KiB")
    # every vCPU is present from the start, the headroom's too (offline in the guest: ``maxcpus=``)
    _sub(root, "vcpu", str(domain.vcpus), placement="static")
    if domain.cputune is not None:
        tune = _sub(root, "cputune")
        for vcpu, cpus in domain.cputune.vcpupins:
            _sub(tune, "vcpupin", vcpu=str(vcpu), cpuset=_cpuset(cpus))
        _sub(tune, "emulatorpin", cpuset=_cpuset(domain.cputune.emulatorpin))
    if domain.memory_backing is not None and domain.memory_backing.host_nodes:
        numatune = _sub(root, "numatune")
        _sub(numatune, "memory", mode="strict", nodeset=_cpuset(domain.memory_backing.host_nodes))
        for i, cell in enumerate(domain.numa_cells):
            _sub(numatune, "memnode", cellid=str(i), mode="strict", nodeset=str(cell.host_node))
    os_el = _sub(root, "os")
    _sub(os_el, "type", "hvm", arch="x86_64", machine=domain.boot.machine)
    _sub(os_el, "kernel", domain.boot.kernel)
    _sub(os_el, "initrd", domain.boot.initrd)
    _sub(os_el, "cmdline", domain.boot.cmdline)
    features = _sub(root, "features")
    _sub(features, "acpi")
    _sub(features, "apic")
    if domain.type == "qemu" and domain.tcg_tb_cache_mib:
        tcg = _sub(features, "tcg")
        _sub(tcg, "tb-cache", str(domain.tcg_tb_cache_mib), unit="MiB")
    if domain.cpu_mode == "host-passthrough":
        cpu = _sub(root, "cpu", mode="host-passthrough", check="none", migratable="off")
    else:
        cpu = _sub(root, "cpu", mode="custom", match="exact", check="none")
        _sub(cpu, "model", domain.cpu_mode, fallback="forbid")
        for feature in domain.cpu_features:
            _sub(cpu, "feature", policy="require", name=feature)
    if domain.numa_cells:
        numa = _sub(cpu, "numa")
        for i, cell in enumerate(domain.numa_cells):
            attrs = {"id": str(i), "memory": str(cell.memory_kib), "unit": "KiB"}
            if cell.vcpus:
                attrs["cpus"] = _cpuset(cell.vcpus)
            _sub(numa, "cell", **attrs)
    _sub(root, "clock", offset="utc")
    if domain.qemu_uid:
        # QEMU runs as the sandbox's own uid and gid, without capabilities. relabel='no': libvirt
        # changes the owner of no file named in the domain (kernel, initrd, console log, disks) and
        # only of what it makes for this QEMU itself (hugepage directory, channel sockets); the
        # runtime makes what QEMU must reach its own (the sandbox's shared directory).
        label = _sub(root, "seclabel", type="static", model="dac", relabel="no")
        _sub(label, "label", dac_label(domain.qemu_uid))
    elif domain.shared_dirs:
        # a sandbox of an earlier version, whose domain named no uid: its QEMU runs as host root
        label = _sub(root, "seclabel", type="static", model="dac", relabel="no")
        _sub(label, "label", "+0:+0")
    _sub(root, "on_poweroff", "destroy")
    _sub(root, "on_reboot", "destroy")
    _sub(root, "on_crash", "destroy")
    devices = _sub(root, "devices")
    # No USB: libvirt would add a qemu-xhci controller (and a PCIe root port for it on q35) that
    # nothing uses; the guest probes it at boot and QEMU carries its state.
    _sub(devices, "controller", type="usb", model="none")
    _sub(devices, "controller", type="virtio-serial", index="0", ports=str(VIRTIO_SERIAL_PORTS))
    channel = _sub(devices, "channel", type="unix")
    source_attrs = {"mode": "bind"}
    if domain.channel.path:
        source_attrs["path"] = domain.channel.path
    _sub(channel, "source", **source_attrs)
    _sub(channel, "target", type="virtio", name=domain.channel.name)
    if domain.console is not None:
        serial = _sub(devices, "serial", type="file")
        _sub(serial, "source", path=domain.console.path)
        _sub(serial, "target", port="0")
    else:
        serial = _sub(devices, "serial", type="null")
        _sub(serial, "target", port="0")
    for shared in domain.shared_dirs:
        # multidevs='remap': the shared tree may span host file systems; keep guest inode numbers unique
        attrs = {"type": "mount", "accessmode": shared.accessmode, "multidevs": "remap"}
        if shared.accessmode == "mapped":  # what the guest creates is, on the host, QEMU's and no more
            attrs.update(fmode=f"{shared.fmode:04o}", dmode=f"{shared.dmode:04o}")
        fs = _sub(devices, "filesystem", **attrs)
        _sub(fs, "source", dir=shared.source)
        _sub(fs, "target", dir=shared.tag)
        if shared.readonly:
            _sub(fs, "readonly")
    for address in domain.hostdevs:
        hostdev = _sub(devices, "hostdev", mode="subsystem", type="pci", managed="yes")
        pci_domain, bus, slot_fn = address.split(":")
        slot, function = slot_fn.split(".")
        source = _sub(hostdev, "source")
        _sub(source, "address", domain=f"0x{pci_domain}", bus=f"0x{bus}", slot=f"0x{slot}", function=f"0x{function}")
    for nic in domain.interfaces:
        _interface(devices, nic)
    if domain.rng is not None:
        rng = _sub(devices, "rng", model="virtio")
        _sub(rng, "rate", bytes=str(domain.rng.bytes_per_period), period=str(domain.rng.period_ms))
        _sub(rng, "backend", domain.rng.source, model="random")
    if domain.hotplug_ports:  # libvirt numbers the root ports after the root complex, named here first
        _sub(devices, "controller", type="pci", index="0", model="pcie-root")
    for _ in range(domain.hotplug_ports):
        _sub(devices, "controller", type="pci", model="pcie-root-port")
    _sub(devices, "memballoon", model="none")
    ET.indent(root, space="  ")
    return ET.tostring(root, encoding="unicode") + "\n"


def render_image_disk(disk: ImageDiskDevice) -> str:
    """The ``<disk>`` of an image's disk, for libvirt's attach/detach of a running guest: a raw file,
    read-only (QEMU opens it so; the guest sees a read-only device), shareable by every pod that
    uses the image (the host's page cache serves all of them)."""
    el = ET.Element("disk", type="file", device="disk")
    _sub(el, "driver", name="qemu", type="raw")
    _sub(el, "source", file=disk.source)
    _sub(el, "target", dev=disk.target_dev, bus="virtio")
    _sub(el, "serial", disk.serial)
    _sub(el, "readonly")
    _sub(el, "shareable")
    ET.indent(el, space="  ")
    return ET.tostring(el, encoding="unicode") + "\n"


def read_image_disks(xml: str) -> dict[str, ImageDiskDevice]:
    """The virtio disks of a live domain by serial (image disks: the only disks we give a guest)."""
    out = {}
    for disk in ET.fromstring(xml).iterfind("devices/disk"):
        target, source = disk.find("target"), disk.find("source")
        serial = disk.findtext("serial", "")
        if target is None or target.get("bus") != "virtio":
            continue
        out[serial] = ImageDiskDevice(
            source="" if source is None else source.get("file", ""),
            serial=serial,
            target_dev=target.get("dev", ""),
        )
    return out


def read_identity(xml: str) -> SandboxIdentity | None:
    """Our metadata from a domain's XML; None for domains that are not ours."""
    root = ET.fromstring(xml)
    sandbox = root.find(f"metadata/{{{METADATA_NS}}}sandbox")
    if sandbox is None:
        return None
    pod = sandbox.find(f"{{{METADATA_NS}}}pod")
    attempt = sandbox.findtext(f"{{{METADATA_NS}}}attempt", "0")
    return SandboxIdentity(
        sandbox_id=sandbox.get("id", ""),
        pod_name=pod.get("name", "") if pod is not None else "",
        pod_namespace=pod.get("namespace", "") if pod is not None else "",
        pod_uid=pod.get("uid", "") if pod is not None else "",
        attempt=int(attempt) if attempt.isdigit() else 0,
        runtime_handler=sandbox.findtext(f"{{{METADATA_NS}}}handler", ""),
        owner=sandbox.findtext(f"{{{METADATA_NS}}}owner", ""),
        state_dir=sandbox.findtext(f"{{{METADATA_NS}}}state", ""),
    )


def read_shared_dirs(xml: str) -> tuple[str, ...]:
    """The host directories the domain shares into its guest (``<filesystem>`` sources): they are
    under the state directory of the shim that made it."""
    return tuple(s.get("dir", "") for s in ET.fromstring(xml).iterfind("devices/filesystem/source") if s.get("dir"))


def read_channel_path(xml: str, name: str) -> str | None:
    """The host socket path libvirt gave the virtio-serial channel ``name`` (from live XML)."""
    root = ET.fromstring(xml)
    for channel in root.iterfind("devices/channel"):
        target = channel.find("target")
        source = channel.find("source")
        if target is not None and target.get("name") == name and source is not None:
            return source.get("path")
    return None


def read_hostdevs(xml: str) -> tuple[str, ...]:
    """PCI addresses of the domain's ``<hostdev type='pci'>`` sources, as ``0000:3b:00.0``."""
    out = []
    for address in ET.fromstring(xml).iterfind("devices/hostdev[@type='pci']/source/address"):
        parts = [address.get(k, "0").lower().removeprefix("0x") for k in ("domain", "bus", "slot", "function")]
        out.append(f"{int(parts[0], 16):04x}:{int(parts[1], 16):02x}:{int(parts[2], 16):02x}.{int(parts[3], 16)}")
    return tuple(out)


def read_vcpu_pins(xml: str) -> dict[int, str]:
    root = ET.fromstring(xml)
    return {int(p.get("vcpu", "-1")): p.get("cpuset", "") for p in root.iterfind("cputune/vcpupin")}


def memory_dimm(size_kib: int, page_size_kib: int, node: int = 0) -> str:
    """A DIMM of ``size_kib`` for guest NUMA cell ``node``, backed by pages of ``page_size_kib``
    (4: ordinary memory) like the rest of the guest's RAM: hot-plugged by a resize."""
    el = ET.Element("memory", model="dimm")
    if page_size_kib > 4:
        source = _sub(el, "source")
        _sub(source, "pagesize", str(page_size_kib), unit="KiB")
    target = _sub(el, "target")
    _sub(target, "size", str(size_kib), unit="KiB")
    _sub(target, "node", str(node))
    return ET.tostring(el, encoding="unicode")


def read_dimm_kib(xml: str) -> int:
    """KiB in the memory DIMMs of a running guest, from its live XML: the RAM resizes plugged."""
    dimms = 0
    for mem in ET.fromstring(xml).iterfind("devices/memory"):
        if mem.get("model") == "dimm":
            size = mem.find("target/size")
            if size is not None and size.text:
                dimms += int(size.text) * {"KiB": 1, "MiB": 1024, "GiB": 1 << 20}.get(size.get("unit", "KiB"), 1)
    return dimms
