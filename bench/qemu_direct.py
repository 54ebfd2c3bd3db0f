"""Baseline for sandbox start: boot the guest image with a bare ``qemu-system-x86_64`` (no libvirt)
and time process spawn -> the guest agent's hello on the virtio-serial channel.

    python -m bench.qemu_direct --runs 10 --vcpus 2 --mem 256

prints JSON with p50/p95. The QEMU configuration follows what libvirt 9.0 generates for our q35
domain (vmsandbox/domain_xml.py) where it matters for boot time:

- same: machine type, accel, ``-cpu qemu64`` under TCG (``host`` under KVM), ACPI on, no default
  devices, the virtio-serial controller and port ``io.vmsandbox.agent.0`` on a unix socket, a serial
  console on ttyS0 going to a file, no memory balloon, vCPUs/memory, kernel/initrd/cmdline;
- with ``hugepages_dir``: guest RAM from hugetlbfs, preallocated (libvirt's ``<hugepages>``);
- on q35 the virtio-serial controller sits behind a ``pcie-root-port``, as libvirt places PCIe
  devices;
- different: no ``-S`` + QMP ``cont`` handshake, no QMP monitor, no seccomp sandbox, no vCPU/emulator
  pinning, no libvirt-managed cgroups or namespaces. Those are the libvirt overhead the sandbox
  start target (<= 1.10x this baseline) allows for.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from vmsandbox.adapters.guest_channel import wait_for_hello
from vmsandbox.agent_protocol import CHANNEL_NAME, SHARED_TAG

DEFAULT_IMAGE_DIR = "/var/lib/vmsandbox/images/default"
BASE_CMDLINE = "console=ttyS0 panic=-1 quiet cryptomgr.notests"


def qemu_argv(
    image_dir: str | os.PathLike[str],
    socket_path: str,
    *,
    vcpus: int,
    mem_mib: int,
    accel: str = "tcg",
    machine: str = "q35",
    cmdline: str = BASE_CMDLINE,
    console_path: str | None = None,
    hugepages_dir: str | None = None,
    shared_dir: str | None = None,
) -> list[str]:
    """The QEMU command line of one direct boot (see the module docstring); ``shared_dir`` is
    exported over virtio-9p with the tag the guest agent mounts (as libvirt's ``<filesystem
    type='mount' accessmode='passthrough'>`` does)."""
    image = Path(image_dir)
    argv = [
        "qemu-system-x86_64",
        "-name", "vmsandbox-direct",
        "-nodefaults", "-no-user-config", "-display", "none",
        "-machine", f"{machine},acpi=on",
        "-accel", accel,
        "-cpu", "host" if accel == "kvm" else "qemu64",
        "-smp", str(vcpus),
        "-m", f"{mem_mib}M",
        "-kernel", str(image / "vmlinux"),
        "-initrd", str(image / "initramfs.img"),
        "-append", cmdline,
        "-rtc", "base=utc",
        "-no-reboot",
        "-serial", f"file:{console_path}" if console_path else "null",
        "-chardev", f"socket,id=agent,path={socket_path},server=on,wait=off",
    ]  # fmt: skip
    if hugepages_dir:
        argv += [
            "-object", f"memory-backend-file,id=pc.ram,mem-path={hugepages_dir},prealloc=on,size={mem_mib}M",
            "-machine", "memory-backend=pc.ram",
        ]  # fmt: skip
    if machine == "q35":
        argv += ["-device", "pcie-root-port,id=pci.1,bus=pcie.0,chassis=1,port=16,addr=0x1"]
        argv += ["-device", "virtio-serial-pci,id=virtio-serial0,bus=pci.1,addr=0x0"]
    else:
        argv += ["-device", "virtio-serial-pci,id=virtio-serial0"]
    argv += ["-device", f"virtserialport,bus=virtio-serial0.0,nr=1,chardev=agent,name={CHANNEL_NAME}"]
    if shared_dir:
        argv += [
            "-fsdev", f"local,id=fsdev-shared,path={shared_dir},security_model=passthrough,multidevs=remap",
            "-device", f"virtio-9p-pci,id=fs0,fsdev=fsdev-shared,mount_tag={SHARED_TAG}",
        ]  # fmt: skip
    return argv


def boot_direct(
    image_dir: str | os.PathLike[str],
    vcpus: int,
    mem_mib: int,
    accel: str = "tcg",
    machine: str = "q35",
    extra_cmdline: str = "",
    *,
    hugepages_dir: str | None = None,
    timeout_s: float = 60.0,
) -> float:
    """Seconds from spawning QEMU to the guest's hello; QEMU is killed before returning."""
    with tempfile.TemporaryDirectory(prefix="vmsandbox-direct-") as tmp:
        sock = os.path.join(tmp, "agent.sock")
        console = os.path.join(tmp, "console.log")
        cmdline = f"{BASE_CMDLINE} {extra_cmdline}".strip()
        argv = qemu_argv(
            image_dir,
            sock,
            vcpus=vcpus,
            mem_mib=mem_mib,
            accel=accel,
            machine=machine,
            cmdline=cmdline,
            console_path=console,
            hugepages_dir=hugepages_dir,
        )
        with open(os.path.join(tmp, "qemu.stderr"), "w+b") as err:
            start = time.monotonic()
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
            try:
                wait_for_hello(sock, timeout_s)
                return time.monotonic() - start
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


def percentile(samples: Sequence[float], q: int) -> float:
    """The q-th percentile (1 <= q <= 99), interpolated between the closest samples."""
    if len(samples) == 1:
        return samples[0]
    return statistics.quantiles(samples, n=100, method="inclusive")[q - 1]


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
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if shutil.which("qemu-system-x86_64") is None:
        parser.error("qemu-system-x86_64 not found")
    samples = [
        boot_direct(
            args.image_dir,
            args.vcpus,
            args.mem,
            args.accel,
            args.machine,
            args.extra_cmdline,
            hugepages_dir=args.hugepages_dir,
        )
        for _ in range(args.runs)
    ]
    result = {
        "bench": "qemu_direct",
        "accel": args.accel,
        "machine": args.machine,
        "vcpus": args.vcpus,
        "mem_mib": args.mem,
        "cmdline": f"{BASE_CMDLINE} {args.extra_cmdline}".strip(),
        "hugepages_dir": args.hugepages_dir,
        "runs": args.runs,
        "p50_s": round(percentile(samples, 50), 3),
        "p95_s": round(percentile(samples, 95), 3),
        "min_s": round(min(samples), 3),
        "max_s": round(max(samples), 3),
        "samples_s": [round(s, 3) for s in samples],
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
