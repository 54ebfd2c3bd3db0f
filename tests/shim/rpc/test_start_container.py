"""StartContainer's steps (``shim.rpc.start_container``) against a pod whose guest is a fake agent
(``tests/container_kit.py``): a fault injected after any step leaves the container not running,
its log not copied and its record as it was; a start cannot be taken back in the guest, so the
guest's container is killed (its next status is its exit)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shim import faults, rpc
from shim.model import CONTAINER_CREATED, CONTAINER_EXITED, CONTAINER_RUNNING, StartContainer
from shim.rpc.create_container import create_container
from shim.rpc.start_container import start_container
from tests.container_kit import Pod, running_pod
from vmsandbox.errors import InfrastructureError, WrongState

pytest.importorskip("libvirt")


@pytest.fixture
def pod(monkeypatch: pytest.MonkeyPatch) -> Iterator[Pod]:
    with running_pod(monkeypatch) as p:
        yield p


def test_a_started_container_runs_and_its_log_is_copied(pod: Pod) -> None:
    cid = create_container(pod.pods, pod.create_request())
    start_container(pod.pods, StartContainer(cid[:12]))  # a prefix names it
    assert pod.pods.records.container(cid).state == CONTAINER_RUNNING
    assert pod.agent.containers == {cid: "running"}
    assert pod.pods.containers.logs.copying() == {cid}
    assert pod.nri.told[-1] == ("PostStartContainer", cid)
    with pytest.raises(WrongState, match="it can start only once"):
        start_container(pod.pods, StartContainer(cid))


@pytest.mark.parametrize("point", rpc.rpc_points("StartContainer"))
def test_a_fault_after_any_step_leaves_it_not_running(pod: Pod, point: str) -> None:
    cid = create_container(pod.pods, pod.create_request())
    before = pod.leftovers()
    with faults.raising(point), pytest.raises(faults.InjectedFault, match=point):
        start_container(pod.pods, StartContainer(cid))
    after = pod.leftovers()
    started = point != "StartContainer:log-copy"
    assert after == {**before, "guest containers": {cid: "exited" if started else "created"}}
    assert pod.pods.containers.refresh(pod.pods.records.container(cid)).state == (
        CONTAINER_EXITED if started else CONTAINER_CREATED
    )


def test_a_guest_that_refuses_the_start_leaves_it_as_it_was(pod: Pod) -> None:
    cid = create_container(pod.pods, pod.create_request())
    before = pod.leftovers()
    pod.agent.refuse.add("start")
    with pytest.raises(InfrastructureError, match="start failed in the guest"):
        start_container(pod.pods, StartContainer(cid))
    assert pod.leftovers() == before
    pod.agent.refuse.clear()
    start_container(pod.pods, StartContainer(cid))  # the kubelet's retry
    assert pod.agent.containers == {cid: "running"}
