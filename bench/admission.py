"""Admission throughput and the CreateContainer round trip (target: >= 100k decisions/s for a
10-container pod; the admission decision's CRI round trip p99 <= 2 ms).

    .venv/bin/python bench/admission.py                 # both parts
    .venv/bin/python bench/admission.py --no-socket     # the pure part only (no host set-up needed)
    .venv/bin/python bench/admission.py --smoke         # a few calls of each kind; checks the JSON

(a) Pure ``admission.admit_declared`` on a 10-container declaration (each container: cpu, memory,
    ephemeral-storage, hugepages-2Mi and a mount): accepting decisions (the request spelled as
    declared, and spelled differently: "0.5" vs "500m", "65536Ki" vs "64Mi") and rejecting ones
    (one difference; five differences, every one named in the message). Baselines measured in the
    same process, so ratios mean something on a noisy machine: ``dict_eq`` compares the raw
    request strings with a dict equality (what a check without canonicalisation would cost) and
    ``translate`` turns the CRI ``ContainerConfig`` into the core request (what every
    CreateContainer pays before admission runs).
(b) A real shim on a unix socket, one declared sandbox (one real guest), then CreateContainer
    calls: accepted (each followed by an untimed RemoveContainer, so the sandbox stays at its
    10 containers' worth of state, and with distinct attempts) and rejected (FAILED_PRECONDITION
    with the differences, ALREADY_EXISTS). p50/p99 in milliseconds, beside a Version call as the
    transport's floor. An accepted call is a real container: its image (busybox, from a local
    registry the benchmark starts) is pulled first, and its volume is an existing directory under
    the shim's ``kubelet_pods_dir`` (a temporary one), which the shim shares into the guest, as it
    does a kubelet's emptyDir. So an accepted call includes the guest's create (about a second under
    TCG), and ``create_all_ms`` with it. The rejected calls are the admission decision's round trip
    (``decision_ms``), and the 2 ms target applies to them: an accepted call's time is the guest's.

Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import smoke
from bench.shim_process import shim_process
from gen.cri.apimachinery.resource.generated_pb2 import Quantity as PbQuantity
from gen.cri.runtime.v1 import api_pb2 as pb
from gen.cri.runtime.v1 import api_pb2_grpc as pb_grpc
from shim.translate import inbound
from tests import interrupts
from tests.registry_kit import Layout, Registry, busybox_entries, push
from vmsandbox.admission import Existing, admit_declared
from vmsandbox.errors import AlreadyExists, Diverged
from vmsandbox.resources import ContainerDeclaration, ContainerResources, Mount, PodDeclaration, ResourceList

IMAGE_DIR = os.environ.get("VMSANDBOX_IMAGE_DIR", "/var/lib/vmsandbox/images/default")
CONTAINERS = 10
EMPTY_DIR = "volumes/kubernetes.io~empty-dir"  # where a kubelet keeps a pod's emptyDir volumes
# the pure part's volumes: where a kubelet with its default root would put them (nothing is read there)
PURE_VOLUMES = f"/var/lib/kubelet/pods/0b6c7a52-5f1e-4d2a-9a43-6e8f3c1d2b7a/{EMPTY_DIR}"


# -- the pod --------------------------------------------------------------------------------------------
def declared_strings(i: int) -> tuple[dict[str, str], dict[str, str]]:
    requests = {"cpu": "50m", "memory": f"{16 + i}Mi", "ephemeral-storage": "1Gi", "hugepages-2Mi": "2Mi"}
    limits = {"cpu": "100m", "memory": f"{16 + i}Mi", "hugepages-2Mi": "2Mi"}
    return requests, limits


def respelled_strings(i: int) -> tuple[dict[str, str], dict[str, str]]:
    requests = {
        "cpu": "0.05",
        "memory": f"{(16 + i) * 1024}Ki",
        "ephemeral-storage": "1073741824",
        "hugepages-2Mi": "2Mi",
    }
    limits = {"cpu": "0.1", "memory": f"{(16 + i) * 1024}Ki", "hugepages-2Mi": "2097152"}
    return requests, limits


def mount(i: int, volumes: str) -> Mount:
    """Container ``c{i}``'s volume: directory ``c{i}`` of ``volumes``, read-only at /data."""
    return Mount(container_path="/data", host_path=f"{volumes}/c{i}", readonly=True)


def core_resources(requests: dict[str, str], limits: dict[str, str], mounts: frozenset[Mount]) -> ContainerResources:
    return ContainerResources(
        requests=ResourceList.parse(requests, where="requests"),
        limits=ResourceList.parse(limits, where="limits"),
        mounts=mounts,
    )


def declaration(volumes: str) -> PodDeclaration:
    return PodDeclaration(
        containers=tuple(
            ContainerDeclaration(f"c{i}", core_resources(*declared_strings(i), frozenset({mount(i, volumes)})))
            for i in range(CONTAINERS)
        )
    )


def kres(requests: dict[str, str], limits: dict[str, str]) -> pb.KubernetesResources:
    return pb.KubernetesResources(
        requests={k: PbQuantity(string=v) for k, v in requests.items()},
        limits={k: PbQuantity(string=v) for k, v in limits.items()},
    )


def pb_mount(i: int, volumes: str) -> pb.Mount:
    m = mount(i, volumes)
    return pb.Mount(container_path=m.container_path, host_path=m.host_path, readonly=m.readonly)


def container_config(
    i: int, attempt: int, res: pb.KubernetesResources, volumes: str, image: str = "busybox"
) -> pb.ContainerConfig:
    return pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name=f"c{i}", attempt=attempt),
        image=pb.ImageSpec(image=image),
        kubernetes_resources=res,
        mounts=[pb_mount(i, volumes)],
    )


# -- (a) pure decisions -----------------------------------------------------------------------------------
def rate(fn: Callable[[], object], seconds: float, rounds: int = 15) -> float:
    """Calls per second of ``fn`` over about ``seconds``: the best of ``rounds`` short rounds, so that
    other processes on a shared machine (which only ever slow a round down) weigh as little as possible."""
    n = 1
    while True:  # calibrate a batch of ~20 ms
        start = time.perf_counter()
        for _ in range(n):
            fn()
        if time.perf_counter() - start > 0.02:
            break
        n *= 2
    best = 0.0
    for _ in range(rounds):
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / rounds:
            for _ in range(n):
                fn()
            count += n
        best = max(best, count / (time.perf_counter() - start))
    return best


def pure(seconds: float) -> dict[str, Any]:
    decl = declaration(PURE_VOLUMES)
    existing = [Existing(f"c{i}", 0) for i in range(CONTAINERS)]
    same = [core_resources(*declared_strings(i), frozenset({mount(i, PURE_VOLUMES)})) for i in range(CONTAINERS)]
    respelled = [core_resources(*respelled_strings(i), frozenset({mount(i, PURE_VOLUMES)})) for i in range(CONTAINERS)]

    def one_diff(i: int) -> ContainerResources:
        requests, limits = declared_strings(i)
        return core_resources(requests, {**limits, "memory": "1Gi"}, frozenset({mount(i, PURE_VOLUMES)}))

    def five_diffs(i: int) -> ContainerResources:
        requests, limits = declared_strings(i)
        return core_resources(
            {**requests, "cpu": "1"}, {**limits, "cpu": "2", "memory": "1Gi"}, frozenset({Mount("/other", "/x")})
        )

    one, five = [one_diff(i) for i in range(CONTAINERS)], [five_diffs(i) for i in range(CONTAINERS)]
    state = {"i": 0}

    def accept(requests: list[ContainerResources]) -> Callable[[], None]:
        def run() -> None:
            i = state["i"] = (state["i"] + 1) % CONTAINERS
            admit_declared(decl, f"c{i}", 1, requests[i], existing)  # attempt 1: a retry, all 10 exist

        return run

    def reject(requests: list[ContainerResources]) -> Callable[[], None]:
        def run() -> None:
            i = state["i"] = (state["i"] + 1) % CONTAINERS
            try:
                admit_declared(decl, f"c{i}", 1, requests[i], existing)
            except Diverged:
                return
            raise AssertionError("accepted a divergent request")

        return run

    def already_exists() -> None:
        i = state["i"] = (state["i"] + 1) % CONTAINERS
        try:
            admit_declared(decl, f"c{i}", 0, same[i], existing)
        except AlreadyExists:
            return
        raise AssertionError("accepted a duplicate")

    raw_declared = [declared_strings(i) for i in range(CONTAINERS)]
    raw_requested = [declared_strings(i) for i in range(CONTAINERS)]

    def dict_eq() -> bool:
        i = state["i"] = (state["i"] + 1) % CONTAINERS
        return raw_declared[i] == raw_requested[i]

    configs = [container_config(i, 1, kres(*declared_strings(i)), PURE_VOLUMES) for i in range(CONTAINERS)]

    def translate_only() -> None:
        i = state["i"] = (state["i"] + 1) % CONTAINERS
        inbound.container_spec(configs[i])

    cases = {
        "accept_as_declared": accept(same),
        "accept_respelled": accept(respelled),
        "reject_one_difference": reject(one),
        "reject_five_differences": reject(five),
        "reject_already_exists": already_exists,
    }
    per_s = {name: rate(fn, seconds) for name, fn in cases.items()}
    baselines = {"dict_eq": rate(dict_eq, seconds), "translate": rate(translate_only, seconds)}
    slowest = min(per_s.values())
    return {
        "containers_in_pod": CONTAINERS,
        "decisions_per_s": {k: round(v) for k, v in per_s.items()},
        "baseline_per_s": {k: round(v) for k, v in baselines.items()},
        "cost_vs_dict_eq": {k: round(baselines["dict_eq"] / v, 1) for k, v in per_s.items()},
        "cost_vs_translate": {k: round(baselines["translate"] / v, 3) for k, v in per_s.items()},
        "slowest_decisions_per_s": round(slowest),
        "target_per_s": 100_000,
        "meets_target": slowest >= 100_000,
    }


# -- (b) over the socket --------------------------------------------------------------------------------
def percentiles(samples: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples)
    q = statistics.quantiles(ms, n=100, method="inclusive")
    return {"p50": round(q[49], 3), "p99": round(q[98], 3), "max": round(ms[-1], 3), "n": len(ms)}


def socket_round_trips(calls: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="vmsandbox-bench-") as tmp_s:
        tmp = Path(tmp_s)
        uid = str(uuid.uuid4())
        pods = tmp / "pods"  # the shim's kubelet_pods_dir: the pod's volumes are shared from there
        volumes = pods / uid / EMPTY_DIR
        for i in range(CONTAINERS):
            (volumes / f"c{i}").mkdir(parents=True)
        profile = tmp / "profiles.yaml"
        profile.write_text(json.dumps({"name": "vmsandbox", "handler": "vmsandbox", "guest": {"image_dir": IMAGE_DIR}}))
        config = tmp / "config.yaml"
        config.write_text(json.dumps({"kubelet_pods_dir": str(pods)}))
        registry = Registry(tmp / "registry").start()
        try:
            layout = Layout(tmp / "layout")
            layout.tag("bb", layout.image([layout.layer(busybox_entries(("sh",)))]))
            image = f"{registry.host}/bench/busybox:1"
            push(layout, "bb", image)
            (tmp / "shim").mkdir()
            serve = ("--config", str(config), "--profile", str(profile))
            with shim_process(tmp / "shim", *serve, log_level="WARNING") as rt:
                with grpc.insecure_channel(f"unix:{tmp / 'shim' / 'cri.sock'}") as channel:
                    pb_grpc.ImageServiceStub(channel).PullImage(
                        pb.PullImageRequest(image=pb.ImageSpec(image=image)), timeout=300
                    )
                return _drive(rt, calls, uid, str(volumes), image)
        finally:
            registry.stop()


def _drive(rt: pb_grpc.RuntimeServiceStub, calls: int, uid: str, volumes: str, image: str) -> dict[str, Any]:
    config = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name="bench", namespace="bench", uid=uid),
        pod_resources=pb.PodResourceConfig(
            containers=[
                pb.ContainerResourceConfig(
                    name=f"c{i}", kubernetes_resources=kres(*declared_strings(i)), mounts=[pb_mount(i, volumes)]
                )
                for i in range(CONTAINERS)
            ]
        ),
    )
    sid = rt.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=300).pod_sandbox_id
    try:
        # the pod's own containers, as a kubelet creates them: all 10, or the ones a short run's calls use
        for i in range(min(CONTAINERS, calls)):
            rt.CreateContainer(
                pb.CreateContainerRequest(
                    pod_sandbox_id=sid, config=container_config(i, 0, kres(*declared_strings(i)), volumes, image)
                ),
                timeout=30,
            )
        version: list[float] = []
        accepted: list[float] = []
        diverged: list[float] = []
        exists: list[float] = []
        warmup = min(50, calls // 10)
        for n in range(calls + warmup):
            i, attempt = n % CONTAINERS, 1 + n
            ok = container_config(i, attempt, kres(*respelled_strings(i)), volumes, image)
            bad = container_config(
                i, attempt, kres(declared_strings(i)[0], {**declared_strings(i)[1], "memory": "1Gi"}), volumes, image
            )
            dup = container_config(i, 0, kres(*declared_strings(i)), volumes, image)
            start = time.perf_counter()
            rt.Version(pb.VersionRequest(), timeout=30)
            t_version = time.perf_counter() - start
            start = time.perf_counter()
            cid = rt.CreateContainer(pb.CreateContainerRequest(pod_sandbox_id=sid, config=ok), timeout=30).container_id
            t_ok = time.perf_counter() - start
            rt.RemoveContainer(pb.RemoveContainerRequest(container_id=cid), timeout=30)
            t_bad = _rejected(rt, sid, bad, grpc.StatusCode.FAILED_PRECONDITION)
            t_dup = _rejected(rt, sid, dup, grpc.StatusCode.ALREADY_EXISTS)
            if n >= warmup:
                version.append(t_version)
                accepted.append(t_ok)
                diverged.append(t_bad)
                exists.append(t_dup)
    finally:
        rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=120)
        rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=120)
    create_all = accepted + diverged + exists
    decision = diverged + exists
    p99 = percentiles(decision)["p99"]
    return {
        "containers_in_pod": CONTAINERS,
        "version_ms": percentiles(version),
        "create_accepted_ms": percentiles(accepted),
        "create_rejected_failed_precondition_ms": percentiles(diverged),
        "create_rejected_already_exists_ms": percentiles(exists),
        "create_all_ms": percentiles(create_all),
        "decision_ms": percentiles(decision),
        "target_p99_ms": 2.0,
        "meets_target": p99 <= 2.0,
    }


def _rejected(rt: pb_grpc.RuntimeServiceStub, sid: str, config: pb.ContainerConfig, code: grpc.StatusCode) -> float:
    start = time.perf_counter()
    try:
        rt.CreateContainer(pb.CreateContainerRequest(pod_sandbox_id=sid, config=config), timeout=30)
    except grpc.RpcError as exc:
        elapsed = time.perf_counter() - start
        if exc.code() != code:
            raise
        return elapsed
    raise AssertionError(f"expected {code.name}")


PURE_CASES = frozenset(
    {
        "accept_as_declared",
        "accept_respelled",
        "reject_one_difference",
        "reject_five_differences",
        "reject_already_exists",
    }
)
MS = {"p50": smoke.POSITIVE, "p99": smoke.POSITIVE, "max": smoke.POSITIVE, "n": smoke.COUNT}
SHAPE: dict[str, Any] = {
    "benchmark": "admission",
    "pure": {
        "containers_in_pod": CONTAINERS,
        "decisions_per_s": smoke.Keyed(smoke.POSITIVE, PURE_CASES),
        "baseline_per_s": smoke.Keyed(smoke.POSITIVE, frozenset(("dict_eq", "translate"))),
        "cost_vs_dict_eq": smoke.Keyed(smoke.POSITIVE, PURE_CASES),
        "cost_vs_translate": smoke.Keyed(smoke.POSITIVE, PURE_CASES),
        "slowest_decisions_per_s": smoke.POSITIVE,
        "target_per_s": 100_000,
        "meets_target": smoke.BOOL,
    },
    "socket": {
        "containers_in_pod": CONTAINERS,
        "version_ms": MS,
        "create_accepted_ms": MS,
        "create_rejected_failed_precondition_ms": MS,
        "create_rejected_already_exists_ms": MS,
        "create_all_ms": MS,
        "decision_ms": MS,
        "target_p99_ms": 2.0,
        "meets_target": smoke.BOOL,
    },
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=1.5, help="time per pure case")
    parser.add_argument("--calls", type=int, default=100, help="CreateContainer calls of each kind over the socket")
    parser.add_argument("--no-socket", action="store_true", help="skip the socket part (no guest is booted)")
    parser.add_argument(
        "--smoke", action="store_true", help="0.05 s a pure case, 3 calls of each kind; check the JSON, exit 1 if wrong"
    )
    args = parser.parse_args()
    if args.smoke:
        args.seconds, args.calls = 0.05, 3
    if args.calls < 2:
        parser.error("--calls must be at least 2 (a percentile needs two samples)")
    if not args.no_socket:
        smoke.require(smoke.missing_guest_host(), smoke.missing_image_tools())
    result: dict[str, Any] = {"benchmark": "admission", "pure": pure(args.seconds)}
    shape = dict(SHAPE)
    if args.no_socket:
        del shape["socket"]
    else:
        result["socket"] = socket_round_trips(args.calls)
    smoke.report(result, shape, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(interrupts.run_main(main))
