"""Sandbox start latency: RunPodSandbox -> READY through the real socket, beside a direct
``qemu-system-x86_64`` boot of the same kernel and initramfs with the same accel, interleaved in
one run (the machines are shared and noisy: only ratios measured together mean anything).

    .venv/bin/python bench/sandbox_start.py --runs 5

prints one JSON document: p50/p95 of both, their ratio (target <= 1.10), and the VMM's resident
memory beyond guest RAM per pod (target <= 64 MiB under TCG).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.qemu_direct import boot_direct, percentile
from bench.shim_process import shim_process
from shim.cri.apimachinery.resource.generated_pb2 import Quantity
from shim.cri.runtime.v1 import api_pb2 as pb

IMAGE_DIR = os.environ.get("VMSANDBOX_IMAGE_DIR", "/var/lib/vmsandbox/images/default")


def pod(cpu: str, memory: str) -> pb.PodSandboxConfig:
    res = pb.KubernetesResources(
        requests={"cpu": Quantity(string=cpu), "memory": Quantity(string=memory)},
        limits={"cpu": Quantity(string=cpu), "memory": Quantity(string=memory)},
    )
    return pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name="bench", namespace="bench", uid=str(uuid.uuid4())),
        pod_resources=pb.PodResourceConfig(
            containers=[pb.ContainerResourceConfig(name="app", kubernetes_resources=res)]
        ),
    )


def vmm_overhead_kib(domain: str, guest_kib: int) -> dict[str, int]:
    """QEMU's resident memory that is not guest RAM (hugetlb pages are not in VmRSS)."""
    pid = int(Path(f"/run/libvirt/qemu/{domain}.pid").read_text())
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "HugetlbPages", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0])
    return {
        "rss_anon_kib": fields["RssAnon"],
        "rss_file_kib": fields["RssFile"],
        "vm_rss_kib": fields["VmRSS"],
        "vm_hwm_kib": fields["VmHWM"],
        "hugetlb_kib": fields.get("HugetlbPages", 0),
        "guest_kib": guest_kib,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--cpu", default="1")
    parser.add_argument("--memory", default="192Mi", help="pod memory; the profile adds 64Mi guest overhead")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="vmsandbox-bench-") as tmp, shim_process(tmp) as rt:
        sandbox_s, direct_s, memory = [], [], []
        shape: dict[str, Any] = {}
        for _ in range(args.runs):
            config = pod(args.cpu, args.memory)
            start = time.monotonic()
            sid = rt.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=300).pod_sandbox_id
            sandbox_s.append(time.monotonic() - start)
            info: dict[str, Any] = json.loads(
                rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=sid, verbose=True), timeout=30).info[
                    "info"
                ]
            )
            shape = info["shape"]
            memory.append(vmm_overhead_kib(info["domain"], int(shape["memory_bytes"]) // 1024))
            rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=120)
            rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=120)
            direct_s.append(
                boot_direct(
                    IMAGE_DIR,
                    int(shape["vcpus"]),
                    int(shape["memory_bytes"]) >> 20,
                    accel=info["accel"],
                    hugepages_dir="/dev/hugepages",
                )
            )
    p50_s, p50_d = percentile(sandbox_s, 50), percentile(direct_s, 50)
    result = {
        "benchmark": "sandbox_start",
        "runs": args.runs,
        "shape": {"vcpus": shape.get("vcpus"), "memory_mib": int(shape.get("memory_bytes", 0)) >> 20},
        "sandbox_s": {
            "p50": round(p50_s, 3),
            "p95": round(percentile(sandbox_s, 95), 3),
            "samples": [round(s, 3) for s in sandbox_s],
        },
        "direct_qemu_s": {
            "p50": round(p50_d, 3),
            "p95": round(percentile(direct_s, 95), 3),
            "samples": [round(s, 3) for s in direct_s],
        },
        "ratio_p50": round(p50_s / p50_d, 3),
        "target_ratio": 1.10,
        "vmm_memory_beyond_guest_mib": {
            "private_max": round(max(m["rss_anon_kib"] for m in memory) / 1024, 1),
            "shared_file_max": round(max(m["rss_file_kib"] for m in memory) / 1024, 1),
            "rss_max": round(max(m["vm_rss_kib"] for m in memory) / 1024, 1),
            "hwm_max": round(max(m["vm_hwm_kib"] for m in memory) / 1024, 1),
            "target": 64,
        },
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
