"""Baseline for sandbox start: boot the guest image with a bare ``qemu-system-x86_64`` (no libvirt)
and time process spawn -> the guest agent's hello on the virtio-serial channel.

    .venv/bin/python bench/qemu_direct.py --runs 10 --vcpus 2 --mem 256
    .venv/bin/python bench/qemu_direct.py --smoke   # one boot; checks the JSON

prints JSON with p50/p95. ``bench/sandbox_start.py`` boots exactly what the shim's live domain
says (``DirectGuest.from_domain_xml``: kernel, initrd, command line, memory and its hugepage
backing, vCPUs and their host CPUs, TCG translation-cache size). The QEMU configuration follows
what libvirt 9.0 generates for our q35 domain (vmsandbox/domain_xml.py) where it matters for boot:

- same: machine type, accel and ``tb-size``, ``-cpu qemu64`` under TCG (``host`` under KVM), ACPI
  on, no default devices, no USB, the virtio-serial controller (2 ports) behind a ``pcie-root-port`` and
  port ``io.vmsandbox.agent.0`` on a unix socket, a serial console on ttyS0 going to a file, no
  memory balloon, vCPUs/memory, kernel/initrd/cmdline; guest RAM from hugetlbfs, preallocated
  (libvirt's ``<hugepages>``); the process confined to the guest's host CPUs; 9p shares with the
  domain's security model (``mapped``: QEMU's ``mapped-xattr``, files 0600, directories 0700);
- different: no ``-S`` + QMP ``cont`` handshake, no QMP monitor, no seccomp sandbox, no per-thread
  vCPU/emulator pinning, no per-domain cgroups (``cgroup_parent`` puts QEMU beside libvirt's
  guests), no mount namespace or security labels, no virtlogd.
  Those are the libvirt overhead the sandbox start target (<= 1.10x this baseline) allows for.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import smoke
from tests import interrupts
from vmsandbox.adapters.guest_channel import wait_for_hello
from vmsandbox.agent_protocol import CHANNEL_NAME, SHARED_TAG
from vmsandbox.host import parse_cpulist

DEFAULT_IMAGE_DIR = "/var/lib/vmsandbox/images/default"
BASE_CMDLINE = "console=ttyS0 panic=-1 quiet cryptomgr.notests"
_UNIT_KIB = {"KiB": 1, "K": 1, "MiB": 1024, "M": 1024, "GiB": 1024 * 1024, "G": 1024 * 1024}


@dataclass(frozen=True)
class DirectGuest:
    """What to boot: the parts of a domain that decide boot time and memory."""

    kernel: str
    initrd: str
    cmdline: str
    vcpus: int
    mem_mib: int
    accel: str = "tcg"
    machine: str = "q35"
    hugepages_dir: str | None = None  # back guest RAM with this hugetlbfs mount, preallocated
    tb_cache_mib: int | None = None  # TCG translation-block cache (QEMU's -accel tcg,tb-size=)
    host_cpus: tuple[int, ...] = ()  # confine QEMU to these host CPUs (empty: anywhere)
    # a cgroup directory (cgroup v1 cpu controller or v2) whose child QEMU runs in: libvirt's
    # machine partition, so the baseline competes for CPU from where libvirt's guests do
    cgroup_parent: str | None = None
    shares: tuple[tuple[str, str, bool], ...] = ()  # virtio-9p exports: (host directory, tag, read-only)
    share_model: str = "passthrough"  # their 9p security model (libvirt's accessmode)

    @classmethod
    def from_image(cls, image_dir: str | os.PathLike[str], *, extra_cmdline: str = "", **kw: Any) -> DirectGuest:
        image = Path(image_dir)
        cmdline = f"{BASE_CMDLINE} {extra_cmdline}".strip()
        return cls(kernel=str(image / "vmlinux"), initrd=str(image / "initramfs.img"), cmdline=cmdline, **kw)

    @classmethod
    def from_domain_xml(
        cls, xml: str, *, hugepages_dir: str = "/dev/hugepages", cgroup_parent: str | None = None
    ) -> DirectGuest:
        """The guest a libvirt domain of ours boots (live XML), to boot it without libvirt."""
        root = ET.fromstring(xml)
        pages = root.find("memoryBacking/hugepages")
        tb_el = root.find("features/tcg/tb-cache")
        tb = None
        if tb_el is not None and tb_el.text:  # libvirt's live XML says KiB whatever the input said
            tb = int(tb_el.text) * _UNIT_KIB[tb_el.get("unit", "KiB")] // 1024
        cpus: set[int] = set()
        for pin in [*root.iterfind("cputune/vcpupin"), *root.iterfind("cputune/emulatorpin")]:
            cpus.update(parse_cpulist(pin.get("cpuset", "")))
        machine = root.find("os/type")
        return cls(
            kernel=root.findtext("os/kernel", ""),
            initrd=root.findtext("os/initrd", ""),
            cmdline=root.findtext("os/cmdline", ""),
            vcpus=int(root.findtext("vcpu", "1")),
            mem_mib=int(root.findtext("memory", "0")) // 1024,
            accel="kvm" if root.get("type") == "kvm" else "tcg",
            machine="pc" if machine is not None and "q35" not in machine.get("machine", "q35") else "q35",
            hugepages_dir=hugepages_dir if pages is not None else None,
            tb_cache_mib=tb,
            host_cpus=tuple(sorted(cpus)),
            cgroup_parent=cgroup_parent,
            shares=tuple(
                (fs.find("source").get("dir", ""), fs.find("target").get("dir", ""), fs.find("readonly") is not None)  # type: ignore[union-attr]
                for fs in root.iterfind("devices/filesystem")
            ),
            share_model=next(
                (fs.get("accessmode", "passthrough") for fs in root.iterfind("devices/filesystem")), "passthrough"
            ),
        )


def qemu_argv(
    guest: DirectGuest,
    socket_path: str,
    *,
    console_path: str | None = None,
    shared_dir: str | None = None,
    disks: Sequence[tuple[str, str]] = (),
) -> list[str]:
    """The QEMU command line of one direct boot (see the module docstring); ``shared_dir`` is
    exported over virtio-9p with the tag the guest agent mounts (as libvirt's ``<filesystem
    type='mount' accessmode='passthrough'>`` does); each of ``disks`` (raw file, serial) is a
    read-only virtio-blk disk, as an image's disk is attached to a pod."""
    accel = guest.accel
    if accel == "tcg" and guest.tb_cache_mib:
        accel += f",tb-size={guest.tb_cache_mib}"
    argv = [
        "qemu-system-x86_64",
        "-name", "vmsandbox-direct",
        "-nodefaults", "-no-user-config", "-display", "none",
        "-machine", f"{guest.machine},acpi=on,usb=off",
        "-accel", accel,
        "-cpu", "host" if guest.accel == "kvm" else "qemu64",
        "-smp", str(guest.vcpus),
        "-m", f"{guest.mem_mib}M",
        "-kernel", guest.kernel,
        "-initrd", guest.initrd,
        "-append", guest.cmdline,
        "-rtc", "base=utc",
        "-no-reboot",
        "-serial", f"file:{console_path}" if console_path else "null",
        "-chardev", f"socket,id=agent,path={socket_path},server=on,wait=off",
    ]  # fmt: skip
    if guest.hugepages_dir:
        size = f"{guest.mem_mib}M"
        argv += [
            "-object", f"memory-backend-file,id=pc.ram,mem-path={guest.hugepages_dir},prealloc=on,size={size}",
            "-machine", "memory-backend=pc.ram",
        ]  # fmt: skip
    if guest.machine == "q35":
        argv += ["-device", "pcie-root-port,id=pci.1,bus=pcie.0,chassis=1,port=16,addr=0x1"]
        argv += ["-device", "virtio-serial-pci,id=virtio-serial0,max_ports=2,bus=pci.1,addr=0x0"]
    else:
        argv += ["-device", "virtio-serial-pci,id=virtio-serial0,max_ports=2"]
    argv += ["-device", f"virtserialport,bus=virtio-serial0.0,nr=1,chardev=agent,name={CHANNEL_NAME}"]
    shares = [*guest.shares, *([(shared_dir, SHARED_TAG, False)] if shared_dir else [])]
    for i, (path, tag, readonly) in enumerate(shares):  # as libvirt's <filesystem accessmode=...>
        ro = ",readonly=on" if readonly else ""
        model = guest.share_model
        if model == "mapped":  # libvirt's mapped share: mapped-xattr, files 0600 and directories 0700
            model = "mapped-xattr,fmode=0600,dmode=0700"
        argv += [
            "-fsdev", f"local,id=fsdev{i},path={path},security_model={model},multidevs=remap{ro}",
            "-device", f"virtio-9p-pci,id=fs{i},fsdev=fsdev{i},mount_tag={tag}",
        ]  # fmt: skip
    for i, (path, serial) in enumerate(disks):
        argv += [
            "-blockdev", f"driver=file,filename={path},node-name=disk{i},read-only=on,auto-read-only=off",
            "-device", f"virtio-blk-pci,drive=disk{i},serial={serial}",
        ]  # fmt: skip
    return argv


@dataclass(frozen=True)
class DirectBoot:
    seconds: float  # QEMU spawned -> hello received
    guest_boot_ms: int  # the guest's uptime at hello (its kernel and init)
    memory_kib: dict[str, int]  # QEMU's VmRSS, RssAnon, RssFile at hello (hugetlb guest RAM is in none)


def wait_for_hugepages(guest: DirectGuest, timeout_s: float = 120.0) -> None:
    """Wait (bounded) until the host has the 2 MiB pages a hugepage-backed ``guest`` preallocates:
    beside a test run other guests hold them for a while, and a QEMU that finds too few exits at
    once. Nothing is reserved: another process may still take them first."""
    if not guest.hugepages_dir:
        return
    need = -(-guest.mem_mib // 2)
    deadline = time.monotonic() + timeout_s
    while True:
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        free = int(meminfo.get("HugePages_Free", "0")) - int(meminfo.get("HugePages_Rsvd", "0"))
        if free >= need or time.monotonic() > deadline:
            return  # past the deadline QEMU says why it cannot start
        time.sleep(0.2)


def boot_direct(guest: DirectGuest, *, timeout_s: float = 60.0) -> DirectBoot:
    """Boot ``guest`` with bare QEMU until its hello; QEMU is killed before returning."""
    with tempfile.TemporaryDirectory(prefix="vmsandbox-direct-") as tmp:
        sock = os.path.join(tmp, "agent.sock")
        console = os.path.join(tmp, "console.log")
        shares = []
        for i, (path, tag, readonly) in enumerate(guest.shares):
            if not os.path.isdir(path):  # a removed sandbox's own directory: an empty one of ours instead
                path = os.path.join(tmp, f"share{i}")
                os.makedirs(os.path.join(path, "containers"))
            shares.append((path, tag, readonly))
        argv = qemu_argv(replace(guest, shares=tuple(shares)), sock, console_path=console)
        wait_for_hugepages(guest)
        with open(os.path.join(tmp, "qemu.stderr"), "w+b") as err, confined(guest) as confine:
            start = time.monotonic()
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, preexec_fn=confine
            )
            try:
                report = wait_for_hello(sock, timeout_s)
                seconds = time.monotonic() - start
                return DirectBoot(seconds, report.boot_ms, qemu_memory_kib(proc.pid))
            except Exception as e:
                err.seek(0)
                qemu_err = err.read().decode(errors="replace")[-2000:]
                tail = Path(console).read_text(errors="replace")[-2000:] if os.path.exists(console) else ""
                raise RuntimeError(
                    f"direct boot failed: {e}\n--- qemu stderr ---\n{qemu_err}\n--- console tail ---\n{tail}"
                ) from e
            finally:
                proc.kill()
                proc.wait()


@contextmanager
def confined(guest: DirectGuest) -> Iterator[Callable[[], None]]:
    """A ``preexec_fn`` that puts a QEMU where the guest says: its host CPUs, and a cgroup of its
    own below ``cgroup_parent``, which goes when the block ends (the QEMU must be gone by then)."""
    cpus = set(guest.host_cpus)
    cgroup = None
    if guest.cgroup_parent:
        cgroup = Path(guest.cgroup_parent) / f"vmsandbox-direct-{os.getpid()}-{next(_CGROUPS)}"
        cgroup.mkdir(exist_ok=True)
    procs = cgroup / ("cgroup.procs" if (cgroup / "cgroup.procs").exists() else "tasks") if cgroup else None

    def confine() -> None:  # in the child, before exec
        if procs is not None:
            procs.write_text(str(os.getpid()))
        if cpus:
            os.sched_setaffinity(0, cpus)

    try:
        yield confine
    finally:
        if cgroup is not None:
            cgroup.rmdir()


_CGROUPS = itertools.count()


def qemu_memory_kib(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon and RssFile of a process, KiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0])
    return out


def percentile(samples: Sequence[float], q: int) -> float:
    """The q-th percentile (1 <= q <= 99), interpolated between the closest samples."""
    if len(samples) == 1:
        return samples[0]
    return statistics.quantiles(samples, n=100, method="inclusive")[q - 1]


SHAPE: dict[str, Any] = {
    "bench": "qemu_direct",
    "accel": smoke.TEXT,
    "machine": smoke.TEXT,
    "vcpus": smoke.COUNT,
    "mem_mib": smoke.COUNT,
    "cmdline": smoke.TEXT,
    "hugepages_dir": smoke.Maybe(smoke.TEXT),
    "runs": smoke.COUNT,
    "p50_s": smoke.POSITIVE,
    "p95_s": smoke.POSITIVE,
    "min_s": smoke.POSITIVE,
    "max_s": smoke.POSITIVE,
    "samples_s": smoke.Each(smoke.POSITIVE),
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--vcpus", type=int, default=1)
    parser.add_argument("--mem", type=int, default=256, help="guest memory, MiB")
    parser.add_argument("--accel", default="tcg", choices=("tcg", "kvm"))
    parser.add_argument("--machine", default="q35", choices=("q35", "pc"))
    parser.add_argument("--image-dir", default=os.environ.get("VMSANDBOX_IMAGE_DIR", DEFAULT_IMAGE_DIR))
    parser.add_argument("--extra-cmdline", default="")
    parser.add_argument("--hugepages-dir", default=None, help="back guest RAM with this hugetlbfs mount")
    parser.add_argument("--tb-cache-mib", type=int, default=None, help="TCG translation-block cache size")
    parser.add_argument("--smoke", action="store_true", help="one boot; check the JSON, exit 1 if wrong")
    args = parser.parse_args(argv)
    if args.smoke:
        args.runs = 1
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    smoke.require(smoke.missing_tools("qemu-system-x86_64"), smoke.missing_guest_image(args.image_dir))
    guest = DirectGuest.from_image(
        args.image_dir,
        extra_cmdline=args.extra_cmdline,
        vcpus=args.vcpus,
        mem_mib=args.mem,
        accel=args.accel,
        machine=args.machine,
        hugepages_dir=args.hugepages_dir,
        tb_cache_mib=args.tb_cache_mib,
    )
    samples = [boot_direct(guest).seconds for _ in range(args.runs)]
    result = {
        "bench": "qemu_direct",
        "accel": args.accel,
        "machine": args.machine,
        "vcpus": args.vcpus,
        "mem_mib": args.mem,
        "cmdline": guest.cmdline,
        "hugepages_dir": args.hugepages_dir,
        "runs": args.runs,
        "p50_s": round(percentile(samples, 50), 3),
        "p95_s": round(percentile(samples, 95), 3),
        "min_s": round(min(samples), 3),
        "max_s": round(max(samples), 3),
        "samples_s": [round(s, 3) for s in samples],
    }
    smoke.report(result, SHAPE, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(interrupts.run_main(main))
