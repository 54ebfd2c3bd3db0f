"""``runtime.v1.ImageService``: a thin servicer over ``ImageStore``.

Each method translates the request (``shim.translate``), calls the store (PullImage and
RemoveImage: their steps, ``shim.rpc.pull_image`` and ``shim.rpc.remove_image``), translates the
answer.
``ImageFsInfo`` reports the image store (blobs, unpacked trees and their disks) as the image file
system, and as the container one what the sandboxes' guests wrote on the host (each sandbox's
directory is a file system of its own: one ``statvfs`` each, ``SandboxDirs.total_usage``), the
containers' writable layers (kept in their guests' memory; ``Containers.writable_usage`` asks the
guests) and the state directory's own files. Nothing a guest can write is walked: a guest shapes
those trees as it likes (nested past any recursion limit, millions of entries), and the kubelet's
image garbage collection and eviction wait on this call.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc

from gen.cri.runtime.v1 import api_pb2 as pb
from gen.cri.runtime.v1 import api_pb2_grpc as pb_grpc
from shim.image_store import ImageStore
from shim.rpc.pull_image import pull_image
from shim.rpc.remove_image import remove_image
from shim.status import rpc
from shim.translate import image_fields

_MAX_TOP_ENTRIES = 4096
"""Entries of the state directory looked at, at most (it holds a few: the database, directories)."""


def _own_files(root: Path) -> tuple[int, int]:
    """(bytes, inodes) of the regular files directly in ``root`` (the state database and its
    journal): one directory read, nothing below it."""
    used = inodes = 0
    try:
        with os.scandir(root) as entries:
            for i, e in enumerate(entries):
                if i >= _MAX_TOP_ENTRIES:
                    break
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if e.is_file(follow_symlinks=False):
                    used += st.st_blocks * 512
                    inodes += 1
    except OSError:
        pass
    return used, inodes


class ImageServicer(pb_grpc.ImageServiceServicer):
    def __init__(
        self,
        store: ImageStore,
        state_dir: str,
        writable_layers: Callable[[], tuple[int, int]] = lambda: (0, 0),
        shares: Callable[[], tuple[int, int]] = lambda: (0, 0),
    ) -> None:
        self.store = store
        self.state_dir = Path(state_dir)
        # (bytes, inodes) of the containers' writable layers, which live in their guests' memory
        self.writable_layers = writable_layers
        # (bytes, inodes) the sandboxes' guests wrote on the host, each in its own file system
        self.shares = shares

    @rpc
    def PullImage(self, request: pb.PullImageRequest, context: grpc.ServicerContext) -> pb.PullImageResponse:
        return pb.PullImageResponse(image_ref=pull_image(self.store, image_fields.pull_image(request)))

    @rpc
    def ImageStatus(self, request: pb.ImageStatusRequest, context: grpc.ServicerContext) -> pb.ImageStatusResponse:
        text = image_fields.image_text(request.image, "ImageStatusRequest.image")
        record = self.store.get(text)
        if record is None:
            return pb.ImageStatusResponse()  # absent: no image, no error (the kubelet then pulls)
        return pb.ImageStatusResponse(
            image=image_fields.image(record), info=image_fields.image_info(record) if request.verbose else {}
        )

    @rpc
    def ListImages(self, request: pb.ListImagesRequest, context: grpc.ServicerContext) -> pb.ListImagesResponse:
        query = request.filter.image.image if request.HasField("filter") else ""
        return pb.ListImagesResponse(images=[image_fields.image(r) for r in self.store.list(query)])

    @rpc
    def RemoveImage(self, request: pb.RemoveImageRequest, context: grpc.ServicerContext) -> pb.RemoveImageResponse:
        remove_image(self.store, image_fields.remove_image(request))
        return pb.RemoveImageResponse()

    @rpc
    def ImageFsInfo(self, request: pb.ImageFsInfoRequest, context: grpc.ServicerContext) -> pb.ImageFsInfoResponse:
        now = time.time_ns()
        stored = self.store.usage()
        used, inodes = _own_files(self.state_dir)
        for more, more_inodes in (self.shares(), self.writable_layers()):
            used, inodes = used + more, inodes + more_inodes
        return pb.ImageFsInfoResponse(
            image_filesystems=[image_fields.filesystem_usage(str(self.store.root), stored.bytes, stored.inodes, now)],
            container_filesystems=[image_fields.filesystem_usage(str(self.state_dir), used, inodes, now)],
        )

    @rpc
    def StreamImages(
        self, request: pb.StreamImagesRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.StreamImagesResponse]:
        raise NotImplementedError("StreamImages: streaming list RPCs are not served yet")
