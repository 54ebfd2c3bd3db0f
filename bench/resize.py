"""In-place resize of a VM pod: an UpdatePodSandboxResources into the profile's resize headroom
(a vCPU onlined by the guest agent, a memory DIMM hot-plugged, until the guest has them online)
against one the VM holds as booted.

    .venv/bin/python bench/resize.py --runs 5
    .venv/bin/python bench/resize.py --smoke   # one run; checks the JSON

Both are the production path (a shim process on a private socket, the same RPC on the same pod),
run pod by pod in this process, their order turned around every other run:

- **fits** (the baseline): the pod's new limits fit the demand its VM was sized for; the shim
  records them (nothing to plug).
- **plug**: the limits need one more vCPU and one 128 MiB memory block; the shim plugs both
  (the agent's ``cpus_online`` of the vCPU present since boot, a hugepage-backed DIMM through
  libvirt) and returns once the guest's report shows
  them online. Its split comes from the shim's log line (``plugged ... in N ms``).

The ratio is what a resize into headroom costs over a resize that needs none. Each run checks the
guest's own view: the vCPUs and MemTotal its report showed when the plug returned (from the same
log line) against what it reported at boot; the JSON carries the last run's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import smoke
from bench.qemu_direct import percentile
from bench.shim_process import shim_process
from gen.cri.runtime.v1 import api_pb2 as pb

IMAGE_DIR = os.environ.get("VMSANDBOX_IMAGE_DIR", "/var/lib/vmsandbox/images/default")
HANDLER = "headroom"
MI = 1 << 20
PLUGGED = re.compile(
    r"sandbox (?P<sid>[0-9a-f]{12}): plugged .* in (?P<ms>\d+) ms \(guest: (?P<vcpus>\d+) vCPUs, "
    r"MemTotal (?P<mem>\d+) KiB\)"
)


def write_profiles(path: Path) -> None:
    doc = {
        "name": HANDLER,
        "handler": HANDLER,
        "snapshots": False,
        "resize_headroom": {"vcpus": 1, "memory": "128Mi"},
        "guest": {"image_dir": IMAGE_DIR},
    }
    path.write_text(json.dumps(doc))


def linux(quota: int, memory_mib: int) -> pb.LinuxContainerResources:
    return pb.LinuxContainerResources(cpu_period=100_000, cpu_quota=quota, memory_limit_in_bytes=memory_mib * MI)


def pod(n: int) -> pb.PodSandboxConfig:
    return pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name=f"resize-{n}", namespace="bench", uid=f"uid-resize-{n}", attempt=0),
        linux=pb.LinuxPodSandboxConfig(resources=linux(50_000, 64)),
    )


def plugged_line(shim_log: Path, sandbox_id: str) -> dict[str, int]:
    for m in PLUGGED.finditer(shim_log.read_text(errors="replace")):
        if m["sid"] == sandbox_id[:12]:
            return {"ms": int(m["ms"]), "vcpus": int(m["vcpus"]), "mem_total_kib": int(m["mem"])}
    raise RuntimeError(f"no 'plugged' line for {sandbox_id[:12]} in {shim_log}")


SHAPE: dict[str, Any] = {
    "benchmark": "resize",
    "runs": smoke.COUNT,
    "update_pod_sandbox_resources_ms": {
        "fits_p50": smoke.POSITIVE,
        "plug_p50": smoke.POSITIVE,
        "ratio_p50": smoke.POSITIVE,
        "samples": smoke.Keyed(smoke.Each(smoke.POSITIVE), frozenset(("fits", "plug"))),
    },
    "plug_in_shim_ms": {"p50": smoke.POSITIVE, "samples": smoke.Each(smoke.POSITIVE)},
    "guest_after_plug": {"vcpus": smoke.COUNT, "mem_total_grew_kib": smoke.POSITIVE},
}


def run(tmp: Path, runs: int) -> dict[str, Any]:
    profiles = tmp / "profiles.yaml"
    write_profiles(profiles)
    samples: dict[str, list[float]] = {"fits": [], "plug": []}
    in_shim: list[float] = []
    guest: dict[str, int] = {}
    with shim_process(tmp, "--profile", str(profiles)) as rt:
        for n in range(runs):
            sid = rt.RunPodSandbox(
                pb.RunPodSandboxRequest(config=pod(n), runtime_handler=HANDLER), timeout=300
            ).pod_sandbox_id
            try:
                status = rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=sid, verbose=True), timeout=30)
                booted_kib = int(json.loads(status.info["info"])["guest"]["mem_total_kib"])

                def update(kind: str, quota: int, memory_mib: int, sid: str = sid) -> None:
                    start = time.perf_counter()
                    rt.UpdatePodSandboxResources(
                        pb.UpdatePodSandboxResourcesRequest(pod_sandbox_id=sid, resources=linux(quota, memory_mib)),
                        timeout=120,
                    )
                    samples[kind].append((time.perf_counter() - start) * 1000)

                order = [("fits", 90_000, 64), ("plug", 200_000, 160)]
                for kind, quota, memory in order if n % 2 == 0 else reversed(order):
                    update(kind, quota, memory)
                line = plugged_line(tmp / "shim.log", sid)
                in_shim.append(line["ms"] or 1)
                guest = {"vcpus": line["vcpus"], "mem_total_grew_kib": line["mem_total_kib"] - booted_kib}
                if line["vcpus"] != 2 or guest["mem_total_grew_kib"] < 128 * 1024 * 63 // 64:
                    raise RuntimeError(f"the guest did not show the plugged headroom: {line}, booted {booted_kib}")
            finally:
                rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=120)
                rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=120)
    fits, plug = percentile(samples["fits"], 50), percentile(samples["plug"], 50)
    return {
        "benchmark": "resize",
        "runs": runs,
        "update_pod_sandbox_resources_ms": {
            "fits_p50": round(fits, 2),
            "plug_p50": round(plug, 2),
            "ratio_p50": round(plug / fits, 1),
            "samples": {k: [round(v, 2) for v in vs] for k, vs in samples.items()},
        },
        "plug_in_shim_ms": {"p50": percentile(in_shim, 50), "samples": in_shim},
        "guest_after_plug": guest,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="one run; check the JSON, exit 1 if it is wrong")
    args = parser.parse_args()
    if args.smoke:
        args.runs = 1
    smoke.require(smoke.missing_guest_host())
    with tempfile.TemporaryDirectory(prefix="vmsandbox-bench-resize-") as tmp:
        result = run(Path(tmp), args.runs)
    smoke.report(result, SHAPE, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
