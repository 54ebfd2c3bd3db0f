"""How the list and status RPCs grow with the number of pods and containers, through the real gRPC
socket, the production servicers and a real ledger (sqlite, WAL).

Hundreds of guests do not fit a test host, so the hypervisor is libvirt's ``test:///default``
driver and the pods are written into the ledger as RunPodSandbox and CreateContainer leave them
(READY sandboxes, three CREATED containers each); no RPC timed here asks a guest anything. For
10, 34 and 100 pods (30, 102 and 300 containers) it times ``ListContainers``, ``ListPodSandbox``
and ``ContainerStatus`` (p50, p99) and the owner's start-up on that ledger (``Sandboxes`` built
from it, its container index included), and, as the same-process baseline, decoding every
container row of the ledger once (what each lookup cost before the index).

Targets: with 100 pods x 3 containers, ListContainers and ListPodSandbox p50 <= 5 ms and p99 <= 20
ms, ContainerStatus p50 <= 1 ms; growth linear in what is returned (``per_item_us`` about constant
from 30 to 300 containers); start-up with 300 containers <= 2 s.

    .venv/bin/python bench/cri_scale.py            # 200 calls per RPC and size
    .venv/bin/python bench/cri_scale.py --smoke    # 20 calls, checks the JSON
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import smoke
from gen.cri.runtime.v1 import api_pb2 as pb
from gen.cri.runtime.v1 import api_pb2_grpc as pb_grpc
from shim import status
from shim.config import ShimConfig
from shim.containers import Containers
from shim.image_store import ImageStore
from shim.model import CONTAINER_CREATED, SANDBOX_READY, ContainerRecord, PodMeta, SandboxRecord
from shim.pods import Pods
from shim.runtime_service import RuntimeServicer
from shim.sandboxes import Sandboxes
from tests import interrupts
from vmsandbox.adapters.hypervisor import Hypervisor
from vmsandbox.adapters.ledger import Ledger
from vmsandbox.adapters.sysfs import read_inventory
from vmsandbox.domain import domain_name
from vmsandbox.profile import Profile
from vmsandbox.sizing import PodDemand, shape_for

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "sysfs" / "one-node-2cpu"
POD_COUNTS = (10, 34, 100)
PER_POD = 3
PROFILE = Profile(name="vmsandbox", handler="vmsandbox")


def _ms(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_ms": round(statistics.median(ordered) * 1e3, 4),
        "p99_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e3, 4),
    }


def _seed(ledger: Ledger, sb: Sandboxes, pods: int) -> list[str]:
    """``pods`` READY sandboxes with PER_POD CREATED containers each; the container ids."""
    shape = shape_for(PodDemand(cpu_millis=500, memory_bytes=64 << 20), PROFILE)
    ids = []
    for n in range(pods):
        sid = f"{n:08x}" + "a" * 56
        record = SandboxRecord(
            id=sid,
            meta=PodMeta(f"pod-{n}", "bench", f"uid-{n}"),
            state=SANDBOX_READY,
            created_ns=n,
            runtime_handler="vmsandbox",
            profile="vmsandbox",
            domain=domain_name(sid),
            log_directory=f"/var/log/pods/bench_pod-{n}_uid-{n}",
            shape=shape,
        )
        ledger.put_sandbox(sid, SANDBOX_READY, n, record.to_doc())
        sb.records.reload()
        for i in range(PER_POD):
            cid = f"{n:08x}{i:08x}" + "c" * 48
            sb.records.save_container(
                ContainerRecord(
                    id=cid,
                    sandbox_id=sid,
                    name=f"app-{i}",
                    attempt=0,
                    state=CONTAINER_CREATED,
                    created_ns=n * PER_POD + i,
                    labels={"app": f"pod-{n}", "tier": "bench"},
                )
            )
            ids.append(cid)
    return ids


def _owner(root: Path, ledger: Ledger, hypervisor: Hypervisor) -> Sandboxes:
    config = ShimConfig(
        state_dir=str(root / "state"), console_dir="", libvirt_uri="test:///default", pod_network="none"
    )
    return Sandboxes(
        config,
        ledger,
        hypervisor,
        {"vmsandbox": PROFILE},
        inventory=lambda: read_inventory(FIXTURE / "sys", FIXTURE / "proc"),
    )


def _time(calls: int, fn: Any) -> list[float]:
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def measure(pods: int, calls: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="vmsandbox-cri-scale-") as tmp:
        root = Path(tmp)
        (root / "state").mkdir()
        ledger = Ledger(root / "state" / "state.db")
        hypervisor = Hypervisor("test:///default", attempts=1)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        try:
            ids = _seed(ledger, _owner(root, ledger, hypervisor), pods)
            t0 = time.perf_counter()
            sb = _owner(root, ledger, hypervisor)  # what start-up builds from this ledger
            start_s = time.perf_counter() - t0
            containers = Containers(str(root / "state"), sb, ImageStore(root / "images"), hypervisor)
            status.add_servicer(
                server, pb.DESCRIPTOR.services_by_name["RuntimeService"], RuntimeServicer(Pods(sb, containers))
            )
            sock = root / "cri.sock"
            server.add_insecure_port(f"unix:{sock}")
            server.start()
            with grpc.insecure_channel(f"unix:{sock}") as channel:
                rt = pb_grpc.RuntimeServiceStub(channel)
                listed = rt.ListContainers(pb.ListContainersRequest(), timeout=30).containers
                assert len(listed) == len(ids), (len(listed), len(ids))
                assert len(rt.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items) == pods
                rng = random.Random(pods)
                lc = _time(calls, lambda: rt.ListContainers(pb.ListContainersRequest(), timeout=30))
                lp = _time(calls, lambda: rt.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30))
                cs = _time(
                    calls,
                    lambda: rt.ContainerStatus(pb.ContainerStatusRequest(container_id=rng.choice(ids)), timeout=30),
                )
            scan = _time(max(3, calls // 10), lambda: [ContainerRecord.from_doc(d) for *_, d in ledger.containers()])
        finally:
            server.stop(None).wait()
            hypervisor.close()
            ledger.close()
    n = len(ids)
    return {
        "pods": pods,
        "containers": n,
        "list_containers": _ms(lc) | {"per_item_us": round(statistics.median(lc) / n * 1e6, 3)},
        "list_pod_sandbox": _ms(lp) | {"per_item_us": round(statistics.median(lp) / pods * 1e6, 3)},
        "container_status": _ms(cs),
        "start_up_s": round(start_s, 4),
        "baseline_decode_all_rows_ms": round(statistics.median(scan) * 1e3, 4),
    }


SIZE_SHAPE: dict[str, Any] = {
    "pods": smoke.COUNT,
    "containers": smoke.COUNT,
    "list_containers": {"p50_ms": smoke.POSITIVE, "p99_ms": smoke.POSITIVE, "per_item_us": smoke.POSITIVE},
    "list_pod_sandbox": {"p50_ms": smoke.POSITIVE, "p99_ms": smoke.POSITIVE, "per_item_us": smoke.POSITIVE},
    "container_status": {"p50_ms": smoke.POSITIVE, "p99_ms": smoke.POSITIVE},
    "start_up_s": smoke.POSITIVE,
    "baseline_decode_all_rows_ms": smoke.POSITIVE,
}
SHAPE: dict[str, Any] = {
    "benchmark": "cri_scale",
    "calls": smoke.COUNT,
    "sizes": smoke.Each(SIZE_SHAPE, length=len(POD_COUNTS)),
    "ratio_container_status_to_decoding_all_rows": smoke.POSITIVE,
    "growth_per_item_list_containers_300_vs_30": smoke.POSITIVE,
    "meets_targets": smoke.BOOL,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200, help="calls per RPC and size")
    parser.add_argument("--smoke", action="store_true", help="20 calls per RPC and size; check the JSON")
    args = parser.parse_args()
    smoke.require(smoke.missing_files(FIXTURE))
    calls = 20 if args.smoke else args.calls
    sizes = [measure(pods, calls) for pods in POD_COUNTS]
    big, small = sizes[-1], sizes[0]
    doc = {
        "benchmark": "cri_scale",
        "calls": calls,
        "sizes": sizes,
        # one ContainerStatus, end to end, against what every lookup used to cost alone
        "ratio_container_status_to_decoding_all_rows": round(
            big["container_status"]["p50_ms"] / big["baseline_decode_all_rows_ms"], 4
        ),
        "growth_per_item_list_containers_300_vs_30": round(
            big["list_containers"]["per_item_us"] / small["list_containers"]["per_item_us"], 3
        ),
        "meets_targets": (
            big["list_containers"]["p50_ms"] <= 5
            and big["list_containers"]["p99_ms"] <= 20
            and big["list_pod_sandbox"]["p50_ms"] <= 5
            and big["list_pod_sandbox"]["p99_ms"] <= 20
            and big["container_status"]["p50_ms"] <= 1
            and big["start_up_s"] <= 2
        ),
    }
    smoke.report(doc, SHAPE, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(interrupts.run_main(main))
