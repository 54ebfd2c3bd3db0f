"""Tests of vmsandbox.snapshot_rules: the snapshot key and what changes it, which pods may restore, the
domains a snapshot is made in and restored into, the save image header rewrite, personalize's
arguments. Pure: no libvirt, no files."""

from __future__ import annotations

import contextlib
import struct
from dataclasses import replace
from typing import cast

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vmsandbox.domain import Domain, NetworkInterface, SandboxIdentity, SharedDir, build_domain
from vmsandbox.dra import ClaimedNic
from vmsandbox.errors import InfrastructureError, InvalidArgument
from vmsandbox.network import GuestNic, Route, guest_network_args
from vmsandbox.placement import GuestCell
from vmsandbox.sizing import PodDemand, VmShape
from vmsandbox.snapshot_rules import (
    FORMAT,
    PLACEHOLDER_MAC,
    SAVE_HEADER_BYTES,
    SAVE_MAGIC,
    SnapshotInputs,
    inputs_for,
    parse_save_header,
    personalize_args,
    restore_domain,
    restore_refusal,
    retarget,
    snapshot_domain,
    snapshot_key,
)

NIC = GuestNic(
    mac="0a:58:0a:58:00:05", addresses=("10.88.0.5/16",), routes=(Route("0.0.0.0/0", "10.88.0.1"),), mtu=1450
)
BASE = SnapshotInputs(
    vcpus=1,
    memory_kib=131072,
    page_size_kib=2048,
    guest_hugepages=(),
    nic="ethernet",
    machine="q35",
    domain_type="qemu",
    cpu_mode="qemu64",
    cpu_features=(),
    tcg_tb_cache_mib=32,
    cmdline="console=ttyS0 panic=-1 quiet cryptomgr.notests",
    shared_dirs=(("vmsandbox.shared", "mapped", False), ("vmsandbox.images", "passthrough", True)),
    image_digest="a" * 64,
    qemu_version="7.2.22",
    libvirt_version="9.0.0",
)


MI = 1 << 20


def _shape(vcpus: int = 1, memory: int = 128 * MI, page: int = 2 * MI) -> VmShape:
    return VmShape(vcpus, memory, page, (), "exclusive", PodDemand(1000, 64 * MI))


def pod_domain(
    sandbox_id: str = "1" * 64,
    *,
    hostname: str = "web-0",
    nic: GuestNic | None = NIC,
    cpus: tuple[int, ...] = (3,),
    shape: VmShape | None = None,
    cells: tuple[GuestCell, ...] = (),
    hostdevs: tuple[str, ...] = (),
    claimed: tuple[ClaimedNic, ...] = (),
) -> Domain:
    return build_domain(
        identity=SandboxIdentity(sandbox_id, "web-0", "default", "uid", 0, "p", owner="o" * 32),
        uuid="6f1f3f3e-6b0d-4a5e-9c58-0b0f9e1f2a3b",
        shape=shape or _shape(),
        host_cpus=cpus,
        emulator_cpus=(),
        hugepage_nodes=(0,),
        accel="tcg",
        kernel="/img/vmlinux",
        initrd="/img/initramfs.img",
        machine="q35",
        extra_cmdline="",
        shape_json="{}",
        console_log=f"/var/log/console/{sandbox_id}.log",
        tcg_tb_cache_mib=32,
        numa_cells=cells,
        hostdevs=hostdevs,
        shared_dirs=(
            SharedDir(f"/state/{sandbox_id}/shared", "vmsandbox.shared", accessmode="mapped"),
            SharedDir(f"/state/{sandbox_id}/images", "vmsandbox.images", readonly=True),
        ),
        interfaces=(NetworkInterface("ethernet", nic.mac, f"vmt{sandbox_id[:12]}"),) if nic else (),
        guest_nic=nic,
        claimed_nics=claimed,
        hostname=hostname,
    )


CLAIMED = ClaimedNic(
    "default/web-lan", "lan", "bridge", "br-lan", "bridge", "02:00:00:00:00:01", "net1", ("10.1.0.2/24",)
)


def inputs(domain: Domain, *, nic: GuestNic | None = NIC, hostname: str = "web-0", **host: str) -> SnapshotInputs:
    versions = {"image_digest": "a" * 64, "qemu_version": "7.2.22", "libvirt_version": "9.0.0", **host}
    return inputs_for(domain, guest_network_args(nic, hostname), **versions)


# -- the key ------------------------------------------------------------------------------------
def test_the_key_is_the_hash_of_the_inputs_and_stable() -> None:
    assert snapshot_key(BASE) == snapshot_key(SnapshotInputs.from_doc(BASE.to_doc()))
    assert len(BASE.key) == 64 and int(BASE.key, 16) >= 0


CHANGES = [
    pytest.param({"vcpus": 2}, id="vcpus"),
    pytest.param({"memory_kib": 262144}, id="guest-ram"),
    pytest.param({"page_size_kib": 4}, id="page-size"),
    pytest.param({"guest_hugepages": ((2 * MI, 8),)}, id="guest-hugepages"),
    pytest.param({"nic": ""}, id="no-nic"),
    pytest.param({"nic": "user"}, id="user-nic"),
    pytest.param({"machine": "pc"}, id="machine"),
    pytest.param({"domain_type": "kvm"}, id="accelerator"),
    pytest.param({"cpu_mode": "host-passthrough"}, id="cpu-model"),
    pytest.param({"cpu_features": ("pdpe1gb",)}, id="cpu-features"),
    pytest.param({"tcg_tb_cache_mib": 64}, id="tcg-cache"),
    pytest.param({"cmdline": "console=ttyS0 quiet"}, id="kernel-cmdline"),
    pytest.param({"shared_dirs": ()}, id="shared-dirs"),
    pytest.param({"image_digest": "b" * 64}, id="guest-image"),
    pytest.param({"qemu_version": "8.0.0"}, id="qemu-version"),
    pytest.param({"libvirt_version": "9.1.0"}, id="libvirt-version"),
    pytest.param({"format": FORMAT + 1}, id="recipe-format"),
]


@pytest.mark.parametrize("change", CHANGES)
def test_any_changed_input_gives_another_key(change: dict[str, object]) -> None:
    """A snapshot made for another image, QEMU, libvirt or shape is never found for this one."""
    assert replace(BASE, **change).key != BASE.key  # type: ignore[arg-type]


def test_every_input_is_in_the_change_table() -> None:
    changed = {key for p in CHANGES for key in cast(dict[str, object], p.values[0])}
    assert changed == set(BASE.to_doc())


def test_what_is_the_pods_own_does_not_change_the_key() -> None:
    """Pinning, the pod's identity, its NIC's MAC and addresses, its hostname, its shared
    directories' host paths: none is saved in the guest, so two pods of a shape share a snapshot."""
    one = inputs(pod_domain("1" * 64, cpus=(3,)))
    other_nic = GuestNic(mac="0a:58:0a:58:00:09", addresses=("10.88.0.9/16",), mtu=1400)
    two = inputs(pod_domain("2" * 64, cpus=(5,), hostname="db-1", nic=other_nic), nic=other_nic, hostname="db-1")
    assert one == two
    assert "web-0" not in one.cmdline and "vmsandbox." not in one.cmdline


def test_the_shape_and_host_change_the_key() -> None:
    base = inputs(pod_domain())
    assert inputs(pod_domain(shape=_shape(memory=256 * MI))).key != base.key
    assert inputs(pod_domain(shape=_shape(page=4096))).key != base.key
    assert inputs(pod_domain(nic=None), nic=None).key != base.key
    assert inputs(pod_domain(), qemu_version="8.2.0").key != base.key
    assert inputs(pod_domain(), image_digest="c" * 64).key != base.key


# -- who may restore ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("domain", "enabled", "refusal"),
    [
        pytest.param(pod_domain(), True, "", id="ordinary-pod"),
        pytest.param(pod_domain(nic=None), True, "", id="no-nic"),
        pytest.param(pod_domain(), False, "the profile turns snapshots off", id="profile-off"),
        pytest.param(pod_domain(hostdevs=("0000:3b:00.0",)), True, "VFIO", id="vfio"),
        pytest.param(pod_domain(claimed=(CLAIMED,)), True, "more than one NIC", id="claimed-nic"),
        pytest.param(pod_domain(nic=None, claimed=(CLAIMED,)), True, "claimed network's NIC", id="claimed-nic-only"),
        pytest.param(
            pod_domain(
                cpus=(3, 4),
                shape=_shape(vcpus=2),
                cells=(GuestCell(0, (0,), 32), GuestCell(1, (1,), 32)),  # 64 pages of 2 MiB
            ),
            True,
            "NUMA",
            id="two-numa-cells",
        ),
    ],
)
def test_restore_refusal(domain: Domain, enabled: bool, refusal: str) -> None:
    got = restore_refusal(domain, enabled=enabled)
    assert (got == "") if refusal == "" else (refusal in got)


# -- the domains --------------------------------------------------------------------------------
def test_snapshot_domain_has_no_pod_identity() -> None:
    pod = pod_domain()
    args = guest_network_args(NIC, "web-0")
    snap = snapshot_domain(
        pod,
        args,
        key="f" * 64,
        uuid="11111111-2222-4333-8444-555555555555",
        owner="o" * 32,
        shared_dirs=(SharedDir("/snap/0", "x"), SharedDir("/snap/1", "y")),
        console_log="/snap/console.log",
    )
    assert snap.name.startswith("vmsnapshot-") and not snap.name.startswith("vmsandbox-")
    assert snap.identity.pod_name == "" and snap.identity.owner == "o" * 32
    assert "vmsandbox." not in snap.boot.cmdline
    assert snap.interfaces == (NetworkInterface("ethernet", PLACEHOLDER_MAC),)  # a tap libvirt makes
    assert [(s.source, s.tag, s.readonly) for s in snap.shared_dirs] == [
        ("/snap/0", "vmsandbox.shared", False),
        ("/snap/1", "vmsandbox.images", True),
    ]
    assert (snap.vcpus, snap.memory_kib, snap.boot.machine, snap.rng) == (pod.vcpus, pod.memory_kib, "q35", pod.rng)


def test_restore_domain_is_the_pods_with_the_snapshots_guest_state() -> None:
    pod = pod_domain()
    restored = restore_domain(pod, guest_network_args(NIC, "web-0"))
    assert (restored.name, restored.uuid, restored.cputune, restored.memory_backing) == (
        pod.name,
        pod.uuid,
        pod.cputune,
        pod.memory_backing,
    )
    assert restored.shared_dirs == pod.shared_dirs and restored.console == pod.console
    assert [(n.kind, n.mac, n.target_dev) for n in restored.interfaces] == [
        ("ethernet", PLACEHOLDER_MAC, pod.interfaces[0].target_dev)
    ]
    assert "vmsandbox." not in restored.boot.cmdline


# -- save image headers -------------------------------------------------------------------------
XML = (
    "<domain type='qemu'>\n  <name>vmsnapshot-abc</name>\n"
    "  <uuid>6f1f3f3e-6b0d-4a5e-9c58-0b0f9e1f2a3b</uuid>\n</domain>\n"
)


def save_image(xml: str = XML, cookie: bytes = b"<qemu-migration/>", pad: int = 4096, stream: bytes = b"QEVM") -> bytes:
    data = xml.encode() + b"\0" + cookie + b"\0"
    data_len = len(data) + pad
    fields = [2, data_len, 1, 0, len(xml.encode()) + 1] + [0] * 14
    return SAVE_MAGIC + struct.pack("<19I", *fields) + data + b"\0" * pad + stream


def test_retarget_changes_name_and_uuid_and_keeps_the_stream_in_place() -> None:
    image = save_image()
    header = parse_save_header(image)
    head = retarget(header, "vmsandbox-" + "1" * 32, "11111111-2222-4333-8444-555555555555")
    assert len(head) == header.stream_offset
    new = parse_save_header(head + image[header.stream_offset :])
    assert "<name>vmsandbox-11111111111111111111111111111111</name>" in new.xml
    assert "<uuid>11111111-2222-4333-8444-555555555555</uuid>" in new.xml
    assert new.cookie == header.cookie and new.stream_offset == header.stream_offset
    assert (head + image[header.stream_offset :])[header.stream_offset :] == b"QEVM"


@pytest.mark.parametrize(
    ("image", "message"),
    [
        pytest.param(b"", "bad magic", id="empty"),
        pytest.param(b"x" * 200, "bad magic", id="not-a-save-image"),
        pytest.param(save_image()[: SAVE_HEADER_BYTES + 10], "truncated", id="truncated-header"),
        pytest.param(SAVE_MAGIC + struct.pack("<19I", 3, 10, 0, 0, 1, *[0] * 14) + b"\0" * 10, "version 3", id="v3"),
        pytest.param(SAVE_MAGIC + struct.pack("<19I", 2, 10, 0, 1, 1, *[0] * 14) + b"\0" * 10, "compression", id="gz"),
        pytest.param(SAVE_MAGIC + struct.pack("<19I", 2, 1 << 30, 0, 0, 1, *[0] * 14), "truncated", id="huge-data-len"),
        pytest.param(
            SAVE_MAGIC + struct.pack("<19I", 2, 16, 0, 0, 99, *[0] * 14) + b"<a/>\0" + b"\0" * 11,
            "out of place",
            id="cookie-outside",
        ),
    ],
)
def test_corrupt_headers_are_refused(image: bytes, message: str) -> None:
    with pytest.raises(InfrastructureError, match=message):
        parse_save_header(image)


@given(st.binary(max_size=400))
def test_any_bytes_parse_or_are_refused(data: bytes) -> None:
    """Whatever the file holds (it is read back from disk), parsing raises only InfrastructureError."""
    for image in (data, SAVE_MAGIC + data, save_image()[:SAVE_HEADER_BYTES] + data):
        with contextlib.suppress(InfrastructureError):
            parse_save_header(image)


@given(st.text(alphabet="abcdef0123456789-", min_size=1, max_size=64))
def test_retarget_preserves_length_for_any_name(name: str) -> None:
    image = save_image()
    header = parse_save_header(image)
    assert len(retarget(header, name, "11111111-2222-4333-8444-555555555555")) == header.stream_offset


# -- personalize --------------------------------------------------------------------------------
def test_personalize_args_carry_the_pods_identity() -> None:
    args = personalize_args(NIC, "web-0", seed=b"s" * 64, time_ns=123)
    assert args["hostname"] == "web-0" and args["time_ns"] == 123 and len(args["seed"]) == 88
    assert args["nic"] == {
        "from_mac": PLACEHOLDER_MAC,
        "mac": "0a:58:0a:58:00:05",
        "addresses": ["10.88.0.5/16"],
        "routes": [{"dst": "0.0.0.0/0", "gw": "10.88.0.1"}],
        "mtu": 1450,
    }
    assert "nic" not in personalize_args(None, "", seed=b"s" * 64, time_ns=1)


@pytest.mark.parametrize(
    ("nic", "hostname", "error"),
    [
        pytest.param(None, "bad host name", InvalidArgument, id="hostname"),
        pytest.param(replace(NIC, mac="zz"), "web-0", InfrastructureError, id="mac"),
        pytest.param(replace(NIC, addresses=("10.0.0.500/8",)), "web-0", InfrastructureError, id="address"),
        pytest.param(replace(NIC, mtu=20), "web-0", InfrastructureError, id="mtu"),
    ],
)
def test_personalize_args_refuse_what_a_cold_boot_refuses(
    nic: GuestNic | None, hostname: str, error: type[Exception]
) -> None:
    with pytest.raises(error):
        personalize_args(nic, hostname, seed=b"s" * 64, time_ns=1)


@pytest.mark.parametrize(
    "xml", [pytest.param("<domain><name>x</name>", id="not-xml"), pytest.param("<domain/>", id="no-name")]
)
def test_retarget_refuses_a_header_whose_xml_is_broken(xml: str) -> None:
    header = parse_save_header(save_image(xml=xml))
    with pytest.raises(InfrastructureError, match="save image"):
        retarget(header, "vmsandbox-x", "11111111-2222-4333-8444-555555555555")
