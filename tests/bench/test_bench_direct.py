"""The sandbox start benchmark's baseline boots what the domain boots: ``DirectGuest.from_domain_xml``
on our rendered XML and on libvirt's live form of it, and the QEMU command line made from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.qemu_direct import DirectGuest, qemu_argv

GOLDEN = Path(__file__).parents[1] / "golden"


def test_from_rendered_domain() -> None:
    guest = DirectGuest.from_domain_xml((GOLDEN / "exclusive-2mi-tcg.xml").read_text(), cgroup_parent="/cg")
    assert guest.kernel == "/var/lib/vmsandbox/images/default/vmlinux"
    assert guest.initrd == "/var/lib/vmsandbox/images/default/initramfs.img"
    assert guest.cmdline == "console=ttyS0 panic=-1 quiet cryptomgr.notests hugepagesz=2M hugepages=8"
    assert (guest.vcpus, guest.mem_mib, guest.accel, guest.machine) == (2, 272, "tcg", "q35")
    assert guest.hugepages_dir == "/dev/hugepages"
    assert guest.host_cpus == (0, 1)
    assert guest.cgroup_parent == "/cg"


@pytest.mark.parametrize(("text", "unit", "mib"), [("32", "MiB", 32), ("32768", "KiB", 32), ("1", "GiB", 1024)])
def test_tb_cache_size_in_any_unit(text: str, unit: str, mib: int) -> None:
    """libvirt's live XML states the cache in KiB whatever the defined XML said."""
    xml = (GOLDEN / "shared-4k-tcg.xml").read_text()
    assert "<tcg>" not in xml
    xml = xml.replace("</features>", f'<tcg><tb-cache unit="{unit}">{text}</tb-cache></tcg></features>')
    guest = DirectGuest.from_domain_xml(xml)
    assert guest.tb_cache_mib == mib
    assert guest.hugepages_dir is None  # 4 KiB pages: no hugetlbfs backing
    argv = qemu_argv(guest, "/tmp/agent.sock")
    assert argv[argv.index("-accel") + 1] == f"tcg,tb-size={mib}"
    assert "memory-backend-file" not in " ".join(argv)


def test_argv_backs_memory_like_libvirt() -> None:
    guest = DirectGuest.from_domain_xml((GOLDEN / "exclusive-2mi-tcg.xml").read_text())
    argv = qemu_argv(guest, "/tmp/agent.sock", console_path="/tmp/console.log")
    joined = " ".join(argv)
    assert "memory-backend-file,id=pc.ram,mem-path=/dev/hugepages,prealloc=on,size=272M" in joined
    assert "q35,acpi=on,usb=off" in joined
    assert argv[argv.index("-append") + 1] == guest.cmdline
    assert argv[argv.index("-smp") + 1] == "2"


def test_the_baseline_exports_the_domains_9p_shares_and_its_image_disks() -> None:
    guest = DirectGuest.from_domain_xml((GOLDEN / "shared-4k-tcg.xml").read_text())
    assert guest.shares == (("/var/lib/vmsandbox/state/sandboxes/fedcba98/shared", "vmsandbox.shared", False),)
    argv = " ".join(qemu_argv(guest, "/tmp/agent.sock", disks=[("/images/disks/ab.erofs", "ab12")]))
    assert "mount_tag=vmsandbox.shared" in argv
    assert "driver=file,filename=/images/disks/ab.erofs,node-name=disk0,read-only=on" in argv
    assert "virtio-blk-pci,drive=disk0,serial=ab12" in argv


def test_the_baseline_shares_with_the_domains_9p_security_model() -> None:
    """A pod's share is libvirt's ``mapped`` one (files 0600, directories 0700 on the host); the
    baseline's guest reads its share through the same model."""
    guest = DirectGuest.from_domain_xml((GOLDEN / "shared-4k-tcg.xml").read_text())
    assert guest.share_model == "mapped"
    argv = " ".join(qemu_argv(guest, "/tmp/agent.sock", shared_dir="/tmp/shared"))
    assert "path=/tmp/shared,security_model=mapped-xattr,fmode=0600,dmode=0700,multidevs=remap" in argv
    plain = " ".join(qemu_argv(DirectGuest("k", "i", "", 1, 256), "/tmp/agent.sock", shared_dir="/tmp/shared"))
    assert "path=/tmp/shared,security_model=passthrough,multidevs=remap" in plain
