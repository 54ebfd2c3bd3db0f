"""Observability of a real shim: Prometheus metrics scraped over HTTP and parsed with the Prometheus
text parser, the gRPC health service on the CRI socket, and JSON logs naming the pod on its lines."""

from __future__ import annotations

import json
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from gen.cri.runtime.v1 import api_pb2 as pb
from tests.ports import quiet_port
from tests.shim_kit import Shim, container, pod, q, require_host, start_shim, stop_shim

pytestmark = [pytest.mark.integration, pytest.mark.slow]

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def free_port() -> int:
    return quiet_port()


def scrape(address: str) -> Samples:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Shim, str]]:
    require_host()
    tmp = tmp_path_factory.mktemp("metrics")
    address = f"127.0.0.1:{free_port()}"
    running = start_shim(tmp, extra_config={"metrics_address": address, "log_format": "json"})
    try:
        yield running, address
    finally:
        stop_shim(running)
        shutil.rmtree(tmp, ignore_errors=True)


def test_health_service_on_the_cri_socket(observed: tuple[Shim, str]) -> None:
    shim, _ = observed
    stub = health_pb2_grpc.HealthStub(shim.channel)
    for service in ("", "runtime.v1.RuntimeService", "runtime.v1.ImageService"):
        answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING, service
    with pytest.raises(grpc.RpcError) as err:
        stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_metrics_follow_a_pod(observed: tuple[Shim, str]) -> None:
    shim, address = observed
    before = scrape(address)
    assert value(before, "vmsandbox_guests_running") == 0
    nodes = sorted({dict(labels)["node"] for name, labels in before if name == "vmsandbox_cpus"})
    assert nodes, "no per-node CPU gauges"
    owned = sum(value(before, "vmsandbox_cpus", node=n, state="free") for n in nodes)
    assert owned >= 1 and all(value(before, "vmsandbox_cpus", node=n, state="allocated") == 0 for n in nodes)
    starts_before = value(before, "vmsandbox_sandbox_start_seconds_count", handler="vmsandbox")

    config = pod("metrics", containers=[("app", q({"cpu": "1", "memory": "64Mi"}))])
    sid = shim.runtime.RunPodSandbox(
        pb.RunPodSandboxRequest(config=config, runtime_handler="vmsandbox"), timeout=300
    ).pod_sandbox_id
    try:
        with pytest.raises(grpc.RpcError) as err:  # a divergent container: refused and counted
            shim.runtime.CreateContainer(
                pb.CreateContainerRequest(
                    pod_sandbox_id=sid,
                    config=container("app", q({"cpu": "2", "memory": "64Mi"})),
                    sandbox_config=config,
                ),
                timeout=30,
            )
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        during = scrape(address)
        assert value(during, "vmsandbox_sandbox_start_seconds_count", handler="vmsandbox") == starts_before + 1
        assert value(during, "vmsandbox_sandbox_start_seconds_sum", handler="vmsandbox") > 0
        assert value(during, "vmsandbox_guests_running") == 1
        allocated = {n: value(during, "vmsandbox_cpus", node=n, state="allocated") for n in nodes}
        assert sum(allocated.values()) == 1  # one pinned vCPU
        assert sum(value(during, "vmsandbox_cpus", node=n, state="free") for n in nodes) == owned - 1
        # 64Mi + 64Mi overhead = 128Mi guest RAM = 64 pages of 2Mi
        assert (
            sum(value(during, "vmsandbox_hugepages", node=n, page_size="2Mi", state="allocated") for n in nodes) == 64
        )
        rejected = value(
            during, "vmsandbox_admission_rejections_total", rpc="CreateContainer", reason="FAILED_PRECONDITION"
        )
        assert rejected == 1
        assert ("vmsandbox_libvirt_errors_total", ()) in during
        # the pod's QEMU beyond guest RAM (the 128Mi on hugepages are not in it): QEMU's own and
        # its TCG translation cache, about 36 MiB with the default 16 MiB cache (docs/benchmarks.md
        # "VMM memory"; readings move in 2 MiB steps), never the 54 MiB of a 32 MiB cache
        vmm = value(during, "vmsandbox_vmm_private_memory_bytes", sandbox_id=sid)
        assert 4 * 2**20 < vmm <= 42 * 2**20, vmm
        assert value(during, "vmsandbox_vmm_private_memory_total_bytes") == vmm
        assert ("vmsandbox_libvirt_retries_total", ()) in during
    finally:
        shim.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=120)
        shim.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=120)
    after = scrape(address)
    assert value(after, "vmsandbox_guests_running") == 0
    assert not [labels for name, labels in after if name == "vmsandbox_vmm_private_memory_bytes"]
    assert value(after, "vmsandbox_vmm_private_memory_total_bytes") == 0
    assert all(value(after, "vmsandbox_cpus", node=n, state="allocated") == 0 for n in nodes)
    assert all(value(after, "vmsandbox_hugepages", node=n, page_size="2Mi", state="allocated") == 0 for n in nodes)
    assert value(after, "vmsandbox_sandbox_start_seconds_count", handler="vmsandbox") == starts_before + 1

    # JSON logs: every line about this pod carries its sandbox id and name
    lines = [json.loads(line) for line in Path(shim.log).read_text().splitlines() if line.startswith("{")]
    about = [doc for doc in lines if sid[:12] in doc["msg"]]
    assert len(about) >= 3, lines[-10:]  # claimed, ready, stopped
    assert all(doc.get("sandbox_id") == sid and doc.get("pod") == "test/metrics" for doc in about), about
    refused = [doc for doc in lines if doc["msg"].startswith("CreateContainer -> FAILED_PRECONDITION")]
    assert refused and refused[0]["pod"] == "test/metrics"
