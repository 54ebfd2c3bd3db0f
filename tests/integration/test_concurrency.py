"""Ten simultaneous RunPodSandbox calls on a host that fits exactly four: four guests boot, six are
told RESOURCE_EXHAUSTED naming the resource, and nothing leaks.

This host has 2 CPUs, so "fits four" comes from the hugepage budget: the pods are ``shared``
(they float over the shared CPU pool and claim no CPU) and the shim may hand out exactly four
pods' worth of 2 MiB pages. The claims go through one ledger transaction each, under a unique
constraint, so the count is exact, not a race.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml

from gen.cri.runtime.v1 import api_pb2 as pb
from tests.integration.state_check import assert_consistent, read_domains, read_ledger, vmsandbox_free_baseline
from tests.shim_kit import IMAGE_DIR, Shim, pod, q, require_host, start_shim, stop_shim
from vmsandbox.adapters.profile_loader import load_profiles
from vmsandbox.resources import ContainerDeclaration, ContainerResources, PodDeclaration, ResourceList
from vmsandbox.sizing import demand_from_declaration, shape_for

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.exclusive]

CALLS = 10
FITS = 4
RPC_TIMEOUT = 300  # four TCG guests booting at once on two cores
APP = {"cpu": "500m", "memory": "64Mi"}


def pages_per_pod(profiles: Path) -> int:
    """The 2 MiB pages one test pod's guest needs, from the same sizing code the shim runs."""
    profile = load_profiles([profiles])["vmsandbox"]
    resources = ContainerResources(
        requests=ResourceList.parse(APP, where="requests"), limits=ResourceList.parse(APP, where="limits")
    )
    declaration = PodDeclaration(init_containers=(), containers=(ContainerDeclaration("app", resources),))
    shape = shape_for(demand_from_declaration(declaration, profile), profile)
    assert shape.backing_page_size == 2 << 20 and shape.cpu_policy == "shared"
    return shape.backing_pages


@pytest.fixture
def tight_host(tmp_path: Path) -> Iterator[tuple[Shim, int, int]]:
    require_host()
    profiles = tmp_path / "tight-profiles.yaml"
    profiles.write_text(
        yaml.safe_dump(
            {
                "name": "vmsandbox",
                "handler": "vmsandbox",
                "cpu_policy": "shared",
                "guest": {"image_dir": str(IMAGE_DIR), "boot_timeout_s": 240},
                "snapshots": False,  # a snapshot being made holds a pod's worth of the host: counts are exact here
            }
        )
    )
    pages = pages_per_pod(profiles)
    baseline = vmsandbox_free_baseline()
    shim = start_shim(
        tmp_path,
        extra_config={"profile_files": [str(profiles)], "hugepages": {"2Mi": FITS * pages}, "shared_cpus": "0-1"},
    )
    try:
        yield shim, pages, baseline
    finally:
        try:
            for s in shim.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items:
                shim.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=s.id), timeout=RPC_TIMEOUT)
                shim.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=s.id), timeout=RPC_TIMEOUT)
        finally:
            stop_shim(shim)
            shutil.rmtree(tmp_path, ignore_errors=True)


def test_ten_simultaneous_pods_on_a_host_that_fits_four(tight_host: tuple[Shim, int, int]) -> None:
    shim, pages, baseline = tight_host
    results: list[str | grpc.RpcError | None] = [None] * CALLS
    barrier = threading.Barrier(CALLS)

    def run(i: int) -> None:
        config = pod(f"crowd-{i}", containers=[("app", q(APP))])
        barrier.wait()
        try:
            results[i] = shim.runtime.RunPodSandbox(
                pb.RunPodSandboxRequest(config=config), timeout=RPC_TIMEOUT
            ).pod_sandbox_id
        except grpc.RpcError as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(CALLS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    winners = [r for r in results if isinstance(r, str)]
    losers = [r for r in results if isinstance(r, grpc.RpcError)]
    assert len(winners) == FITS and len(losers) == CALLS - FITS, [
        r if isinstance(r, str) else (r.code() if r else None, r.details() if r else None) for r in results
    ]
    for err in losers:
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
        assert f"hugepages-2Mi on node 0: need {pages} pages, free 0" in str(err.details()), err.details()
    # the four are whole: READY, each with its own pages, none held twice, libvirt agrees
    for sid in winners:
        st = shim.runtime.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=sid), timeout=30)
        assert st.status.state == pb.SANDBOX_READY
    led = assert_consistent(shim.state_dir, baseline)
    assert sorted(led.rows) == sorted(winners)
    assert sum(c.page_count for c in led.claims.values()) == FITS * pages
    assert set(led.claims) == set(winners)
    # the losers left nothing behind: no row, no domain, no claim
    assert sorted(d.sandbox_id for d in read_domains() if d.owner == led.instance) == sorted(winners)

    for sid in winners:
        shim.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=RPC_TIMEOUT)
        shim.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=RPC_TIMEOUT)
    led = assert_consistent(shim.state_dir, baseline)
    assert led.rows == {} and led.claims == {}
    assert not [d for d in read_domains() if d.owner == read_ledger(shim.state_dir).instance]
    # and the budget is whole again: a fifth pod fits now
    sid = shim.runtime.RunPodSandbox(
        pb.RunPodSandboxRequest(config=pod("after-crowd", containers=[("app", q(APP))])), timeout=RPC_TIMEOUT
    ).pod_sandbox_id
    shim.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=RPC_TIMEOUT)
    shim.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=RPC_TIMEOUT)
    assert_consistent(shim.state_dir, baseline)


CROWD = 50


def test_fifty_simultaneous_pods_on_a_two_cpu_pool_refuse_fast(tmp_path: Path) -> None:
    """50 RunPodSandbox at once on a pool of 2 exclusive CPUs, 1 vCPU each: exactly 2 boot and 48 are
    refused RESOURCE_EXHAUSTED while those 2 are still booting (placement never waits for a boot)."""
    require_host()
    profiles = tmp_path / "two-cpu-profiles.yaml"
    profiles.write_text(
        yaml.safe_dump(
            {
                "name": "vmsandbox",
                "handler": "vmsandbox",
                "cpu_policy": "exclusive",
                "guest": {"image_dir": str(IMAGE_DIR), "boot_timeout_s": 240},
                "snapshots": False,
            }
        )
    )
    baseline = vmsandbox_free_baseline()
    shim = start_shim(tmp_path, extra_config={"profile_files": [str(profiles)], "cpu_pool": "0-1", "workers": 64})
    results: list[str | grpc.RpcError | None] = [None] * CROWD
    answered = [0.0] * CROWD
    barrier = threading.Barrier(CROWD)
    try:

        def run(i: int) -> None:
            config = pod(f"crowd-{i}", containers=[("app", q(APP))])  # 500m: one vCPU, one pinned CPU
            barrier.wait()
            start = time.monotonic()
            try:
                results[i] = shim.runtime.RunPodSandbox(
                    pb.RunPodSandboxRequest(config=config), timeout=RPC_TIMEOUT
                ).pod_sandbox_id
            except grpc.RpcError as exc:
                results[i] = exc
            answered[i] = time.monotonic() - start

        threads = [threading.Thread(target=run, args=(i,)) for i in range(CROWD)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners = [r for r in results if isinstance(r, str)]
        losers = [(r, answered[i]) for i, r in enumerate(results) if isinstance(r, grpc.RpcError)]
        assert len(winners) == 2 and len(losers) == CROWD - 2, [
            r if isinstance(r, str) else (r.code(), r.details()) if r else None for r in results
        ]
        for err, _ in losers:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
            assert "cpu" in str(err.details()).lower(), err.details()
        slowest_refusal = max(seconds for _, seconds in losers)
        first_boot = min(answered[i] for i, r in enumerate(results) if isinstance(r, str))
        print(f"50 on 2 CPUs: slowest refusal {slowest_refusal:.3f} s, first guest ready {first_boot:.3f} s")
        assert slowest_refusal < first_boot, (slowest_refusal, first_boot)  # refused before any guest boots
        led = assert_consistent(shim.state_dir, baseline)
        assert sorted(led.rows) == sorted(winners)
        assert set(led.claims) == set(winners)
        for sid in winners:
            shim.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=RPC_TIMEOUT)
            shim.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=RPC_TIMEOUT)
        led = assert_consistent(shim.state_dir, baseline)
        assert led.rows == {} and led.claims == {}
    finally:
        try:
            for s in shim.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items:
                shim.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=s.id), timeout=RPC_TIMEOUT)
                shim.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=s.id), timeout=RPC_TIMEOUT)
        finally:
            stop_shim(shim)
