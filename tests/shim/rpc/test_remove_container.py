"""RemoveContainer's steps (``shim.rpc.remove_container``) against a pod whose guest is a fake agent
(``tests/container_kit.py``): a removal is not taken back, so a fault after any step leaves what
the kubelet's next RemoveContainer finishes: nothing of the container on the host or in its guest,
its image no longer held, NRI plugins told."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shim import faults, rpc
from shim.model import RemoveContainer, RemoveImage, StartContainer
from shim.rpc.create_container import create_container
from shim.rpc.remove_container import remove_container
from shim.rpc.remove_image import remove_image
from shim.rpc.start_container import start_container
from tests.container_kit import IMAGE_ID, VOLUME_IMAGE, VOLUME_IMAGE_ID, Pod, running_pod

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


def test_the_images_of_its_image_volumes_are_held_until_it_is_removed(pod: Pod) -> None:
    """RemoveImage of an image mounted as a volume does what it does for a container's own image:
    the image is hidden at once and its disk kept until its last holder lets go."""
    store = pod.pods.containers.images
    volume_disk = store.acquire(VOLUME_IMAGE_ID, "probe").disk
    store.release(VOLUME_IMAGE_ID, "probe")
    before = pod.leftovers()
    cid = create_container(pod.pods, pod.create_request(config=pod.image_volume_config()))
    assert remove_image(store, RemoveImage(VOLUME_IMAGE)) == VOLUME_IMAGE_ID
    assert store.get(VOLUME_IMAGE) is None and store.holders(VOLUME_IMAGE_ID) == 1 and volume_disk.exists()
    remove_container(pod.pods, RemoveContainer(cid))
    assert store.holders(VOLUME_IMAGE_ID) == 0 and store.holders(IMAGE_ID) == 0
    assert not volume_disk.exists()  # freed with its last holder
    after = pod.leftovers()
    # the disks stay attached until the pod goes, as a container's own image's disk does
    kept = {k: after[k] for k in ("image disks", "disk users", "binds", "node port open")}
    assert after == {**before, **kept} and len(pod.vm.disks) == 2


@pytest.mark.parametrize("point", rpc.rpc_points("RemoveContainer"))
def test_a_fault_after_any_step_with_image_volumes_leaves_what_a_retry_finishes(pod: Pod, point: str) -> None:
    before = pod.leftovers()
    cid = create_container(pod.pods, pod.create_request(config=pod.image_volume_config()))
    with faults.raising(point), pytest.raises(faults.InjectedFault, match=point):
        remove_container(pod.pods, RemoveContainer(cid))
    remove_container(pod.pods, RemoveContainer(cid))  # the kubelet's retry
    after = pod.leftovers()
    kept = {k: after[k] for k in ("image disks", "disk users", "binds", "node port open")}
    assert after == {**before, **kept}
    assert after["volume image holders"] == 0 and after["image holders"] == 0


def test_a_restarted_shim_holds_the_images_of_image_volumes_again(pod: Pod) -> None:
    cid = create_container(pod.pods, pod.create_request(config=pod.image_volume_config()))
    store = pod.pods.containers.images
    c = pod.pods.records.container(cid)
    store.release(IMAGE_ID, cid)
    pod.pods.containers.release_volume_images(c, c.volume_images)
    assert store.holders(VOLUME_IMAGE_ID) == 0
    assert pod.pods.containers.hold_images() == 1  # as a shim started again does, from the records
    assert store.holders(VOLUME_IMAGE_ID) == 1 and store.holders(IMAGE_ID) == 2
