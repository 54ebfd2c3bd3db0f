"""CreateContainer's steps (``shim.rpc.create_container``) against a pod whose guest is a fake agent
(``tests/container_kit.py``): a fault injected after any step, a guest that refuses, or a request
refused half-way leaves nothing behind on the host or in the guest, and the kubelet's retry then
succeeds."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from shim import faults, rpc
from shim.model import CONTAINER_CREATED
from shim.rpc.create_container import create_container
from tests.container_kit import IMAGE_ID, VOLUME_IMAGE_ID, Pod, running_pod
from vmsandbox.errors import InfrastructureError, InvalidArgument, NotFound, WrongState

pytest.importorskip("libvirt")


@pytest.fixture
def pod(monkeypatch: pytest.MonkeyPatch) -> Iterator[Pod]:
    with running_pod(monkeypatch) as p:
        yield p


def test_a_container_is_made_on_the_host_and_in_the_guest(pod: Pod) -> None:
    before = pod.leftovers()
    cid = create_container(pod.pods, pod.create_request())
    after = pod.leftovers()
    c = pod.pods.records.container(cid)
    assert (c.state, c.image_id, c.net_bind_service) == (CONTAINER_CREATED, IMAGE_ID, True)
    assert pod.agent.containers == {cid: "created"}
    assert after["image holders"] == 1 and len(pod.vm.disks) == 1
    assert len(pod.vm.binds) == 2  # the image's disk and the plain volume; the ConfigMap is a copy
    assert len(pod.agent.volumes) == 1 and list(pod.pods.containers.volumes.users(pod.sandbox_id).values()) == [
        frozenset({cid})
    ]
    assert after["container dirs"] == [cid] and before["container dirs"] == []
    assert after["node port open"] and not before["node port open"]
    assert pod.nri.told == [("PostCreateContainer", cid)]


@pytest.mark.parametrize("point", rpc.rpc_points("CreateContainer"))
def test_a_fault_after_any_step_leaves_nothing_behind(pod: Pod, point: str) -> None:
    before = pod.leftovers()
    with faults.raising(point), pytest.raises(faults.InjectedFault, match=point):
        create_container(pod.pods, pod.create_request())
    assert pod.leftovers() == before
    if point.endswith(":nri-created"):  # plugins told of it are told it is gone
        assert [event for event, _ in pod.nri.told] == ["PostCreateContainer", "RemoveContainer"]
    else:
        assert pod.nri.told == []
    cid = create_container(pod.pods, pod.create_request())  # the kubelet's retry
    assert pod.agent.containers == {cid: "created"}


@pytest.mark.parametrize("op", ["create", "volume_commit"])
def test_a_guest_that_refuses_leaves_nothing_behind(pod: Pod, op: str) -> None:
    before = pod.leftovers()
    pod.agent.refuse.add(op)
    with pytest.raises(InfrastructureError, match=f"{op} failed in the guest"):
        create_container(pod.pods, pod.create_request())
    assert pod.leftovers() == before


def test_a_second_containers_failure_leaves_what_the_first_uses(pod: Pod) -> None:
    first = create_container(pod.pods, pod.create_request("first"))
    shared = pod.leftovers()
    with faults.raising("CreateContainer:nri-created"), pytest.raises(faults.InjectedFault):
        create_container(pod.pods, pod.create_request("second"))
    assert pod.leftovers() == shared  # the image's disk, the volume's copy and the node port stay
    assert pod.agent.containers == {first: "created"}


def _not_pulled(config: pb.ContainerConfig) -> None:
    config.image.image = "registry.test/absent:1"


def _other_pods_path(config: pb.ContainerConfig) -> None:
    config.mounts.add(container_path="/etc/host", host_path="/etc")


def _unreadable_seccomp_profile(config: pb.ContainerConfig) -> None:
    config.linux.security_context.seccomp.CopyFrom(
        pb.SecurityProfile(profile_type=pb.SecurityProfile.Localhost, localhost_ref="absent.json")
    )


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        (_not_pulled, NotFound, "is not pulled"),
        (_other_pods_path, InvalidArgument, "is not allowed"),
        (_unreadable_seccomp_profile, InvalidArgument, "cannot be read"),
    ],
)
def test_a_refused_create_leaves_nothing_behind(
    pod: Pod, change: Callable[[pb.ContainerConfig], None], error: type[Exception], message: str
) -> None:
    before = pod.leftovers()
    config = pod.config()
    change(config)
    with pytest.raises(error, match=message):
        create_container(pod.pods, pod.create_request(config=config))
    assert pod.leftovers() == before


@pytest.mark.parametrize(
    ("security", "opens"),
    [
        (pb.LinuxContainerSecurityContext(), True),  # the default set has NET_BIND_SERVICE
        (pb.LinuxContainerSecurityContext(capabilities=pb.Capability(drop_capabilities=["NET_BIND_SERVICE"])), False),
        (pb.LinuxContainerSecurityContext(capabilities=pb.Capability(drop_capabilities=["ALL"])), False),
        (
            pb.LinuxContainerSecurityContext(
                capabilities=pb.Capability(drop_capabilities=["ALL"], add_capabilities=["NET_BIND_SERVICE"])
            ),
            True,
        ),
        (
            pb.LinuxContainerSecurityContext(privileged=True, capabilities=pb.Capability(drop_capabilities=["ALL"])),
            True,
        ),
    ],
)
def test_a_privileged_node_port_opens_with_a_container_that_could_bind_it(
    pod: Pod, security: pb.LinuxContainerSecurityContext, opens: bool
) -> None:
    config = pod.config()
    config.linux.security_context.CopyFrom(security)
    cid = create_container(pod.pods, pod.create_request(config=config))
    assert pod.pods.records.container(cid).net_bind_service is opens
    assert pod.node_port_open() is opens
    assert pod.pods.host_ports is not None
    pod.pods.host_ports.close(pod.sandbox_id)  # a shim started again opens them as the container's record says
    pod.pods.resume_node_ports()
    assert pod.node_port_open() is opens


# -- image volumes (KEP-4639) ----------------------------------------------------------------------
def test_image_volumes_are_their_images_disks_attached_once_and_held(pod: Pod) -> None:
    cid = create_container(pod.pods, pod.create_request(config=pod.image_volume_config()))
    c = pod.pods.records.container(cid)
    images = pod.pods.containers.images
    assert c.volume_images == (VOLUME_IMAGE_ID, IMAGE_ID)
    # one disk per image in the guest, whether a root or volumes (two of one image) use it
    assert len(pod.vm.disks) == 2
    assert images.holders(VOLUME_IMAGE_ID) == 1 and images.holders(IMAGE_ID) == 2  # the root's and the volume's
    args = pod.agent.creates[cid]
    root_serial = str(args["lower"]).removeprefix("disks/")
    (volume_serial,) = set(pod.vm.disks) - {root_serial}
    assert args["image_mounts"] == [
        {"destination": "/vol", "serial": volume_serial, "sub_path": ""},
        {"destination": "/vol-etc", "serial": volume_serial, "sub_path": "etc"},
        {"destination": "/self", "serial": root_serial, "sub_path": ""},
    ]
    spec = args["spec"]
    assert isinstance(spec, dict)
    binds = [(m["destination"], m["options"]) for m in spec["mounts"] if m["type"] == "bind"]
    # in the kubelet's order, after the host paths, each read-only
    assert [d for d, _ in binds][:5] == ["/data", "/etc/config", "/vol", "/vol-etc", "/self"]
    assert all(opts == ["rbind", "ro"] for d, opts in binds[2:5])


@pytest.mark.parametrize("point", rpc.rpc_points("CreateContainer"))
def test_a_fault_after_any_step_with_image_volumes_leaves_nothing_behind(pod: Pod, point: str) -> None:
    before = pod.leftovers()
    config = pod.image_volume_config()
    with faults.raising(point), pytest.raises(faults.InjectedFault, match=point):
        create_container(pod.pods, pod.create_request(config=config))
    assert pod.leftovers() == before
    cid = create_container(pod.pods, pod.create_request(config=config))  # the kubelet's retry
    assert pod.agent.containers == {cid: "created"} and len(pod.vm.disks) == 2


def test_a_second_containers_failure_leaves_the_volume_disk_the_first_uses(pod: Pod) -> None:
    first = create_container(pod.pods, pod.create_request("first", pod.image_volume_config("first")))
    shared = pod.leftovers()
    with faults.raising("CreateContainer:guest-create"), pytest.raises(faults.InjectedFault):
        create_container(pod.pods, pod.create_request("second", pod.image_volume_config("second")))
    assert pod.leftovers() == shared and len(pod.vm.disks) == 2
    assert pod.agent.containers == {first: "created"}


def _volume_not_pulled(config: pb.ContainerConfig) -> None:
    config.mounts.add(container_path="/v", image=pb.ImageSpec(image="registry.test/absent:1"))


def test_an_image_volume_of_an_image_not_pulled_leaves_nothing_behind(pod: Pod) -> None:
    before = pod.leftovers()
    config = pod.image_volume_config()
    _volume_not_pulled(config)
    with pytest.raises(NotFound, match=r"registry\.test/absent:1' of an image volume is not pulled"):
        create_container(pod.pods, pod.create_request(config=config))
    assert pod.leftovers() == before


def test_an_image_volume_is_refused_in_the_guest_of_an_older_agent(pod: Pod) -> None:
    before = pod.leftovers()
    pod.agent.PROTOCOL = 6
    with pytest.raises(WrongState, match="an image volume needs protocol 7"):
        create_container(pod.pods, pod.create_request(config=pod.image_volume_config()))
    assert pod.leftovers() == before
    create_container(pod.pods, pod.create_request())  # a container without one is made there
