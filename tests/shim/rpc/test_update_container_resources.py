"""UpdateContainerResources' steps (``shim.rpc.update_container_resources``) against a pod whose
guest is a fake agent (``tests/container_kit.py``): a fault injected after any step leaves the
container's recorded limits as they were, and its guest given them again."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shim import faults, rpc
from shim.model import StartContainer, UpdateContainerResources
from shim.rpc.create_container import create_container
from shim.rpc.start_container import start_container
from shim.rpc.update_container_resources import update_container_resources
from tests.container_kit import Pod, running_pod
from vmsandbox.errors import CannotFit, Diverged, InfrastructureError
from vmsandbox.sizing import LinuxResources

pytest.importorskip("libvirt")

BEFORE = {"memory.max": str(32 << 20), "cpu.max": "20000 100000"}  # as the kit's config asks
NEW = LinuxResources(cpu_period=100_000, cpu_quota=30_000, memory_limit_bytes=48 << 20)


@pytest.fixture
def pod(monkeypatch: pytest.MonkeyPatch) -> Iterator[Pod]:
    with running_pod(monkeypatch) as p:
        yield p


def _running(pod: Pod) -> str:
    cid = create_container(pod.pods, pod.create_request())
    start_container(pod.pods, StartContainer(cid))
    return cid


def test_an_update_is_recorded_and_applied(pod: Pod) -> None:
    cid = _running(pod)
    update_container_resources(pod.pods, UpdateContainerResources(cid, None, NEW))
    assert pod.pods.records.container(cid).linux == NEW
    assert pod.agent.cgroup[cid] == {"memory.max": str(48 << 20), "cpu.max": "30000 100000"}
    assert pod.nri.told[-1] == ("PostUpdateContainer", cid)


@pytest.mark.parametrize("point", rpc.rpc_points("UpdateContainerResources"))
def test_a_fault_after_any_step_leaves_the_limits_as_they_were(pod: Pod, point: str) -> None:
    cid = _running(pod)
    before = pod.leftovers()
    with faults.raising(point), pytest.raises(faults.InjectedFault, match=point):
        update_container_resources(pod.pods, UpdateContainerResources(cid, None, NEW))
    after = pod.leftovers()
    applied = point not in ("UpdateContainerResources:grow", "UpdateContainerResources:record")
    assert after == {**before, "guest cgroups": {cid: BEFORE} if applied else {}}


def test_an_update_the_guest_refuses_leaves_the_record_as_it_was(pod: Pod) -> None:
    cid = _running(pod)
    before = pod.leftovers()
    pod.agent.refuse.add("update")
    with pytest.raises(InfrastructureError, match="update failed in the guest"):
        update_container_resources(pod.pods, UpdateContainerResources(cid, None, NEW))
    assert pod.leftovers() == before


def test_an_update_beyond_the_vm_is_refused_and_changes_nothing(pod: Pod) -> None:
    cid = _running(pod)
    before = pod.leftovers()
    beyond = LinuxResources(cpu_period=100_000, cpu_quota=500_000, memory_limit_bytes=4 << 30)
    with pytest.raises((CannotFit, Diverged), match='update of "app"'):
        update_container_resources(pod.pods, UpdateContainerResources(cid, None, beyond))
    assert pod.leftovers() == before
