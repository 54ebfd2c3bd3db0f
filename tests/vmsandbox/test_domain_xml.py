"""Tests of vmsandbox.domain and vmsandbox.domain_xml: golden domain XML and reading our metadata back.

The golden files in tests/golden/ are compared byte for byte; ``UPDATE_GOLDEN=1`` rewrites them.
"""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import pytest

from vmsandbox.domain import (
    AGENT_CHANNEL,
    IMAGE_DISK_TARGETS,
    METADATA_NS,
    AgentChannel,
    Domain,
    ImageDiskDevice,
    NetworkInterface,
    SandboxIdentity,
    SharedDir,
    build_domain,
    domain_name,
    free_disk_target,
    guest_cmdline,
)
from vmsandbox.domain_xml import (
    read_channel_path,
    read_dimm_kib,
    read_hostdevs,
    read_identity,
    read_image_disks,
    read_shared_dirs,
    read_vcpu_pins,
    render,
    render_image_disk,
)
from vmsandbox.dra import ClaimedNic
from vmsandbox.errors import InfrastructureError, InternalError, InvalidArgument
from vmsandbox.network import GuestNic, Route, guest_network_args
from vmsandbox.placement import GuestCell
from vmsandbox.profile import Profile
from vmsandbox.record_docs import shape_doc
from vmsandbox.resources import ContainerDeclaration, ContainerResources, PodDeclaration, ResourceList
from vmsandbox.sizing import PodDemand, VmShape, demand_from_declaration, shape_for

GOLDEN = Path(__file__).parents[1] / "golden"
MI, GI = 1024**2, 1024**3


def sized(limits: dict[str, str], profile: Profile) -> VmShape:
    decl = PodDeclaration(
        containers=(ContainerDeclaration("app", ContainerResources(limits=ResourceList.parse(limits, where="app"))),)
    )
    return shape_for(demand_from_declaration(decl, profile), profile)


@dataclass(frozen=True)
class Case:
    identity: SandboxIdentity
    shape: VmShape
    host_cpus: tuple[int, ...]
    hugepage_nodes: tuple[int, ...]
    accel: Literal["kvm", "tcg"]
    extra_cmdline: str
    console_log: str | None
    emulator_cpus: tuple[int, ...] = ()  # default: the vCPUs' CPUs
    numa_cells: tuple[GuestCell, ...] = ()
    hostdevs: tuple[str, ...] = ()
    shared_dirs: tuple[SharedDir, ...] = ()
    interfaces: tuple[NetworkInterface, ...] = ()
    guest_nic: GuestNic | None = None
    claimed_nics: tuple[ClaimedNic, ...] = ()
    hostname: str = ""
    hotplug_ports: int = 0
    qemu_uid: int = 0

    def domain(self) -> Domain:
        return build_domain(
            identity=self.identity,
            uuid="6f1f3f3e-6b0d-4a5e-9c58-0b0f9e1f2a3b",
            shape=self.shape,
            host_cpus=self.host_cpus,
            emulator_cpus=self.emulator_cpus or self.host_cpus,
            hugepage_nodes=self.hugepage_nodes,
            accel=self.accel,
            kernel="/var/lib/vmsandbox/images/default/vmlinux",
            initrd="/var/lib/vmsandbox/images/default/initramfs.img",
            machine="q35",
            extra_cmdline=self.extra_cmdline,
            shape_json=json.dumps(shape_doc(self.shape), sort_keys=True, separators=(",", ":")),
            console_log=self.console_log,
            numa_cells=self.numa_cells,
            hostdevs=self.hostdevs,
            shared_dirs=self.shared_dirs,
            interfaces=self.interfaces,
            guest_nic=self.guest_nic,
            claimed_nics=self.claimed_nics,
            hostname=self.hostname,
            hotplug_ports=self.hotplug_ports,
            qemu_uid=self.qemu_uid,
        )


SID = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
CASES = {
    # (a) exclusive, 2 pinned vCPUs, 2Mi-backed, TCG; the pod name carries every XML-special character
    "exclusive-2mi-tcg": Case(
        identity=SandboxIdentity(SID, "web<&\">'-0", "default", "uid-a", 0, "vmsandbox"),
        shape=sized({"cpu": "1500m", "memory": "192Mi", "hugepages-2Mi": "16Mi"}, Profile(name="p", handler="p")),
        host_cpus=(0, 1),
        hugepage_nodes=(0,),
        accel="tcg",
        extra_cmdline="",
        console_log=None,
    ),
    # (a') the same with resize headroom: 3 pinned vCPUs present, 2 online at boot (maxcpus=2); 2 DIMM
    # slots of 128 MiB; one guest cell
    "exclusive-2mi-headroom": Case(
        identity=SandboxIdentity(SID, "resizable", "default", "uid-h", 0, "vmsandbox"),
        shape=sized(
            {"cpu": "1500m", "memory": "192Mi"},
            Profile(name="h", handler="h", resize_headroom_vcpus=1, resize_headroom_memory_bytes=256 * MI),
        ),
        host_cpus=(0, 1, 2),
        hugepage_nodes=(0,),
        accel="tcg",
        extra_cmdline="",
        console_log=None,
    ),
    # (b) shared CPU pool, ordinary 4 KiB pages; containers' shared directory over 9p, root ports for image disks
    "shared-4k-tcg": Case(
        identity=SandboxIdentity("fedcba98" * 8, "batch", "kube-system", "uid-b", 2, "shared"),
        shape=sized(
            {"cpu": "2", "memory": "256Mi"},
            Profile(name="s", handler="shared", cpu_policy="shared", page_size_bytes=4096),
        ),
        host_cpus=(7, 6, 3, 2),
        hugepage_nodes=(),
        accel="tcg",
        extra_cmdline="",
        console_log="/var/log/vmsandbox/console/fedcba98.log",
        shared_dirs=(
            SharedDir("/var/lib/vmsandbox/state/sandboxes/fedcba98/shared", "vmsandbox.shared", accessmode="mapped"),
        ),
        hotplug_ports=2,
        qemu_uid=2_000_000_007,
    ),
    # (c) KVM with host-passthrough, 1Gi backing from NUMA node 1
    "kvm-1gi-numatune": Case(
        identity=SandboxIdentity("a1" * 32, "db", "prod", "uid-c", 1, "vmsandbox-big"),
        shape=sized({"cpu": "3500m", "memory": "512Mi", "hugepages-1Gi": "1Gi"}, Profile(name="b", handler="b")),
        host_cpus=(16, 48, 17, 49),
        hugepage_nodes=(1,),
        accel="kvm",
        extra_cmdline="  loglevel=4 ",
        console_log="/var/log/vmsandbox/console/a1a1.log",
    ),
    # (d) KVM, a GPU's IOMMU group passed through (two functions), emulator threads on a housekeeping CPU
    "kvm-hostdev-housekeeping": Case(
        identity=SandboxIdentity("b2" * 32, "train", "ml", "uid-d", 0, "vmsandbox-gpu"),
        shape=sized({"cpu": "2", "memory": "448Mi", "nvidia.com/gpu": "1"}, Profile(name="g", handler="g")),
        host_cpus=(2, 6),
        hugepage_nodes=(1,),
        accel="kvm",
        extra_cmdline="",
        console_log=None,
        emulator_cpus=(7,),
        hostdevs=("0000:af:00.0", "0000:af:00.1"),
    ),
    # (e) a VM bigger than a NUMA node (numa_policy restricted): one guest cell per host node
    "tcg-two-node-cells": Case(
        identity=SandboxIdentity("c3" * 32, "big", "batch", "uid-e", 0, "vmsandbox"),
        shape=sized({"cpu": "6", "memory": "704Mi"}, Profile(name="r", handler="r", numa_policy="restricted")),
        host_cpus=(0, 4, 1, 5, 2, 6),
        hugepage_nodes=(0, 1),
        accel="tcg",
        extra_cmdline="",
        console_log=None,
        numa_cells=(GuestCell(0, (0, 1, 2, 3), 256), GuestCell(1, (4, 5), 128)),
    ),
    # (f) a pod on a CNI network: the macvtap on its eth0 handed over unmanaged; addresses and hostname
    # on the command line
    "pod-network-macvtap": Case(
        identity=SandboxIdentity("d4" * 32, "web", "default", "uid-f", 0, "vmsandbox"),
        shape=sized({"cpu": "1", "memory": "128Mi"}, Profile(name="p", handler="p")),
        host_cpus=(3,),
        hugepage_nodes=(0,),
        accel="tcg",
        extra_cmdline="",
        console_log=None,
        interfaces=(NetworkInterface("ethernet", "0a:58:0a:58:00:05", "vmsd4d4d4d4d4d4"),),
        guest_nic=GuestNic(
            "0a:58:0a:58:00:05",
            ("10.88.0.5/16", "fd00:88::5/64"),
            (Route("0.0.0.0/0", "10.88.0.1"), Route("10.96.0.0/12")),
            mtu=1450,
        ),
        hostname="web-0",
    ),
    # (f') the same pod with two DRA-claimed networks after its own NIC: a tap on a bridge, a
    # macvtap on a host interface, both libvirt's; their names and addresses on the command line
    "pod-network-claimed-nics": Case(
        identity=SandboxIdentity("d4" * 32, "web", "default", "uid-f", 0, "vmsandbox"),
        shape=sized({"cpu": "1", "memory": "128Mi"}, Profile(name="p", handler="p")),
        host_cpus=(3,),
        hugepage_nodes=(0,),
        accel="tcg",
        extra_cmdline="",
        console_log=None,
        interfaces=(NetworkInterface("ethernet", "0a:58:0a:58:00:05", "vmsd4d4d4d4d4d4"),),
        guest_nic=GuestNic("0a:58:0a:58:00:05", ("10.88.0.5/16",), (Route("0.0.0.0/0", "10.88.0.1"),)),
        claimed_nics=(
            ClaimedNic(
                "default/web-lan",
                "lan",
                "bridge",
                "br-lan",
                "bridge",
                "02:11:22:33:44:55",
                "net1",
                ("192.168.50.7/24",),
            ),
            ClaimedNic(
                "default/web-fast",
                "fast",
                "macvlan",
                "eth1",
                "vepa",
                "02:66:77:88:99:aa",
                "fast0",
                ("10.9.0.7/16", "fd09::7/64"),
            ),
        ),
        hostname="web-0",
    ),
    # (g) a host-network pod: QEMU's user-mode network
    "host-network-user": Case(
        identity=SandboxIdentity("e5" * 32, "agent", "kube-system", "uid-g", 0, "vmsandbox"),
        shape=sized({"cpu": "1", "memory": "128Mi"}, Profile(name="p", handler="p")),
        host_cpus=(1,),
        hugepage_nodes=(0,),
        accel="tcg",
        extra_cmdline="",
        console_log=None,
        interfaces=(NetworkInterface("user", "52:54:00:12:34:56"),),
        guest_nic=GuestNic("52:54:00:12:34:56", ("10.0.2.15/24",), (Route("0.0.0.0/0", "10.0.2.2"),)),
        hostname="node-1.example",
    ),
}


def test_cases_are_what_they_claim() -> None:
    a, b, c = (CASES[k].shape for k in ("exclusive-2mi-tcg", "shared-4k-tcg", "kvm-1gi-numatune"))
    assert (a.vcpus, a.memory_bytes, a.backing_page_size, a.guest_hugepages) == (2, 272 * MI, 2 * MI, ((2 * MI, 8),))
    assert (b.vcpus, b.memory_bytes, b.backing_page_size, b.cpu_policy) == (2, 320 * MI, 4096, "shared")
    assert (c.vcpus, c.memory_bytes, c.backing_page_size, c.guest_hugepages) == (4, 2 * GI, GI, ((GI, 1),))


@pytest.mark.parametrize("name", sorted(CASES), ids=sorted(CASES))
def test_golden_xml(name: str) -> None:
    case = CASES[name]
    xml = render(case.domain())
    assert render(case.domain()) == xml  # same input, same XML
    path = GOLDEN / f"{name}.xml"
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_text(xml)
    assert path.exists(), f"{path} is missing; run with UPDATE_GOLDEN=1 to create it"
    assert xml == path.read_text(), f"{path} differs; review the change, then UPDATE_GOLDEN=1"


@pytest.mark.parametrize("name", sorted(CASES), ids=sorted(CASES))
def test_metadata_round_trips(name: str) -> None:
    case = CASES[name]
    xml = render(case.domain())
    assert read_identity(xml) == case.identity
    assert read_channel_path(xml, AGENT_CHANNEL) is None  # libvirt picks the path
    shape_text = ET.fromstring(xml).findtext(f"metadata/{{{METADATA_NS}}}sandbox/{{{METADATA_NS}}}shape")
    assert shape_text is not None and json.loads(shape_text) == shape_doc(case.shape)


def test_the_owner_and_state_directory_round_trip_and_the_shared_directories_are_read() -> None:
    case = CASES["shared-4k-tcg"]
    identity = replace(case.identity, owner="ab" * 16, state_dir="/var/lib/vmsandbox/state")
    xml = render(replace(case.domain(), identity=identity))
    assert "<vmsandbox:state>/var/lib/vmsandbox/state</vmsandbox:state>" in xml
    assert read_identity(xml) == identity
    assert read_shared_dirs(xml) == ("/var/lib/vmsandbox/state/sandboxes/fedcba98/shared",)


def test_pod_name_is_escaped_not_pasted() -> None:
    xml = render(CASES["exclusive-2mi-tcg"].domain())
    assert '<vmsandbox:pod name="web&lt;&amp;&quot;&gt;\'-0" namespace="default" uid="uid-a" />' in xml
    assert "web<" not in xml


@pytest.mark.parametrize(
    ("name", "pins"),
    [
        pytest.param("exclusive-2mi-tcg", {0: "0", 1: "1"}, id="exclusive"),
        pytest.param("shared-4k-tcg", {0: "2-3,6-7", 1: "2-3,6-7"}, id="shared-floats"),
        pytest.param("kvm-1gi-numatune", {0: "16", 1: "48", 2: "17", 3: "49"}, id="kvm-siblings"),
    ],
)
def test_read_vcpu_pins(name: str, pins: dict[int, str]) -> None:
    assert read_vcpu_pins(render(CASES[name].domain())) == pins


def test_read_channel_path_from_live_xml() -> None:
    path = "/run/libvirt/qemu/channel/3-vmsandbox-0123/io.vmsandbox.agent.0"
    xml = render(replace(CASES["exclusive-2mi-tcg"].domain(), channel=AgentChannel(path=path)))
    assert '<source mode="bind" path="/run/libvirt/qemu/channel/3-vmsandbox-0123/io.vmsandbox.agent.0" />' in xml
    assert read_channel_path(xml, AGENT_CHANNEL) == path
    assert read_channel_path(xml, "org.qemu.guest_agent.0") is None


@pytest.mark.parametrize(
    "xml",
    [
        pytest.param("<domain type='kvm'><name>other</name></domain>", id="no-metadata"),
        pytest.param(
            "<domain type='kvm'><metadata><x:sandbox xmlns:x='https://example.com/x' id='1'/></metadata></domain>",
            id="foreign-metadata",
        ),
    ],
)
def test_read_identity_of_foreign_domains(xml: str) -> None:
    assert read_identity(xml) is None
    assert read_vcpu_pins(xml) == {}


@pytest.mark.parametrize(
    ("guest_hugepages", "extra", "cmdline"),
    [
        pytest.param((), "", "console=ttyS0 panic=-1 quiet cryptomgr.notests", id="plain"),
        pytest.param(
            ((2 * MI, 8),),
            "  loglevel=4 ",
            "console=ttyS0 panic=-1 quiet cryptomgr.notests hugepagesz=2M hugepages=8 loglevel=4",
            id="2Mi-and-extra",
        ),
        pytest.param(
            ((2 * MI, 2), (GI, 1)),
            " ",
            "console=ttyS0 panic=-1 quiet cryptomgr.notests hugepagesz=2M hugepages=2 hugepagesz=1G hugepages=1",
            id="both-sizes",
        ),
    ],
)
def test_guest_cmdline(guest_hugepages: tuple[tuple[int, int], ...], extra: str, cmdline: str) -> None:
    shape = VmShape(1, 256 * MI, 4096, guest_hugepages, "exclusive", PodDemand(1000, MI))
    assert guest_cmdline(shape, extra) == cmdline


BASE = "console=ttyS0 panic=-1 quiet cryptomgr.notests"


@pytest.mark.parametrize(
    ("headroom_vcpus", "headroom_memory", "cmdline"),
    [
        pytest.param(0, 0, BASE, id="none"),
        # the headroom's vCPUs are present, the kernel brings up the pod's alone
        pytest.param(2, 0, f"{BASE} maxcpus=3", id="vcpus"),
        pytest.param(0, 128 * MI, f"{BASE} memhp_default_state=online", id="ram"),
        pytest.param(1, 128 * MI, f"{BASE} maxcpus=3 memhp_default_state=online", id="both"),
    ],
)
def test_guest_cmdline_with_headroom(headroom_vcpus: int, headroom_memory: int, cmdline: str) -> None:
    shape = VmShape(3, 256 * MI, 4096, (), "exclusive", PodDemand(2500, MI), headroom_vcpus, headroom_memory)
    assert guest_cmdline(shape, "") == cmdline


def test_a_headroom_guest_has_every_vcpu_present_and_boots_the_pods() -> None:
    domain = CASES["exclusive-2mi-headroom"].domain()
    root = ET.fromstring(render(domain))
    vcpu = root.find("vcpu")
    assert vcpu is not None and vcpu.text == "3" and vcpu.get("current") is None  # nothing for libvirt to plug
    assert domain.boot_vcpus == 2
    assert "maxcpus=2" in (root.findtext("os/cmdline") or "").split()
    assert CASES["exclusive-2mi-tcg"].domain().boot_vcpus == 0


@pytest.mark.parametrize(
    ("devices", "kib"),
    [
        ("", 0),
        ("<memory model='dimm'><target><size unit='KiB'>131072</size><node>0</node></target></memory>", 131072),
        (
            "<memory model='dimm'><target><size unit='MiB'>128</size></target></memory>"
            "<memory model='dimm'><target><size unit='GiB'>1</size></target></memory>"
            "<memory model='nvdimm'><target><size unit='KiB'>4</size></target></memory>",
            131072 + (1 << 20),
        ),
    ],
)
def test_read_dimm_kib(devices: str, kib: int) -> None:
    assert read_dimm_kib(f"<domain><vcpu current='1'>2</vcpu><devices>{devices}</devices></domain>") == kib


def test_domain_name_uses_the_id_only() -> None:
    assert domain_name(SID) == "vmsandbox-0123456789abcdef0123456789abcdef"
    assert CASES["exclusive-2mi-tcg"].domain().name == "vmsandbox-0123456789abcdef0123456789abcdef"


def test_exclusive_needs_one_host_cpu_per_vcpu() -> None:
    with pytest.raises(InternalError) as exc:
        replace(CASES["exclusive-2mi-tcg"], host_cpus=(0,)).domain()
    assert str(exc.value) == "2 vCPUs need 2 host CPUs, got 1"


def test_hostdevs_and_cells() -> None:
    gpu = render(CASES["kvm-hostdev-housekeeping"].domain())
    assert read_hostdevs(gpu) == ("0000:af:00.0", "0000:af:00.1")
    assert '<emulatorpin cpuset="7" />' in gpu
    assert read_hostdevs(render(CASES["exclusive-2mi-tcg"].domain())) == ()
    big = CASES["tcg-two-node-cells"]
    assert big.shape.memory_bytes == 768 * MI and big.shape.vcpus == 6
    xml = render(big.domain())
    assert '<memnode cellid="1" mode="strict" nodeset="1" />' in xml
    assert '<cell id="0" memory="524288" unit="KiB" cpus="0-3" />' in xml


@pytest.mark.parametrize(
    ("cells", "message"),
    [
        pytest.param(
            (GuestCell(0, (0, 1, 2, 3), 256), GuestCell(1, (4, 5), 127)),
            "NUMA cells hold 383 pages, the guest has 384",
            id="pages",
        ),
        pytest.param(
            (GuestCell(0, (0, 1, 2), 256), GuestCell(1, (4, 5), 128)),
            "NUMA cells must hold each of the 6 vCPUs once",
            id="vcpus",
        ),
    ],
)
def test_cells_must_match_the_shape(cells: tuple[GuestCell, ...], message: str) -> None:
    with pytest.raises(InternalError) as exc:
        replace(CASES["tcg-two-node-cells"], numa_cells=cells).domain()
    assert str(exc.value) == message


def test_no_host_cpus_means_no_cputune() -> None:
    domain = replace(CASES["shared-4k-tcg"], host_cpus=()).domain()
    assert domain.cputune is None
    assert "<cputune>" not in render(domain)


# -- libvirt's own parser and schema ----------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(CASES), ids=sorted(CASES))
def test_libvirt_accepts_the_xml(name: str) -> None:
    try:
        import libvirt
    except ImportError:
        pytest.skip("libvirt-python is not installed")
    libvirt.registerErrorHandler(lambda _ctx, _err: None, None)
    conn = libvirt.open("test:///default")
    try:
        xml = render(CASES[name].domain())
        dom = conn.defineXMLFlags(xml, libvirt.VIR_DOMAIN_DEFINE_VALIDATE)
        try:
            live = dom.XMLDesc(0)
            assert read_identity(live) == CASES[name].identity
            assert read_vcpu_pins(live) == read_vcpu_pins(xml)
            assert dom.maxMemory() == CASES[name].shape.memory_bytes // 1024
            # the headroom's vCPUs are present (and pinned) from the start, offline in the guest until a resize
            assert dom.vcpusFlags(libvirt.VIR_DOMAIN_VCPU_MAXIMUM) == CASES[name].shape.reserved_vcpus
            assert dom.vcpusFlags(libvirt.VIR_DOMAIN_AFFECT_CONFIG) == CASES[name].shape.reserved_vcpus
            assert read_hostdevs(live) == CASES[name].hostdevs
        finally:
            dom.undefine()
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("nic", "hostname", "args"),
    [
        (None, "", ()),
        (None, "Pod-1.x", ("vmsandbox.hostname=Pod-1.x",)),
        (
            GuestNic("0A:58:0A:58:00:05", ("10.88.0.5/16",), (Route("0.0.0.0/0", "10.88.0.1"),)),
            "",
            ("vmsandbox.nic=0a:58:0a:58:00:05", "vmsandbox.addr=10.88.0.5/16", "vmsandbox.route=0.0.0.0/0,10.88.0.1"),
        ),
        (
            GuestNic("02:00:00:00:00:01", ("fd00::5/64",), (Route("fd00:1::7/48"),), mtu=9000),
            "h",
            (
                "vmsandbox.hostname=h",
                "vmsandbox.nic=02:00:00:00:00:01",
                "vmsandbox.addr=fd00::5/64",
                "vmsandbox.route=fd00:1::/48",
                "vmsandbox.mtu=9000",
            ),
        ),
    ],
)
def test_guest_network_args(nic: GuestNic | None, hostname: str, args: tuple[str, ...]) -> None:
    assert guest_network_args(nic, hostname) == args


@pytest.mark.parametrize(
    ("nic", "hostname", "error"),
    [
        (None, "a b", InvalidArgument),
        (None, "x" * 65, InvalidArgument),
        (None, "-lead", InvalidArgument),
        (None, "a\nvmsandbox.nic=x", InvalidArgument),
        (GuestNic("0a:58:0a:58:00:05 init=/bin/sh", ()), "", InfrastructureError),
        (GuestNic("0a:58:0a:58:00:05", ("10.88.0.5/16 init=/x",)), "", InfrastructureError),
        (GuestNic("0a:58:0a:58:00:05", (), (Route("0.0.0.0/0", "gw"),)), "", InfrastructureError),
        (GuestNic("0a:58:0a:58:00:05", (), mtu=20), "", InfrastructureError),
    ],
)
def test_guest_network_args_refuse_what_could_break_the_command_line(
    nic: GuestNic | None, hostname: str, error: type[Exception]
) -> None:
    with pytest.raises(error):
        guest_network_args(nic, hostname)


# -- image disks (hot-plugged into a running guest) -------------------------------------------------
DISK = ImageDiskDevice(
    source="/var/lib/vmsandbox/images/disks/ab.erofs",
    serial="0123456789abcdef0123",
    target_dev="vdc",
)


def test_image_disk_xml_is_read_only_virtio_with_its_serial() -> None:
    el = ET.fromstring(render_image_disk(DISK))
    assert (el.tag, el.get("type"), el.get("device")) == ("disk", "file", "disk")
    assert el.find("source").attrib == {"file": DISK.source}  # type: ignore[union-attr]
    assert el.find("target").attrib == {"dev": "vdc", "bus": "virtio"}  # type: ignore[union-attr]
    assert el.findtext("serial") == DISK.serial
    assert el.find("readonly") is not None and el.find("shareable") is not None


def test_image_disks_read_back_from_live_xml_by_serial() -> None:
    sata = "<disk type='file'><target dev='sda' bus='sata'/></disk>"
    live = f"<domain><devices>{render_image_disk(DISK)}{sata}</devices></domain>"
    assert read_image_disks(live) == {DISK.serial: DISK}
    assert read_image_disks("<domain><devices/></domain>") == {}


@pytest.mark.parametrize(
    ("used", "want"),
    [
        (set(), "vdb"),
        ({"vdb"}, "vdc"),
        ({"vdb", "vdd"}, "vdc"),
        ({"vda"}, "vdb"),
        (set(IMAGE_DISK_TARGETS), None),
    ],
)
def test_free_disk_target(used: set[str], want: str | None) -> None:
    assert free_disk_target(used) == want


@pytest.mark.parametrize(("machine", "ports"), [("q35", 8), ("pc-q35-7.2", 8), ("pc", 0)])
def test_hotplug_ports_only_on_q35(machine: str, ports: int) -> None:
    case = CASES["shared-4k-tcg"]
    built = build_domain(
        identity=case.identity,
        uuid="6f1f3f3e-6b0d-4a5e-9c58-0b0f9e1f2a3b",
        shape=case.shape,
        host_cpus=case.host_cpus,
        emulator_cpus=case.host_cpus,
        hugepage_nodes=(),
        accel="tcg",
        kernel="k",
        initrd="i",
        machine=machine,
        extra_cmdline="",
        shape_json="{}",
        console_log=None,
        hotplug_ports=8,
    )
    root = ET.fromstring(render(built))
    assert len(root.findall("devices/controller[@model='pcie-root-port']")) == ports


@pytest.mark.parametrize(
    ("accel", "name", "expected"),
    # a guest with vCPU headroom has every vCPU thread from QEMU's start (none registers later and
    # finds the cache's regions taken): the profile's cache, as any other guest
    [("tcg", "exclusive-2mi-headroom", 10), ("tcg", "exclusive-2mi-tcg", 10), ("kvm", "exclusive-2mi-headroom", None)],
)
def test_build_domain_gives_the_tb_cache(accel: Literal["kvm", "tcg"], name: str, expected: int | None) -> None:
    case = replace(CASES[name], accel=accel)
    domain = build_domain(
        identity=case.identity,
        uuid="6f1f3f3e-6b0d-4a5e-9c58-0b0f9e1f2a3b",
        shape=case.shape,
        host_cpus=case.host_cpus,
        emulator_cpus=case.host_cpus,
        hugepage_nodes=case.hugepage_nodes,
        accel=accel,
        kernel="k",
        initrd="i",
        machine="q35",
        extra_cmdline="",
        shape_json="{}",
        console_log=None,
        tcg_tb_cache_mib=10,
    )
    assert domain.tcg_tb_cache_mib == expected
