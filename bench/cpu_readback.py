"""The part of libvirt's domain start that this project cannot remove: reading the guest CPU back.

After QEMU starts paused (``-S``) and before ``cont``, libvirt 9.0 asks QEMU for the vCPU's
properties (``qom-list`` on the first vCPU's QOM path) and then reads every boolean one of them
(each a CPU feature flag) with one ``qom-get`` QMP command apiece, to record which features the
guest really got. It does so for every x86 domain, whatever its ``<cpu>`` element says. This module
replays exactly that QMP sequence against a bare, paused QEMU of the same guest (the direct boot's
command line plus ``-S`` and a QMP socket), so a benchmark can print the cost beside the start it
belongs to: it is paid inside ``virDomainCreate`` and nowhere in a direct boot.

    .venv/bin/python bench/cpu_readback.py --runs 5
    .venv/bin/python bench/cpu_readback.py --smoke   # one run; checks the JSON
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import smoke
from bench.qemu_direct import DEFAULT_IMAGE_DIR, DirectGuest, percentile, qemu_argv, wait_for_hugepages
from tests import interrupts

VCPU_PATH = "/machine/unattached/device[0]"  # libvirt's QOM path for vCPU 0 without hot-pluggable CPUs


@dataclass(frozen=True)
class CpuReadback:
    seconds: float  # qom-list + every qom-get, as libvirt issues them one after another
    commands: int  # QMP commands in that sequence
    per_command_ms: float


class Qmp:
    """A QMP client on QEMU's unix socket, connected once QEMU listens (events are skipped); also
    ``bench/restore_floor.py``'s."""

    def __init__(self, path: str, deadline: float, proc: subprocess.Popen[bytes], stderr: str | Path) -> None:
        while True:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                self.sock.connect(path)
                break
            except OSError:
                self.sock.close()
                if proc.poll() is not None or time.monotonic() > deadline:
                    why = f"QEMU exited {proc.returncode}" if proc.returncode is not None else "timed out"
                    said = Path(stderr).read_text(errors="replace")[-2000:]
                    raise RuntimeError(
                        f"QEMU's QMP socket {path} never accepted a connection ({why}); QEMU's stderr:\n{said}"
                    ) from None
                time.sleep(0.01)
        self.file = self.sock.makefile("rwb")
        json.loads(self.file.readline())  # the greeting
        self.call("qmp_capabilities")

    def call(self, command: str, **arguments: Any) -> Any:
        msg: dict[str, Any] = {"execute": command}
        if arguments:
            msg["arguments"] = arguments
        self.file.write(json.dumps(msg).encode() + b"\n")
        self.file.flush()
        while True:
            reply = json.loads(self.file.readline())
            if "error" in reply:
                raise RuntimeError(f"QMP {command}: {reply['error']}")
            if "return" in reply:
                return reply["return"]  # anything else is an event

    def close(self) -> None:
        self.file.close()
        self.sock.close()


def measure(guest: DirectGuest, *, timeout_s: float = 30.0) -> CpuReadback:
    """Start ``guest`` paused under bare QEMU and time libvirt's guest-CPU readback against it."""
    with tempfile.TemporaryDirectory(prefix="vmsandbox-readback-") as tmp:
        shares = []
        for i, (_path, tag, readonly) in enumerate(guest.shares):
            path = os.path.join(tmp, f"share{i}")
            os.makedirs(path)
            shares.append((path, tag, readonly))
        qmp_path = os.path.join(tmp, "qmp.sock")
        argv = [*qemu_argv(replace(guest, shares=tuple(shares)), os.path.join(tmp, "agent.sock")), "-S"]
        argv += ["-qmp", f"unix:{qmp_path},server=on,wait=off"]
        cpus = set(guest.host_cpus)
        stderr = os.path.join(tmp, "qemu.stderr")
        wait_for_hugepages(guest)
        with open(stderr, "wb") as err:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
            )
        try:
            qmp = Qmp(qmp_path, time.monotonic() + timeout_s, proc, stderr)
            try:
                start = time.monotonic()
                props = qmp.call("qom-list", path=VCPU_PATH)
                flags = [p["name"] for p in props if p.get("type") == "bool"]
                for name in flags:
                    qmp.call("qom-get", path=VCPU_PATH, property=name)
                seconds = time.monotonic() - start
            finally:
                qmp.close()
        finally:
            proc.kill()
            proc.wait()
    commands = 1 + len(flags)
    return CpuReadback(seconds, commands, seconds / commands * 1000)


SHAPE: dict[str, Any] = {
    "benchmark": "cpu_readback",
    "commands": smoke.COUNT,
    "p50_s": smoke.POSITIVE,
    "samples_s": smoke.Each(smoke.POSITIVE),
    "per_command_ms_p50": smoke.POSITIVE,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--image-dir", default=os.environ.get("VMSANDBOX_IMAGE_DIR", DEFAULT_IMAGE_DIR))
    parser.add_argument("--smoke", action="store_true", help="one run; check the JSON, exit 1 if wrong")
    args = parser.parse_args()
    if args.smoke:
        args.runs = 1
    smoke.require(smoke.missing_tools("qemu-system-x86_64"), smoke.missing_guest_image(args.image_dir))
    guest = DirectGuest.from_image(args.image_dir, vcpus=1, mem_mib=256)
    runs = [measure(guest) for _ in range(max(1, args.runs))]
    seconds = [r.seconds for r in runs]
    doc = {
        "benchmark": "cpu_readback",
        "commands": runs[0].commands,
        "p50_s": round(percentile(seconds, 50), 3),
        "samples_s": [round(s, 3) for s in seconds],
        "per_command_ms_p50": round(percentile([r.per_command_ms for r in runs], 50), 3),
    }
    smoke.report(doc, SHAPE, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(interrupts.run_main(main))
