"""StopContainer's steps (``shim.rpc.stop_container``) against a pod whose guest is a fake agent
(``tests/container_kit.py``): a stop cannot be taken back, so a fault after any step leaves what the
kubelet's next StopContainer finishes: the container exited in its guest and recorded so, its log
copy ended, its volume binds let go, NRI plugins told."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shim import faults, rpc
from shim.model import CONTAINER_EXITED, StartContainer, StopContainer
from shim.rpc.create_container import create_container
from shim.rpc.start_container import start_container
from shim.rpc.stop_container import stop_container
from tests.container_kit import Pod, running_pod

pytest.importorskip("libvirt")


@pytest.fixture
def pod(monkeypatch: pytest.MonkeyPatch) -> Iterator[Pod]:
    with running_pod(monkeypatch) as p:
        yield p


def _running(pod: Pod) -> str:
    cid = create_container(pod.pods, pod.create_request())
    start_container(pod.pods, StartContainer(cid))
    return cid


def _assert_stopped(pod: Pod, cid: str) -> None:
    c = pod.pods.records.container(cid)
    assert (c.state, c.exit_code, c.reason) == (CONTAINER_EXITED, 137, "Error")
    assert pod.agent.containers == {cid: "exited"}
    assert pod.pods.containers.logs.copying() == set()
    assert len(pod.vm.binds) == 1  # the image's disk stays attached while the pod runs; the volume is let go
    assert ("StopContainer", cid) in pod.nri.told


def test_a_stopped_container_exits(pod: Pod) -> None:
    cid = _running(pod)
    stop_container(pod.pods, StopContainer(cid, 0))
    _assert_stopped(pod, cid)
    stop_container(pod.pods, StopContainer(cid, 0))  # again: nothing more to do
    _assert_stopped(pod, cid)
    stop_container(pod.pods, StopContainer("f" * 64, 0))  # no such container: stopped already
    stop_container(pod.pods, StopContainer(None, 0))  # another runtime's id


@pytest.mark.parametrize("point", rpc.rpc_points("StopContainer"))
def test_a_fault_after_any_step_leaves_what_a_retry_finishes(pod: Pod, point: str) -> None:
    cid = _running(pod)
    with faults.raising(point), pytest.raises(faults.InjectedFault, match=point):
        stop_container(pod.pods, StopContainer(cid, 0))
    stop_container(pod.pods, StopContainer(cid, 0))  # the kubelet's retry
    _assert_stopped(pod, cid)
