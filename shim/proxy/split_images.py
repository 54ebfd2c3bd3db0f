"""ImageService over two image stores: vmsandbox's (VM pods) and the downstream's (ordinary pods).

The rule (docs/sharing-the-node.md, "Images"):

- ``PullImage`` whose ``sandbox_config`` names a pod the proxy has routed pulls on that pod's side
  only; without a pod it knows (``crictl pull``, an unknown uid) it pulls on both sides.
- ``ImageStatus`` has no pod context: it answers present when either store holds the image (the
  downstream's answer first), since the kubelet reads the image's user from it after the pull.
- So the kubelet may skip the pull for a pod whose side lacks the image. ``CreateContainer`` makes
  up for it (``ensure``): when the pod's side does not hold the image the container names (or one
  its image volumes name), it is pulled there first, by the repo digest (else the tag) the other
  store knows it by, with the credentials the kubelet last gave for that repository; the container
  then starts on an image of its own store. The cost: the first container of an image on the side
  that lacks it waits for that pull inside ``CreateContainer``; an image both kinds of pods use is
  stored twice.
  With the downstream unreachable ``ImageStatus`` answers from vmsandbox's store alone, and a
  ``PullImage`` for both stores succeeds with vmsandbox's pull.
- ``ListImages`` is one entry per image id (both stores name an image by its config digest): the
  downstream's entry, with vmsandbox's names added. ``RemoveImage`` removes from both stores;
  each store keeps what its containers still use as it does alone. ``ImageFsInfo`` lists both
  stores' file systems, the downstream's first.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc

from gen.cri.runtime.v1 import api_pb2 as pb
from shim.proxy.downstream import Downstream, DownstreamUnavailable
from vmsandbox import routing
from vmsandbox.errors import InvalidArgument
from vmsandbox.routing import Side

SERVICE = "/runtime.v1.ImageService/"
AUTH_KEPT = 256  # repositories whose last credentials are kept for copies between the stores
log = logging.getLogger(__name__)


def _parse(cls: Any, data: bytes) -> Any:
    try:
        return cls.FromString(data)
    except Exception as exc:
        raise InvalidArgument(f"the request is not a valid {cls.DESCRIPTOR.full_name}: {exc}") from None


def merge_image_lists(theirs: pb.ListImagesResponse, mine: pb.ListImagesResponse) -> pb.ListImagesResponse:
    """One entry per image id: the downstream's message (unknown fields kept), vmsandbox's names added."""

    def entries(images: Any) -> list[routing.ImageEntry]:
        return [routing.ImageEntry(i.id, tuple(i.repo_tags), tuple(i.repo_digests), i.size) for i in images]

    out = pb.ListImagesResponse()
    for i, j in routing.merge_images(entries(theirs.images), entries(mine.images)):
        if i < 0:
            assert j is not None
            out.images.add().CopyFrom(mine.images[j])
            continue
        image = out.images.add()
        image.CopyFrom(theirs.images[i])
        if j is not None:
            other = mine.images[j]
            tags = routing.union(image.repo_tags, other.repo_tags)
            digests = routing.union(image.repo_digests, other.repo_digests)
            del image.repo_tags[:]
            image.repo_tags.extend(tags)
            del image.repo_digests[:]
            image.repo_digests.extend(digests)
            image.pinned = image.pinned or other.pinned
    return out


class ImageRouter:
    def __init__(self, local: Any, downstream: Downstream, side_of_pod: Callable[[str], Side | None]) -> None:
        self.local = local
        self.downstream = downstream
        self.side_of_pod = side_of_pod
        # a pull for both stores runs the downstream's beside vmsandbox's, within the caller's deadline
        self._beside = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="pull-downstream")
        # repository -> the credentials of its last PullImage, for ``ensure``'s copies (memory only)
        self._auth: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def _remember_auth(self, request: pb.PullImageRequest) -> None:
        if not request.HasField("auth"):
            return
        with self._lock:
            key = routing.repository(request.image.image)
            self._auth[key] = request.auth.SerializeToString()
            self._auth.move_to_end(key)
            while len(self._auth) > AUTH_KEPT:
                self._auth.popitem(last=False)

    def _status(self, side: Side, image: str, context: grpc.ServicerContext) -> pb.ImageStatusResponse:
        data = pb.ImageStatusRequest(image=pb.ImageSpec(image=image)).SerializeToString()
        if side == Side.LOCAL:
            reply: pb.ImageStatusResponse = self._mine("ImageStatus", pb.ImageStatusRequest, data, context)
            return reply
        return pb.ImageStatusResponse.FromString(self._theirs("ImageStatus", data, context))

    def ensure(self, side: Side, request: pb.CreateContainerRequest, context: grpc.ServicerContext) -> None:
        """Before a container is created on ``side``: pull its image, and those of its image
        volumes, there when only the other store has them."""
        images = [request.config.image.image, *(m.image.image for m in request.config.mounts)]
        for image in dict.fromkeys(i for i in images if i):
            self._ensure_one(side, image, request, context)

    def _ensure_one(
        self, side: Side, image: str, request: pb.CreateContainerRequest, context: grpc.ServicerContext
    ) -> None:
        if self._status(side, image, context).HasField("image"):
            return
        other = Side.DOWNSTREAM if side == Side.LOCAL else Side.LOCAL
        try:
            there = self._status(other, image, context)
        except DownstreamUnavailable:
            return  # nothing to copy from: the create answers as the side alone would
        source = (
            routing.copy_source(there.image.repo_digests, there.image.repo_tags, image)
            if there.HasField("image")
            else None
        )
        if source is None:
            return
        pull = pb.PullImageRequest(image=pb.ImageSpec(image=source), sandbox_config=request.sandbox_config)
        with self._lock:
            auth = self._auth.get(routing.repository(source))
        if auth is not None:
            pull.auth.ParseFromString(auth)
        log.info(
            "image %s is in the %s store only: pulling %s for a container on %s", image, other.value, source, side.value
        )
        data = pull.SerializeToString()
        if side == Side.LOCAL:
            self._mine("PullImage", pb.PullImageRequest, data, context)
        else:
            self._theirs("PullImage", data, context)

    def handler(self, name: str) -> Callable[[bytes, grpc.ServicerContext], bytes]:
        fn: Callable[[bytes, grpc.ServicerContext], bytes] = getattr(self, f"_{name}")
        return fn

    def _mine(self, name: str, cls: Any, data: bytes, context: grpc.ServicerContext) -> Any:
        return getattr(self.local, name)(_parse(cls, data), context)

    def _theirs(self, name: str, data: bytes, context: grpc.ServicerContext) -> bytes:
        return self.downstream.call(SERVICE + name, data, context)

    def _PullImage(self, data: bytes, context: grpc.ServicerContext) -> bytes:
        request = _parse(pb.PullImageRequest, data)
        self._remember_auth(request)
        side = self.side_of_pod(request.sandbox_config.metadata.uid) if request.HasField("sandbox_config") else None
        if side == Side.LOCAL:
            reply: bytes = self._mine("PullImage", pb.PullImageRequest, data, context).SerializeToString()
            return reply
        if side == Side.DOWNSTREAM:
            return self._theirs("PullImage", data, context)
        theirs = self._beside.submit(self._theirs, "PullImage", data, context)  # an unknown pod: both stores
        try:
            mine = self._mine("PullImage", pb.PullImageRequest, data, context)
        except BaseException:
            futures.wait([theirs])  # waited for even when vmsandbox's pull failed
            raise
        try:
            return theirs.result()
        except DownstreamUnavailable as exc:
            # the image is in vmsandbox's store; a container of the downstream's that needs it has
            # it copied there first (``ensure``), as for any image the other side pulled
            log.warning("PullImage: %s; pulled into vmsandbox's store only", exc)
            reply = mine.SerializeToString()
            return reply

    def _ImageStatus(self, data: bytes, context: grpc.ServicerContext) -> bytes:
        mine = self._mine("ImageStatus", pb.ImageStatusRequest, data, context)
        try:
            theirs = self._theirs("ImageStatus", data, context)
        except DownstreamUnavailable:
            reply: bytes = mine.SerializeToString()
            return reply
        if mine.HasField("image") and not pb.ImageStatusResponse.FromString(theirs).HasField("image"):
            mine_bytes: bytes = mine.SerializeToString()
            return mine_bytes
        return theirs  # present there, or in neither store: the downstream's answer as it is

    def _ListImages(self, data: bytes, context: grpc.ServicerContext) -> bytes:
        mine = self._mine("ListImages", pb.ListImagesRequest, data, context)
        theirs = pb.ListImagesResponse.FromString(self._theirs("ListImages", data, context))
        out: bytes = merge_image_lists(theirs, mine).SerializeToString()
        return out

    def _RemoveImage(self, data: bytes, context: grpc.ServicerContext) -> bytes:
        self._mine("RemoveImage", pb.RemoveImageRequest, data, context)
        return self._theirs("RemoveImage", data, context)

    def _ImageFsInfo(self, data: bytes, context: grpc.ServicerContext) -> bytes:
        mine: bytes = self._mine("ImageFsInfo", pb.ImageFsInfoRequest, data, context).SerializeToString()
        return self._theirs("ImageFsInfo", data, context) + mine
