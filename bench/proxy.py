"""What the CRI proxy adds to a call for the downstream runtime, side by side with calling it directly.

A containerd of its own (``scripts/containerd.sh``, Debian's containerd and runc) holds N ordinary
pods (host-network, so no CNI is involved; the sandbox image comes from a local registry) with one
created container each; a vmsandbox shim process (``python -m shim serve``) has it as its
``downstream_endpoint``. Each RPC is called alternately through the shim's socket and straight on
containerd's, one call each in turn, so both see the same noise: ``Version`` (answered by vmsandbox
itself), ``ContainerStatus`` (routed by id and forwarded as bytes), ``ListPodSandbox`` and
``ListContainers`` (forwarded and merged with vmsandbox's own, empty, lists).

Targets with 100 pods: added latency p50 <= 0.3 ms and <= 1.2x direct for each.

    .venv/bin/python bench/proxy.py            # 100 pods, 300 calls per RPC and path
    .venv/bin/python bench/proxy.py --smoke    # 10 pods, 30 calls; checks the JSON
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import smoke
from shim.cri.runtime.v1 import api_pb2 as pb
from shim.cri.runtime.v1 import api_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[1]
RPCS = ("Version", "ContainerStatus", "ListPodSandbox", "ListContainers")
TARGET_ADDED_MS = 0.3
TARGET_RATIO = 1.2


def _registry_with_pause(work: Path) -> tuple[Any, str]:
    from tests.registry_kit import Layout, Registry, busybox_entries, push

    registry = Registry(work / "registry").start()
    layout = Layout(work / "layout")
    layout.tag("pause", layout.image([layout.layer(busybox_entries(("sleep",)))], cmd=("/bin/sleep", "2147483647")))
    push(layout, "pause", f"{registry.host}/bench/pause:1")
    return registry, f"{registry.host}/bench/pause:1"


def _shim(work: Path, endpoint: str) -> subprocess.Popen[bytes]:
    config = {
        "socket_path": str(work / "cri.sock"),
        "state_dir": str(work / "state"),
        "console_dir": str(work / "console"),
        "libvirt_uri": os.environ.get("VMSANDBOX_LIBVIRT_URI", "qemu:///system"),
        "pod_network": "none",
        "reconcile_interval_s": 0,
        "downstream_endpoint": endpoint,
    }
    (work / "config.yaml").write_text(yaml.safe_dump(config))
    process = subprocess.Popen(
        [sys.executable, "-m", "shim", "serve", "--config", str(work / "config.yaml")],
        cwd=REPO,
        stdout=(work / "shim.log").open("wb"),
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 60
    while not (work / "cri.sock").exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise SystemExit(f"the shim did not start:\n{(work / 'shim.log').read_text()[-2000:]}")
        time.sleep(0.05)
    return process


def _seed(rt: pb_grpc.RuntimeServiceStub, pods: int, image: str, logs: Path) -> list[str]:
    """``pods`` host-network sandboxes with one created container each, made on containerd directly."""
    ids = []
    for n in range(pods):
        config = pb.PodSandboxConfig(
            metadata=pb.PodSandboxMetadata(name=f"bench-{n}", namespace="bench", uid=str(uuid.uuid4())),
            log_directory=str(logs / f"bench-{n}"),
            linux=pb.LinuxPodSandboxConfig(
                security_context=pb.LinuxSandboxSecurityContext(namespace_options=pb.NamespaceOption(network=pb.NODE))
            ),
        )
        sid = rt.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=120).pod_sandbox_id
        cid = rt.CreateContainer(
            pb.CreateContainerRequest(
                pod_sandbox_id=sid,
                config=pb.ContainerConfig(
                    metadata=pb.ContainerMetadata(name="app"), image=pb.ImageSpec(image=image), log_path="app.log"
                ),
                sandbox_config=config,
            ),
            timeout=120,
        ).container_id
        ids.append(cid)
    return ids


def _p50_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 4)


def measure(pods: int, calls: int) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="vmsandbox-bench-proxy-"))
    work.chmod(0o711)  # passable: the shim refuses a state directory its QEMUs' uids cannot reach
    ctd_dir = work / "containerd"
    script = REPO / "scripts" / "containerd.sh"
    registry = None
    shim = None
    try:
        registry, pause = _registry_with_pause(work)
        subprocess.run(
            ["bash", str(script), "up", str(ctd_dir), pause, str(work / "net.d"), registry.host],
            check=True,
            capture_output=True,
            timeout=60,
        )
        endpoint = f"unix://{ctd_dir / 'containerd.sock'}"
        with grpc.insecure_channel(endpoint) as direct_channel:
            direct = pb_grpc.RuntimeServiceStub(direct_channel)
            direct_images = pb_grpc.ImageServiceStub(direct_channel)
            direct_images.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image=pause)), timeout=120)
            t0 = time.perf_counter()
            ids = _seed(direct, pods, pause, work / "logs")
            seed_s = time.perf_counter() - t0
            (work / "shim").mkdir()
            shim = _shim(work / "shim", endpoint)
            with grpc.insecure_channel(f"unix:{work / 'shim' / 'cri.sock'}") as proxy_channel:
                proxy = pb_grpc.RuntimeServiceStub(proxy_channel)
                assert len(proxy.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items) == pods
                assert len(proxy.ListContainers(pb.ListContainersRequest(), timeout=30).containers) == pods
                results: dict[str, Any] = {}
                for rpc in RPCS:
                    request: Callable[[int], Any] = {
                        "Version": lambda i: pb.VersionRequest(),
                        "ContainerStatus": lambda i: pb.ContainerStatusRequest(container_id=ids[i % len(ids)]),
                        "ListPodSandbox": lambda i: pb.ListPodSandboxRequest(),
                        "ListContainers": lambda i: pb.ListContainersRequest(),
                    }[rpc]
                    via, straight = getattr(proxy, rpc), getattr(direct, rpc)
                    for i in range(5):  # warm both paths (connections, caches)
                        via(request(i), timeout=30)
                        straight(request(i), timeout=30)
                    through: list[float] = []
                    alone: list[float] = []
                    for i in range(calls):
                        req = request(i)
                        order = ((via, through), (straight, alone))
                        for fn, out in order if i % 2 else order[::-1]:
                            t = time.perf_counter()
                            fn(req, timeout=30)
                            out.append(time.perf_counter() - t)
                    p, d = _p50_ms(through), _p50_ms(alone)
                    results[rpc] = {
                        "proxy_p50_ms": p,
                        "direct_p50_ms": d,
                        "added_p50_ms": round(p - d, 4),
                        "ratio": round(p / d, 3),
                    }
            for sid in [s.id for s in direct.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items]:
                direct.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=60)
                direct.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=60)
        return {"pods": pods, "calls": calls, "seed_s": round(seed_s, 2), "rpcs": results}
    finally:
        if shim is not None:
            shim.terminate()
            shim.wait(timeout=30)
        subprocess.run(["bash", str(script), "down", str(ctd_dir)], capture_output=True, timeout=60)
        if registry is not None:
            registry.stop()
        shutil.rmtree(work, ignore_errors=True)


RPC_SHAPE = {
    "proxy_p50_ms": smoke.POSITIVE,
    "direct_p50_ms": smoke.POSITIVE,
    "added_p50_ms": smoke.FINITE,
    "ratio": smoke.POSITIVE,
}
SHAPE: dict[str, Any] = {
    "benchmark": "proxy",
    "pods": smoke.COUNT,
    "calls": smoke.COUNT,
    "seed_s": smoke.POSITIVE,
    "rpcs": {rpc: RPC_SHAPE for rpc in RPCS},
    **{f"ratio_{rpc}": smoke.POSITIVE for rpc in RPCS},
    **{f"added_p50_ms_{rpc}": smoke.FINITE for rpc in RPCS},
    "meets_targets": smoke.BOOL,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=100, help="ordinary pods on containerd")
    parser.add_argument("--calls", type=int, default=300, help="calls per RPC and path")
    parser.add_argument("--smoke", action="store_true", help="10 pods, 30 calls; check the JSON")
    args = parser.parse_args()
    smoke.require(
        smoke.missing_tools("containerd", "runc", "containerd-shim-runc-v2"),
        smoke.missing_image_tools(),
        smoke.missing_guest_host(),
    )
    pods, calls = (10, 30) if args.smoke else (args.pods, args.calls)
    result = measure(pods, calls)
    rpcs = result["rpcs"]
    doc: dict[str, Any] = {
        "benchmark": "proxy",
        **result,
        **{f"ratio_{rpc}": rpcs[rpc]["ratio"] for rpc in RPCS},
        **{f"added_p50_ms_{rpc}": rpcs[rpc]["added_p50_ms"] for rpc in RPCS},
        "meets_targets": all(
            r["added_p50_ms"] <= TARGET_ADDED_MS and r["ratio"] <= TARGET_RATIO for r in rpcs.values()
        ),
    }
    smoke.report(doc, SHAPE, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
