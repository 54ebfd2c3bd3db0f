"""The CRI metrics (``ListMetricDescriptors``, ``ListPodSandboxMetrics``) with real parts: a VM pod
on a CNI bridge of the tests' own whose container burns CPU under a quota, the real socket, and
containerd 2.4 (scripts/build-k8s.sh's, started by scripts/containerd.sh) for its descriptors and,
as the shim's downstream, for the merged list.

Traffic goes only to the pod's address on the test bridge, in a bounded loop."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from tests.integration.cni_kit import CniEnv, cni_env
from tests.shim_kit import (
    REPO,
    Shim,
    container,
    pod,
    q,
    remove_all,
    require_host,
    start_shim,
    stop_shim,
)
from tests.vmsandbox.test_cri_metrics import CRITEST_EXPECTED, CRITEST_OPTIONAL, CRITEST_UNIMPLEMENTED
from vmsandbox.cri_metrics import BY_NAME

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.exclusive]

K8S_BIN = Path(os.environ.get("VMSANDBOX_K8S_BIN", "/var/cache/vmsandbox/k8s/1.37/bin"))
BURN = q({"cpu": "500m", "memory": "64Mi"})  # cpu.max 50000 100000: the loop is throttled


@dataclass
class Env:
    tmp: Path
    cni: CniEnv
    shim: Shim
    sandbox_id: str
    container_id: str
    ip: str

    def restart(self, extra: dict[str, object]) -> None:
        """The same shim (its state, its running pod) started again with ``extra`` configuration."""
        stop_shim(self.shim)
        self.shim = start_shim(self.tmp / "shim", extra_config={**self.cni.shim_config(), **extra}, pull_busybox=False)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    require_host()
    tmp = tmp_path_factory.mktemp("crimetrics")
    with cni_env(tmp, bridge="vmsbr-met0", subnet="10.239.0.0/24") as cni:
        (tmp / "shim").mkdir()
        shim = start_shim(tmp / "shim", extra_config=cni.shim_config())
        e: Env | None = None
        try:
            config = pod("metrics", containers=[("burn", BURN)])
            config.log_directory = str(tmp / "logs")
            rt = shim.runtime
            sid = rt.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=300).pod_sandbox_id
            ip = rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=sid), timeout=30).status.network.ip
            c = container("burn", BURN)
            c.command[:] = ["sh", "-c", "while :; do :; done"]
            c.log_path = "burn.log"
            cid = rt.CreateContainer(
                pb.CreateContainerRequest(pod_sandbox_id=sid, config=c, sandbox_config=config), timeout=120
            ).container_id
            rt.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=120)
            e = Env(tmp, cni, shim, sid, cid, ip)
            yield e
        finally:
            last = e.shim if e is not None else shim
            try:
                remove_all(last)
            finally:
                stop_shim(last)
        assert cni.leftovers() == {k: [] for k in cni.leftovers()}, "the network left something behind"


def _pod_metrics(shim: Shim, sandbox_id: str) -> pb.PodSandboxMetrics:
    listed = shim.runtime.ListPodSandboxMetrics(pb.ListPodSandboxMetricsRequest(), timeout=60).pod_metrics
    (mine,) = [m for m in listed if m.pod_sandbox_id == sandbox_id]
    return mine


def _value(m: pb.PodSandboxMetrics, name: str, container_id: str = "") -> int:
    metrics = m.metrics
    if container_id:
        (cm,) = [c for c in m.container_metrics if c.container_id == container_id]
        metrics = cm.metrics
    (v,) = [x.value.value for x in metrics if x.name == name]
    return v


def _wait(what: str, check: Callable[[], bool], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def test_the_pod_and_its_container_meet_critests_rules(env: Env) -> None:
    """What critest's testMetricDescriptors and testPodSandboxMetrics check, on this VM pod."""
    descs = env.shim.runtime.ListMetricDescriptors(pb.ListMetricDescriptorsRequest(), timeout=30).descriptors
    assert all(d.help and d.label_keys for d in descs)
    assert set(CRITEST_EXPECTED) - CRITEST_UNIMPLEMENTED <= {d.name for d in descs}
    m = _pod_metrics(env.shim, env.sandbox_id)
    assert [c.container_id for c in m.container_metrics] == [env.container_id]
    found: dict[str, list[str]] = {}
    for metric in [*m.metrics, *m.container_metrics[0].metrics]:
        found.setdefault(metric.name, list(metric.label_values))
        d = BY_NAME[metric.name]
        assert len(metric.label_values) == len(d.label_keys), metric.name
        assert metric.metric_type == (pb.COUNTER if d.kind == "counter" else pb.GAUGE), metric.name
    missing = [n for n in CRITEST_EXPECTED if n not in found and n not in CRITEST_OPTIONAL | CRITEST_UNIMPLEMENTED]
    assert missing == []
    mismatched = [d.name for d in descs if d.name in found and len(found[d.name]) != len(d.label_keys)]
    assert mismatched == []
    # what a 6.1 guest has beyond critest's demands: its io, pressure and hugetlb files
    assert {"container_fs_reads_bytes_total", "container_pressure_cpu_waiting_seconds_total"} <= set(found)
    assert found["container_network_receive_bytes_total"][2:] == ["", env.sandbox_id, "", "eth0"]
    assert found["container_cpu_usage_seconds_total"][2:4] == ["burn", env.container_id]


def test_cpu_usage_grows_while_the_container_burns_and_its_quota_throttles_it(env: Env) -> None:
    first = _pod_metrics(env.shim, env.sandbox_id)
    used = _value(first, "container_cpu_usage_seconds_total", env.container_id)
    _wait(
        "the burning container's CPU seconds to grow",
        lambda: (
            _value(_pod_metrics(env.shim, env.sandbox_id), "container_cpu_usage_seconds_total", env.container_id) > used
        ),
    )
    later = _pod_metrics(env.shim, env.sandbox_id)
    assert _value(later, "container_cpu_cfs_throttled_periods_total", env.container_id) > 0
    assert _value(later, "container_spec_cpu_quota", env.container_id) == 50_000
    assert _value(later, "container_spec_cpu_period", env.container_id) == 100_000
    assert _value(later, "container_spec_memory_limit_bytes", env.container_id) == 64 << 20
    assert _value(later, "container_processes", env.container_id) >= 1
    assert _value(later, "container_file_descriptors", env.container_id) >= 3  # the loop's stdio
    started = _value(later, "container_start_time_seconds", env.container_id)
    assert time.time() - 600 < started <= _value(later, "container_last_seen", env.container_id) <= time.time() + 1


def test_what_the_host_sends_the_pod_counts_as_received(env: Env) -> None:
    before = _value(_pod_metrics(env.shim, env.sandbox_id), "container_network_receive_bytes_total")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _ in range(20):
            s.sendto(b"x" * 1000, (env.ip, 9))
            time.sleep(0.02)
    _wait(
        "the pod's received bytes to count the datagrams",
        lambda: (
            _value(_pod_metrics(env.shim, env.sandbox_id), "container_network_receive_bytes_total")
            >= before + 20 * 1000
        ),
        timeout_s=20,
    )
    m = _pod_metrics(env.shim, env.sandbox_id)
    assert _value(m, "container_network_transmit_packets_total") > 0  # the guest's own (ARP, ICMP errors)


# ---- against containerd 2.4 -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def containerd24() -> Iterator[str]:
    """containerd 2.4 of its own (no pods), its CRI endpoint."""
    if not (K8S_BIN / "containerd").is_file() or shutil.which("runc") is None:
        pytest.skip(f"no containerd 2.4 in {K8S_BIN} (scripts/build-k8s.sh) or no runc")
    d = Path(tempfile.mkdtemp(prefix="vmsandbox-ctd24-"))
    script = REPO / "scripts" / "containerd.sh"
    run_env = {**os.environ, "CONTAINERD_BIN_DIR": str(K8S_BIN)}
    subprocess.run(["bash", str(script), "up", str(d)], check=True, capture_output=True, timeout=60, env=run_env)
    try:
        yield f"unix://{d / 'containerd.sock'}"
    finally:
        subprocess.run(["bash", str(script), "down", str(d)], check=True, capture_output=True, timeout=60, env=run_env)
        shutil.rmtree(d, ignore_errors=True)


def _descriptors(endpoint: str) -> dict[str, tuple[str, tuple[str, ...]]]:
    import grpc

    from gen.cri.runtime.v1 import api_pb2_grpc as pb_grpc

    with grpc.insecure_channel(endpoint) as channel:
        got = pb_grpc.RuntimeServiceStub(channel).ListMetricDescriptors(pb.ListMetricDescriptorsRequest(), timeout=30)
    return {d.name: (d.help, tuple(d.label_keys)) for d in got.descriptors}


def test_the_descriptors_are_containerd_24s_and_critests_few_more(env: Env, containerd24: str) -> None:
    theirs = _descriptors(containerd24)
    ours = _descriptors(f"unix:{env.shim.socket}")
    assert len(theirs) > 40
    assert {n: ours.get(n) for n in theirs} == theirs  # names, help texts and label keys
    beyond = set(ours) - set(theirs)
    assert beyond == {n for n, d in BY_NAME.items() if d.beyond_containerd}
    assert beyond <= CRITEST_UNIMPLEMENTED


def test_through_the_proxy_the_vm_pod_is_listed_beside_the_downstreams(env: Env, containerd24: str) -> None:
    """The same shim again, now in front of containerd 2.4: the node's descriptors are containerd's,
    and ListPodSandboxMetrics merges both sides (containerd's answer alone has no VM pod)."""
    env.restart({"downstream_endpoint": containerd24, "downstream_timeout_s": 30})
    assert _descriptors(f"unix:{env.shim.socket}") == _descriptors(containerd24)
    m = _pod_metrics(env.shim, env.sandbox_id)
    assert _value(m, "container_cpu_usage_seconds_total", env.container_id) > 0
    assert _value(m, "container_network_receive_bytes_total") > 0
