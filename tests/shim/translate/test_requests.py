"""The container and image RPCs' requests become one value each, checked once, at the translation
edge (shim.translate.inbound, shim.translate.image_fields): what nothing after it checks again."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gen.cri.apimachinery.resource.generated_pb2 import Quantity
from gen.cri.runtime.v1 import api_pb2 as pb
from shim.model import MountRequest, PullImage, RemoveContainer, RemoveImage, StopContainer
from shim.translate import image_fields, inbound
from vmsandbox.errors import InvalidArgument
from vmsandbox.image_ref import parse_reference
from vmsandbox.registries import Credentials

ID = "ab" * 32


def _create(config: pb.ContainerConfig | None = None, sandbox: str = ID) -> pb.CreateContainerRequest:
    request = pb.CreateContainerRequest(pod_sandbox_id=sandbox)
    if config is not None:
        request.config.CopyFrom(config)
    return request


@pytest.mark.parametrize(
    ("translate", "message"),
    [
        pytest.param(
            lambda: inbound.create_container(_create(pb.ContainerConfig(), sandbox="")),
            "CreateContainerRequest.pod_sandbox_id is empty",
            id="create-no-sandbox",
        ),
        pytest.param(
            lambda: inbound.create_container(_create(pb.ContainerConfig(), sandbox="../x")),
            "pod_sandbox_id",
            id="create-sandbox-no-id",
        ),
        pytest.param(
            lambda: inbound.create_container(_create()),
            "CreateContainerRequest.config is missing",
            id="create-no-config",
        ),
        pytest.param(
            lambda: inbound.create_container(_create(pb.ContainerConfig())),
            "ContainerConfig.metadata.name is empty",
            id="create-no-name",
        ),
        pytest.param(
            lambda: inbound.start_container(pb.StartContainerRequest()), "container_id is empty", id="start-no-id"
        ),
        pytest.param(
            lambda: inbound.start_container(pb.StartContainerRequest(container_id="x\x00")),
            "container_id",
            id="start-nul",
        ),
        pytest.param(
            lambda: inbound.stop_container(pb.StopContainerRequest(container_id=ID, timeout=-1)),
            "StopContainer timeout is negative (-1)",
            id="stop-negative-timeout",
        ),
        pytest.param(
            lambda: inbound.stop_container(pb.StopContainerRequest()), "container_id is empty", id="stop-no-id"
        ),
        pytest.param(
            lambda: inbound.remove_container(pb.RemoveContainerRequest()), "container_id is empty", id="remove-no-id"
        ),
        pytest.param(
            lambda: inbound.remove_container(pb.RemoveContainerRequest(container_id="../victim")),
            "container_id",
            id="remove-path",
        ),
        pytest.param(
            lambda: inbound.update_container_resources(
                pb.UpdateContainerResourcesRequest(
                    container_id=ID,
                    kubernetes_resources=pb.KubernetesResources(requests={"cpu": Quantity(string="1x")}),
                )
            ),
            'UpdateContainerResourcesRequest.kubernetes_resources: requests.cpu: invalid quantity "1x"',
            id="update-bad-quantity",
        ),
        pytest.param(
            lambda: inbound.update_container_resources(
                pb.UpdateContainerResourcesRequest(
                    container_id=ID, linux=pb.LinuxContainerResources(memory_limit_in_bytes=-1)
                )
            ),
            "UpdateContainerResourcesRequest.linux: cpu_period, cpu_shares and memory_limit_in_bytes must not be",
            id="update-negative-memory",
        ),
        pytest.param(
            lambda: image_fields.pull_image(pb.PullImageRequest()), "PullImageRequest.image: image is empty", id="pull"
        ),
        pytest.param(
            lambda: image_fields.pull_image(pb.PullImageRequest(image=pb.ImageSpec(image="UPPER/case"))),
            "UPPER/case",
            id="pull-bad-reference",
        ),
        pytest.param(
            lambda: image_fields.remove_image(pb.RemoveImageRequest()),
            "RemoveImageRequest.image: image is empty",
            id="remove-image",
        ),
    ],
)
def test_a_bad_request_is_refused_naming_what_is_wrong(translate: Callable[[], object], message: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        translate()
    assert message in str(err.value)


def test_another_runtimes_id_names_nothing_to_stop_or_remove() -> None:
    uuid = "4451902d-de8f-4af8-b0e6-bb69b88ad8b9"
    assert inbound.stop_container(pb.StopContainerRequest(container_id=uuid, timeout=3)) == StopContainer(None, 3)
    assert inbound.remove_container(pb.RemoveContainerRequest(container_id=uuid)) == RemoveContainer(None)
    assert inbound.remove_container(pb.RemoveContainerRequest(container_id="abcd")) == RemoveContainer("abcd")


def test_a_create_carries_its_mounts_once_in_their_order() -> None:
    config = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name="app"),
        mounts=[
            pb.Mount(container_path="/b", host_path="/h/b", readonly=True, selinux_relabel=True),
            pb.Mount(container_path="/a", host_path="/h/a", propagation=pb.PROPAGATION_BIDIRECTIONAL),
        ],
    )
    spec = inbound.create_container(_create(config)).spec
    assert spec.mounts == (
        MountRequest("/b", "/h/b", readonly=True, selinux_relabel=True),
        MountRequest("/a", "/h/a", propagation="bidirectional"),
    )
    assert spec.attachments.mounts == frozenset()
    # what admission compares with a declaration's mounts (translated from pod_resources)
    declared = inbound.declaration(
        pb.PodResourceConfig(containers=[pb.ContainerResourceConfig(name="app", mounts=list(config.mounts))])
    )
    assert spec.asked_attachments().mounts == declared.containers[0].resources.mounts


def test_a_pull_carries_its_reference_and_credentials() -> None:
    request = pb.PullImageRequest(image=pb.ImageSpec(image="busybox"), auth=pb.AuthConfig(username="u", password="p"))
    assert image_fields.pull_image(request) == PullImage(
        parse_reference("busybox"), Credentials(username="u", password="p")
    )
    assert image_fields.remove_image(pb.RemoveImageRequest(image=pb.ImageSpec(image="busybox"))) == RemoveImage(
        "busybox"
    )
