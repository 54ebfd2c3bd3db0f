"""RemoveContainer's steps (``shim.rpc.remove_container``) against a pod whose guest is a fake agent
(``tests/container_kit.py``): a removal is not taken back, so a fault after any step leaves what
the kubelet's next RemoveContainer finishes: nothing of the container on the host or in its guest,
its image no longer held, NRI plugins told."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shim import faults, rpc
from shim.model import RemoveContainer, StartContainer
from shim.rpc.create_container import create_container
from shim.rpc.remove_container import remove_container
from shim.rpc.start_container import start_container
from tests.container_kit import Pod, running_pod

pytest.importorskip("libvirt")


@pytest.fixture
def pod(monkeypatch: pytest.MonkeyPatch) -> Iterator[Pod]:
    with running_pod(monkeypatch) as p:
        yield p


def _assert_gone(pod: Pod, before: dict[str, object], cid: str) -> None:
    after = pod.leftovers()
    # the image's disk stays attached until the pod goes, and the node port open while it runs
    kept = {k: after[k] for k in ("image disks", "disk users", "binds", "node port open")}
    assert after == {**before, **kept}
    assert len(pod.vm.disks) == 1 and len(pod.vm.binds) == 1 and after["node port open"]
    assert ("RemoveContainer", cid) in pod.nri.told


def test_a_running_container_is_removed(pod: Pod) -> None:
    before = pod.leftovers()
    cid = create_container(pod.pods, pod.create_request())
    start_container(pod.pods, StartContainer(cid))
    remove_container(pod.pods, RemoveContainer(cid[:12]))  # a prefix names it
    _assert_gone(pod, before, cid)
    remove_container(pod.pods, RemoveContainer(cid))  # again: removed already
    remove_container(pod.pods, RemoveContainer(None))  # another runtime's id
    _assert_gone(pod, before, cid)


@pytest.mark.parametrize("point", rpc.rpc_points("RemoveContainer"))
def test_a_fault_after_any_step_leaves_what_a_retry_finishes(pod: Pod, point: str) -> None:
    before = pod.leftovers()
    cid = create_container(pod.pods, pod.create_request())
    start_container(pod.pods, StartContainer(cid))
    with faults.raising(point), pytest.raises(faults.InjectedFault, match=point):
        remove_container(pod.pods, RemoveContainer(cid))
    remove_container(pod.pods, RemoveContainer(cid))  # the kubelet's retry
    _assert_gone(pod, before, cid)
    assert pod.pods.containers.images.holders(pod.pods.containers.images.list()[0].id) == 0


def test_a_guest_that_does_not_have_it_any_more_does_not_stop_the_removal(pod: Pod) -> None:
    before = pod.leftovers()
    cid = create_container(pod.pods, pod.create_request())
    pod.agent.containers.clear()  # as a guest that deleted it before the removal's fault
    remove_container(pod.pods, RemoveContainer(cid))
    _assert_gone(pod, before, cid)
    assert pod.pods.records.get(pod.sandbox_id).state == "SANDBOX_READY"  # no lost agent for that
