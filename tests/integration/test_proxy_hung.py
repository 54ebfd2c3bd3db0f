"""The CRI proxy in front of a downstream that accepts connections and never answers.

containerd is stopped with SIGSTOP (the one this test started, by its pid) while a VM pod and an
ordinary pod exist: its socket still accepts, the proxy's connection stays up, and no call is
answered. VM pod calls go on within their usual time; calls the downstream owns end within
``downstream_timeout_s`` (``UNAVAILABLE`` naming the endpoint) or the caller's shorter deadline
(``DEADLINE_EXCEEDED``), never ``INTERNAL``, never hanging, even when more of them wait at once
than the proxy lets wait; the merged lists answer, the VM side as it is and the downstream's as it
last listed it. After SIGCONT everything answers again without a shim restart.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from tests.integration.downstream_kit import Containerd, require_containerd
from tests.shim_kit import busybox_registry, pod, q, require_host, start_shim, stop_shim

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BOUND_S = 3.0  # the shim's downstream_timeout_s here
SLACK_S = 2.0  # a shared two-core host running other guests under TCG
QUICK_S = 2.0  # what a call that never touches the downstream may take here
T = TypeVar("T")


def timed(fn: Callable[[], T]) -> tuple[T | grpc.RpcError, float]:
    """``fn``'s answer (or its gRPC error) and how long it took."""
    t0 = time.monotonic()
    try:
        out: T | grpc.RpcError = fn()
    except grpc.RpcError as exc:
        out = exc
    return out, time.monotonic() - t0


def failed(out: object, code: grpc.StatusCode) -> str:
    """The details of an error ``out`` with ``code`` (an assertion error names what came instead)."""
    assert isinstance(out, grpc.RpcError), f"expected {code.name}, got an answer: {out!r:.300}"
    assert out.code() == code, f"expected {code.name}, got {out.code().name}: {out.details()}"
    return out.details() or ""


def _config(name: str, logs: Path, *, host_network: bool = False) -> pb.PodSandboxConfig:
    config = pod(name, containers=[("app", q({"cpu": "1", "memory": "64Mi"}))])
    (logs / name).mkdir(parents=True)
    config.log_directory = str(logs / name)
    if host_network:  # the downstream has no CNI configuration here
        config.linux.security_context.namespace_options.network = pb.NODE
    return config


def _sleeper() -> pb.ContainerConfig:
    return pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name="app"),
        image=pb.ImageSpec(image="busybox"),
        command=["/bin/sleep", "3600"],
        log_path="app.log",
        kubernetes_resources=q({"cpu": "1", "memory": "64Mi"}),
    )


def _conditions(status: Any) -> dict[str, Any]:
    return {c.type: c for c in status.status.conditions}


def test_hung_downstream_leaves_vm_pods_alone_and_bounds_its_own_calls(tmp_path: Path) -> None:
    require_host()
    require_containerd()
    registry = busybox_registry()
    if registry is None:
        pytest.skip("no local registry (docker-registry, skopeo, busybox-static)")
    (tmp_path / "shim").mkdir()
    ctd = Containerd(tmp_path / "containerd", tmp_path / "net.d", registry)
    ctd.up()
    shim = None
    vm = ""
    try:
        # busybox is pulled into vmsandbox's store by start_shim; docker.io is the local registry on both sides
        shim = start_shim(
            tmp_path / "shim", extra_config={"downstream_endpoint": ctd.endpoint, "downstream_timeout_s": BOUND_S}
        )
        rt = shim.runtime
        logs = tmp_path / "logs"
        plain_config = _config("plain", logs, host_network=True)
        plain = rt.RunPodSandbox(pb.RunPodSandboxRequest(config=plain_config), timeout=120).pod_sandbox_id
        shim.images.PullImage(  # the pod is the downstream's: its store pulls
            pb.PullImageRequest(image=pb.ImageSpec(image="busybox"), sandbox_config=plain_config), timeout=120
        )
        plain_ctr = rt.CreateContainer(
            pb.CreateContainerRequest(pod_sandbox_id=plain, config=_sleeper(), sandbox_config=plain_config),
            timeout=120,
        ).container_id
        endpoint = ctd.endpoint
        # what the kubelet's PLEG asks every second: the proxy keeps the downstream's answers
        rt.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30)
        rt.ListContainers(pb.ListContainersRequest(filter=pb.ContainerFilter()), timeout=30)

        with ctd.hung():
            # -- VM pod calls: a VM pod made, started and asked about while the downstream hangs --
            vm_config = _config("vm", logs)
            got, took = timed(
                lambda: rt.RunPodSandbox(
                    pb.RunPodSandboxRequest(config=vm_config, runtime_handler="vmsandbox"), timeout=180
                )
            )
            assert isinstance(got, pb.RunPodSandboxResponse), got
            vm = got.pod_sandbox_id
            # its image: PullImage names the VM pod, so vmsandbox's store alone is asked
            got_pull, took = timed(
                lambda: shim.images.PullImage(
                    pb.PullImageRequest(image=pb.ImageSpec(image="busybox"), sandbox_config=vm_config), timeout=60
                )
            )
            assert isinstance(got_pull, pb.PullImageResponse), got_pull
            vm_ctr = rt.CreateContainer(
                pb.CreateContainerRequest(pod_sandbox_id=vm, config=_sleeper(), sandbox_config=vm_config),
                timeout=120,
            ).container_id
            rt.StartContainer(pb.StartContainerRequest(container_id=vm_ctr), timeout=120)
            vm_calls: list[Callable[[], object]] = [
                lambda: rt.Version(pb.VersionRequest(), timeout=30),
                lambda: rt.ContainerStatus(pb.ContainerStatusRequest(container_id=vm_ctr), timeout=30),
                lambda: rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=vm), timeout=30),
                # a list filtered to the VM pod asks vmsandbox alone
                lambda: rt.ListContainers(
                    pb.ListContainersRequest(filter=pb.ContainerFilter(pod_sandbox_id=vm)), timeout=30
                ),
            ]
            for call in vm_calls:
                answer, took = timed(call)
                assert not isinstance(answer, grpc.RpcError), answer
                assert took < QUICK_S, (answer, took)
            state = rt.ContainerStatus(pb.ContainerStatusRequest(container_id=vm_ctr), timeout=30).status.state
            assert state == pb.CONTAINER_RUNNING
            listed = rt.ListContainers(
                pb.ListContainersRequest(filter=pb.ContainerFilter(pod_sandbox_id=vm)), timeout=30
            )
            assert [c.id for c in listed.containers] == [vm_ctr]

            # Status: within the bound, vmsandbox ready, the downstream not, naming its endpoint
            status, took = timed(lambda: rt.Status(pb.StatusRequest(), timeout=30))
            assert isinstance(status, pb.StatusResponse), status
            assert took < BOUND_S + SLACK_S
            conditions = _conditions(status)
            assert conditions["RuntimeReady"].status and conditions["NetworkReady"].status
            assert not conditions["DownstreamRuntimeReady"].status
            assert endpoint in conditions["DownstreamRuntimeReady"].message

            # -- calls the downstream owns: UNAVAILABLE naming it, within the bound --
            theirs: list[Callable[[], object]] = [
                lambda: rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=plain), timeout=30),
                lambda: rt.ContainerStatus(pb.ContainerStatusRequest(container_id=plain_ctr), timeout=30),
                lambda: rt.RuntimeConfig(pb.RuntimeConfigRequest(), timeout=30),
                lambda: rt.RunPodSandbox(
                    pb.RunPodSandboxRequest(config=_config("plain-2", logs, host_network=True)), timeout=30
                ),
                # stats are the downstream's figures now or nothing
                lambda: rt.ListContainerStats(pb.ListContainerStatsRequest(), timeout=30),
            ]
            for call in theirs:
                answer, took = timed(call)
                assert endpoint in failed(answer, grpc.StatusCode.UNAVAILABLE)
                assert took < BOUND_S + SLACK_S, took
            # merged lists: the VM side as it is, the downstream's as it last listed it (leaving its
            # pods out would tell the kubelet they are gone), within the bound
            pods, took = timed(lambda: rt.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30))
            assert isinstance(pods, pb.ListPodSandboxResponse), pods
            assert took < BOUND_S + SLACK_S, took
            assert {s.id: (s.runtime_handler, s.state) for s in pods.items} == {
                vm: ("vmsandbox", pb.SANDBOX_READY),
                plain: ("", pb.SANDBOX_READY),
            }
            ctrs, took = timed(lambda: rt.ListContainers(pb.ListContainersRequest(), timeout=30))
            assert isinstance(ctrs, pb.ListContainersResponse), ctrs
            assert took < BOUND_S + SLACK_S, took
            assert {c.id: c.state for c in ctrs.containers} == {
                vm_ctr: pb.CONTAINER_RUNNING,
                plain_ctr: pb.CONTAINER_CREATED,
            }
            running = pb.ContainerFilter(state=pb.ContainerStateValue(state=pb.CONTAINER_RUNNING))
            ctrs, took = timed(lambda: rt.ListContainers(pb.ListContainersRequest(filter=running), timeout=30))
            assert isinstance(ctrs, pb.ListContainersResponse), ctrs
            assert [c.id for c in ctrs.containers] == [vm_ctr]  # the filter applies to both sides
            # a caller's deadline shorter than the bound is the caller's: DEADLINE_EXCEEDED at that deadline
            answer, took = timed(
                lambda: rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=plain), timeout=1.0)
            )
            failed(answer, grpc.StatusCode.DEADLINE_EXCEEDED)
            assert took < 1.0 + SLACK_S

            # -- more callers waiting on the downstream than it may hold: VM pod calls still answer --
            with futures.ThreadPoolExecutor(max_workers=24) as pool:
                waiting = [
                    pool.submit(
                        timed,
                        lambda: rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=plain), timeout=30),
                    )
                    for _ in range(20)
                ]
                time.sleep(0.5)  # they have reached the shim
                for call in vm_calls[:2]:
                    answer, took = timed(call)
                    assert not isinstance(answer, grpc.RpcError), answer
                    assert took < QUICK_S, took
                for f in waiting:
                    answer, took = f.result(timeout=60)
                    assert endpoint in failed(answer, grpc.StatusCode.UNAVAILABLE)
                    assert took < BOUND_S + SLACK_S, took

        # -- the downstream is back: everything answers, no shim restart --
        deadline = time.monotonic() + 20
        while True:
            back, _ = timed(lambda: rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=plain), timeout=10))
            if not isinstance(back, grpc.RpcError):
                break
            assert back.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline, back
            time.sleep(0.2)
        assert back.status.state == pb.SANDBOX_READY
        assert rt.ContainerStatus(pb.ContainerStatusRequest(container_id=plain_ctr), timeout=10).status.id == plain_ctr
        sandboxes = {s.id: s.runtime_handler for s in rt.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items}
        assert sandboxes[vm] == "vmsandbox" and sandboxes[plain] == ""
        assert {vm_ctr, plain_ctr} <= {
            c.id for c in rt.ListContainers(pb.ListContainersRequest(), timeout=30).containers
        }
        assert _conditions(rt.Status(pb.StatusRequest(), timeout=30))["DownstreamRuntimeReady"].status
        assert "internal error" not in shim.log_text()
    finally:
        try:
            if shim is not None and vm:
                shim.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=vm), timeout=120)
                shim.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=vm), timeout=120)
        finally:
            try:
                if shim is not None:
                    stop_shim(shim)
            finally:
                try:
                    if ctd.running():
                        ctd.remove_all()
                finally:
                    ctd.down()
