"""What the CRI proxy adds to a call for the downstream runtime, side by side with calling it directly.

A containerd of its own (``scripts/containerd.sh``, Debian's containerd and runc) holds N ordinary
pods (host-network, so no CNI is involved; the sandbox image comes from a local registry) with one
created container each; a vmsandbox shim process (``python -m shim serve``, the configuration's
defaults but for its paths and ``downstream_endpoint``) has it as its downstream, with its front
(``front/``, the default ``front_binary``) reading the CRI socket as in production. Each RPC is
called in turn on four paths, one call each, the order rotating, so all see the same noise:
``proxy`` (the shim's socket: the front, and the shim where the front asks it), ``python`` (a
second shim with ``front_binary: ''``: the shim alone, as before the front), ``splice`` and
``direct`` (containerd's own socket). The RPCs: ``Version`` (vmsandbox's own answer, kept by the
front), ``ContainerStatus`` (an id the shim has said is the downstream's: the front sends it
straight there), ``ListPodSandbox`` and ``ListContainers`` (both sides at once, concatenated;
vmsandbox's side, empty here, kept by the front while its records do not change).

The splice (``bench/splice``, Go, built here with Debian's go) relays each connection to
containerd byte for byte without reading it: the least any process between the client and the
runtime can add, whatever it is written in. Its added latency (``floor_added_p50_ms``,
``floor_added_p99_ms``) is that floor; the proxy's minus it is what routing costs.

Targets with 100 pods: added latency p50 <= 0.3 ms and <= 1.2x direct for each, judged on the
median over ``--runs`` runs (each run: ``--calls`` calls per RPC and path).

    .venv/bin/python bench/proxy.py            # 100 pods, 3 runs of 300 calls per RPC and path
    .venv/bin/python bench/proxy.py --smoke    # 10 pods, 1 run of 30 calls; checks the JSON
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
from gen.cri.runtime.v1 import api_pb2 as pb
from gen.cri.runtime.v1 import api_pb2_grpc as pb_grpc
from shim.config import DEFAULT_FRONT_BINARY
from tests import interrupts

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


def _splice(work: Path, endpoint: str) -> subprocess.Popen[bytes]:
    """bench/splice, built into ``work`` and relaying ``work/splice.sock`` to ``endpoint``."""
    binary = work / "splice"
    env = {**os.environ, "GO111MODULE": "off", "CGO_ENABLED": "0", "GOFLAGS": ""}
    subprocess.run(
        ["go", "build", "-o", str(binary), "."], cwd=REPO / "bench" / "splice", env=env, check=True, timeout=300
    )
    sock = work / "splice.sock"
    process = subprocess.Popen(
        [str(binary), str(sock), endpoint.removeprefix("unix://")],
        stdout=(work / "splice.log").open("wb"),
        stderr=subprocess.STDOUT,
    )
    _wait_for(sock, process, work / "splice.log")
    return process


def _wait_for(sock: Path, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 60
    while not sock.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise SystemExit(f"{sock.name}: its server did not start:\n{log.read_text()[-2000:]}")
        time.sleep(0.05)


def _shim(work: Path, endpoint: str, **extra: Any) -> subprocess.Popen[bytes]:
    config = {
        "socket_path": str(work / "cri.sock"),
        "state_dir": str(work / "state"),
        "console_dir": str(work / "console"),
        "libvirt_uri": os.environ.get("VMSANDBOX_LIBVIRT_URI", "qemu:///system"),
        "pod_network": "none",
        "downstream_endpoint": endpoint,
        **extra,
    }
    (work / "config.yaml").write_text(yaml.safe_dump(config))
    process = subprocess.Popen(
        [sys.executable, "-m", "shim", "serve", "--config", str(work / "config.yaml")],
        cwd=REPO,
        stdout=(work / "shim.log").open("wb"),
        stderr=subprocess.STDOUT,
    )
    _wait_for(work / "cri.sock", process, work / "shim.log")
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


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 4)


def _p99(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=100, method="inclusive")[98]


PATHS = ("proxy", "python", "splice", "direct")


def one_run(paths: dict[str, Callable[..., Any]], request: Callable[[int], Any], calls: int) -> dict[str, float]:
    """``calls`` calls on each path, one each in turn, the order rotating: p50 and p99 of each, and
    what the proxy (the shim alone, the splice) adds to the direct call."""
    samples: dict[str, list[float]] = {name: [] for name in PATHS}
    for i in range(calls):
        req = request(i)
        for k in range(len(PATHS)):
            name = PATHS[(i + k) % len(PATHS)]
            t = time.perf_counter()
            paths[name](req, timeout=30)
            samples[name].append(time.perf_counter() - t)
    p50 = {name: statistics.median(v) for name, v in samples.items()}
    p99 = {name: _p99(v) for name, v in samples.items()}
    return {
        "proxy_p50_ms": _ms(p50["proxy"]),
        "proxy_p99_ms": _ms(p99["proxy"]),
        "direct_p50_ms": _ms(p50["direct"]),
        "direct_p99_ms": _ms(p99["direct"]),
        "added_p50_ms": _ms(p50["proxy"] - p50["direct"]),
        "added_p99_ms": _ms(p99["proxy"] - p99["direct"]),
        "ratio": round(p50["proxy"] / p50["direct"], 3),
        "python_added_p50_ms": _ms(p50["python"] - p50["direct"]),
        "python_ratio": round(p50["python"] / p50["direct"], 3),
        "floor_added_p50_ms": _ms(p50["splice"] - p50["direct"]),
        "floor_added_p99_ms": _ms(p99["splice"] - p99["direct"]),
        "floor_ratio": round(p50["splice"] / p50["direct"], 3),
    }


def summary(runs: list[dict[str, float]]) -> dict[str, Any]:
    """The median over runs of each figure, and the runs themselves."""
    return {key: round(statistics.median(r[key] for r in runs), 4) for key in runs[0]} | {"runs": runs}


def measure(pods: int, calls: int, runs: int) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="vmsandbox-bench-proxy-"))
    work.chmod(0o711)  # passable: the shim refuses a state directory its QEMUs' uids cannot reach
    ctd_dir = work / "containerd"
    script = REPO / "scripts" / "containerd.sh"
    registry = None
    servers: list[subprocess.Popen[bytes]] = []
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
            (work / "python").mkdir()
            servers.append(_shim(work / "shim", endpoint))
            servers.append(_shim(work / "python", endpoint, front_binary=""))
            servers.append(_splice(work, endpoint))
            with (
                grpc.insecure_channel(f"unix:{work / 'shim' / 'cri.sock'}") as proxy_channel,
                grpc.insecure_channel(f"unix:{work / 'python' / 'cri.sock'}") as python_channel,
                grpc.insecure_channel(f"unix:{work / 'splice.sock'}") as splice_channel,
            ):
                proxy = pb_grpc.RuntimeServiceStub(proxy_channel)
                python = pb_grpc.RuntimeServiceStub(python_channel)
                splice = pb_grpc.RuntimeServiceStub(splice_channel)
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
                    paths = {
                        "proxy": getattr(proxy, rpc),
                        "python": getattr(python, rpc),
                        "splice": getattr(splice, rpc),
                        "direct": getattr(direct, rpc),
                    }
                    for i in range(len(ids) + 5):  # warm every path (connections; the front learns each id)
                        for fn in paths.values():
                            fn(request(i), timeout=30)
                    results[rpc] = summary([one_run(paths, request, calls) for _ in range(runs)])
            for sid in [s.id for s in direct.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items]:
                direct.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=60)
                direct.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=60)
        return {"pods": pods, "calls": calls, "runs": runs, "seed_s": round(seed_s, 2), "rpcs": results}
    finally:
        for server in servers:
            server.terminate()
            server.wait(timeout=30)
        subprocess.run(["bash", str(script), "down", str(ctd_dir)], capture_output=True, timeout=60)
        if registry is not None:
            registry.stop()
        shutil.rmtree(work, ignore_errors=True)


RUN_SHAPE = {
    "proxy_p50_ms": smoke.POSITIVE,
    "proxy_p99_ms": smoke.POSITIVE,
    "direct_p50_ms": smoke.POSITIVE,
    "direct_p99_ms": smoke.POSITIVE,
    "added_p50_ms": smoke.FINITE,
    "added_p99_ms": smoke.FINITE,
    "ratio": smoke.POSITIVE,
    "python_added_p50_ms": smoke.FINITE,
    "python_ratio": smoke.POSITIVE,
    "floor_added_p50_ms": smoke.FINITE,
    "floor_added_p99_ms": smoke.FINITE,
    "floor_ratio": smoke.POSITIVE,
}
SHAPE: dict[str, Any] = {
    "benchmark": "proxy",
    "pods": smoke.COUNT,
    "calls": smoke.COUNT,
    "runs": smoke.COUNT,
    "seed_s": smoke.POSITIVE,
    "rpcs": {rpc: {**RUN_SHAPE, "runs": smoke.Each(RUN_SHAPE)} for rpc in RPCS},
    **{f"ratio_{rpc}": smoke.POSITIVE for rpc in RPCS},
    **{f"added_p50_ms_{rpc}": smoke.FINITE for rpc in RPCS},
    "meets_targets": smoke.BOOL,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=100, help="ordinary pods on containerd")
    parser.add_argument("--calls", type=int, default=300, help="calls per RPC and path in each run")
    parser.add_argument("--runs", type=int, default=3, help="runs (the figures are their medians)")
    parser.add_argument("--smoke", action="store_true", help="10 pods, 1 run of 30 calls; check the JSON")
    args = parser.parse_args()
    smoke.require(
        smoke.missing_tools("containerd", "runc", "containerd-shim-runc-v2", "go"),
        smoke.missing_files(DEFAULT_FRONT_BINARY),
        smoke.missing_image_tools(),
        smoke.missing_guest_host(),
    )
    pods, calls, runs = (10, 30, 1) if args.smoke else (args.pods, args.calls, args.runs)
    result = measure(pods, calls, runs)
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
    sys.exit(interrupts.run_main(main))
