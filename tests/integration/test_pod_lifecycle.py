"""A pod through the real socket: a real guest boots pinned and hugepage-backed, admission
rejects divergence, a guest that never reports is rolled back, and two pods that cannot both
fit race for the host with exactly one winner."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import grpc
import libvirt
import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from tests.shim_kit import LIBVIRT_URI, Shim, container, hugepages_free, our_domains, pod, q

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.exclusive]


def status_info(shim: Shim, sandbox_id: str) -> dict[str, Any]:
    st = shim.runtime.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id, verbose=True), timeout=30)
    info: dict[str, Any] = json.loads(st.info["info"])
    return info


def stop_remove(shim: Shim, sandbox_id: str) -> None:
    shim.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=120)
    shim.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=120)


def claims_in_ledger(shim: Shim) -> int:
    import sqlite3

    db = sqlite3.connect(shim.state_dir / "state.db")
    try:
        return int(db.execute("SELECT count(*) FROM claims").fetchone()[0])
    finally:
        db.close()


def test_declared_pod_boots_pinned_hugepage_guest(shim: Shim) -> None:
    free_before = hugepages_free()
    config = pod(
        "web",
        init=[("setup", q({"cpu": "500m", "memory": "64Mi"}))],
        containers=[
            ("web", q({"cpu": "1", "memory": "128Mi"})),
            ("cache", q({"cpu": "500m", "memory": "64Mi", "hugepages-2Mi": "32Mi"})),
        ],
    )
    sid = shim.runtime.RunPodSandbox(
        pb.RunPodSandboxRequest(config=config, runtime_handler="vmsandbox"), timeout=300
    ).pod_sandbox_id
    try:
        info = status_info(shim, sid)
        shape, guest = info["shape"], info["guest"]
        # 1.5 CPUs -> 2 vCPUs; 192Mi + 32Mi hugepages + 64Mi overhead = 288 MiB, 2 MiB pages
        assert shape["vcpus"] == 2
        assert shape["memory_bytes"] == 288 << 20
        assert shape["backing_page_size"] == 2 << 20
        assert info["sizing_mode"] == "declared"
        # the guest's own view
        assert guest["vcpus"] == shape["vcpus"]
        assert 0.6 * (shape["memory_bytes"] >> 10) < guest["mem_total_kib"] <= shape["memory_bytes"] >> 10
        assert guest["hugepages"]["2048"]["total"] == 16  # 32Mi of hugepages-2Mi inside the guest
        # libvirt: each vCPU pinned to exactly its host CPU
        conn = libvirt.open(LIBVIRT_URI)
        try:
            mask = conn.lookupByName(info["domain"]).vcpuPinInfo(libvirt.VIR_DOMAIN_AFFECT_LIVE)
        finally:
            conn.close()
        affinity = [tuple(i for i, on in enumerate(m) if on) for m in mask]
        assert affinity == [(cpu,) for cpu in info["pinned_cpus"]]
        # the host gave the guest its pages
        pages = shape["memory_bytes"] // shape["backing_page_size"]
        assert info["hugepages"] == [{"node": 0, "page_size": 2 << 20, "pages": pages}]
        assert hugepages_free() == free_before - pages
        # admission: as declared -> accepted; divergent -> FAILED_PRECONDITION naming the difference
        ok = shim.runtime.CreateContainer(
            pb.CreateContainerRequest(
                pod_sandbox_id=sid, config=container("web", q({"cpu": "1000m", "memory": "128Mi"}))
            ),
            timeout=30,
        )
        assert ok.container_id
        with pytest.raises(grpc.RpcError) as err:
            shim.runtime.CreateContainer(
                pb.CreateContainerRequest(
                    pod_sandbox_id=sid,
                    config=container("cache", q({"cpu": "500m", "memory": "1Gi", "hugepages-2Mi": "32Mi"})),
                ),
                timeout=30,
            )
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert 'container "cache": limits.memory declared 64Mi, requested 1Gi' in str(err.value.details())
        assert 'container "cache": requests.memory declared 64Mi, requested 1Gi' in str(err.value.details())
        # nothing running was disturbed
        st = shim.runtime.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=sid), timeout=30)
        assert st.status.state == pb.SANDBOX_READY
    finally:
        stop_remove(shim, sid)
    assert hugepages_free() == free_before
    assert our_domains(shim) == []
    assert claims_in_ledger(shim) == 0


def test_guest_that_never_reports_is_rolled_back(shim: Shim) -> None:
    free_before = hugepages_free()
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        shim.runtime.RunPodSandbox(pb.RunPodSandboxRequest(config=pod("silent"), runtime_handler="broken"), timeout=120)
    elapsed = time.monotonic() - started
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    details = str(err.value.details())
    assert "test/silent" in details and "8" in details and "rolled back" in details
    assert elapsed < 8 + 45  # the profile's 8 s boot timeout plus tear-down (generous: CI hosts are shared)
    assert our_domains(shim) == []
    assert claims_in_ledger(shim) == 0
    assert hugepages_free() == free_before
    assert shim.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items == []
    # the shim keeps serving, and the host is whole: a pod taking every CPU still fits
    sid = shim.runtime.RunPodSandbox(
        pb.RunPodSandboxRequest(config=pod("after", containers=[("app", q({"cpu": "2", "memory": "64Mi"}))])),
        timeout=300,
    ).pod_sandbox_id
    stop_remove(shim, sid)


def test_two_pods_that_cannot_both_fit(shim: Shim) -> None:
    """Each pod wants every CPU the shim owns: exactly one wins, the other is told why."""
    free_before = hugepages_free()
    results: list[object] = [None, None]

    def run(i: int) -> None:
        config = pod(f"race-{i}", containers=[("app", q({"cpu": "2", "memory": "64Mi"}))])
        try:
            results[i] = shim.runtime.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=300).pod_sandbox_id
        except grpc.RpcError as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [r for r in results if isinstance(r, str)]
    losers = [r for r in results if isinstance(r, grpc.RpcError)]
    assert len(winners) == 1 and len(losers) == 1, results
    assert losers[0].code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "cpu on node 0: need 2, free 0 (short by 2)" in str(losers[0].details())
    stop_remove(shim, winners[0])
    assert our_domains(shim) == []
    assert claims_in_ledger(shim) == 0
    assert hugepages_free() == free_before
