"""``ImageRouter.ensure`` (``shim.proxy.split_images``): before a container is created on one side,
each image it needs (its own and its image volumes') that only the other store holds is pulled
there, once, by the name the other store knows it by."""

from __future__ import annotations

from typing import Any

import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from shim.proxy.split_images import ImageRouter
from vmsandbox.routing import Side

DIGEST = "sha256:" + "d" * 64  # the repo digest each store knows an image by


class _Stores:
    """Both stores as ``ensure`` asks them: which images each holds, and the pulls it was asked for."""

    def __init__(self, local: set[str], downstream: set[str]) -> None:
        self.held = {Side.LOCAL: local, Side.DOWNSTREAM: downstream}
        self.pulls: list[tuple[Side, str]] = []

    def status(self, side: Side, image: str, context: Any) -> pb.ImageStatusResponse:
        if image not in self.held[side]:
            return pb.ImageStatusResponse()
        return pb.ImageStatusResponse(image=pb.Image(id=image, repo_tags=[image], repo_digests=[f"{image}@{DIGEST}"]))

    def mine(self, name: str, cls: Any, data: bytes, context: Any) -> None:
        assert name == "PullImage"
        self.pulls.append((Side.LOCAL, cls.FromString(data).image.image))

    def theirs(self, name: str, data: bytes, context: Any) -> bytes:
        self.pulls.append((Side.DOWNSTREAM, pb.PullImageRequest.FromString(data).image.image))
        return b""


@pytest.mark.parametrize(
    ("local", "downstream", "pulled"),
    [
        ({"app:1", "data:1"}, set(), []),
        # named by one of its tags: pulled by that tag, so that the store knows it by that name
        ({"app:1"}, {"data:1"}, [(Side.LOCAL, "docker.io/library/data:1")]),
        (
            set(),
            {"app:1", "data:1"},
            [(Side.LOCAL, "docker.io/library/app:1"), (Side.LOCAL, "docker.io/library/data:1")],
        ),
        ({"app:1"}, set(), []),  # in neither store: the create answers as the side alone would
    ],
)
def test_the_images_of_image_volumes_are_made_up_for_as_the_containers_is(
    monkeypatch: pytest.MonkeyPatch, local: set[str], downstream: set[str], pulled: list[tuple[Side, str]]
) -> None:
    stores = _Stores(local, downstream)
    router = ImageRouter(None, None, lambda uid: None)  # type: ignore[arg-type]
    monkeypatch.setattr(router, "_status", stores.status)
    monkeypatch.setattr(router, "_mine", stores.mine)
    monkeypatch.setattr(router, "_theirs", stores.theirs)
    config = pb.ContainerConfig(
        image=pb.ImageSpec(image="app:1"),
        mounts=[
            pb.Mount(container_path="/d", image=pb.ImageSpec(image="data:1")),
            pb.Mount(container_path="/e", image=pb.ImageSpec(image="data:1"), image_sub_path="x"),  # once
            pb.Mount(container_path="/h", host_path="/srv"),
        ],
    )
    router.ensure(Side.LOCAL, pb.CreateContainerRequest(config=config), None)  # type: ignore[arg-type]
    assert stores.pulls == pulled
