"""A task's root file system in shim mode: the image containerd pulled, as the disk vmsandbox's
guests take.

containerd's CRI plugin names the container's image in the spec's annotations and hands the task
its snapshot (``CreateTaskRequest.rootfs``). The image's id and names come from containerd's own
CRI ``ImageStatus`` on its socket; its config blob, read from containerd's content store and
checked against that id, gives its layers' ChainID; its layers are the snapshot's lower
directories (``vmsandbox.containerd_rootfs``). ``ImageStore.adopt`` makes the disk once per set
of layers (a disk the store has already, from a pull or an earlier container, is used as it is),
so an image is pulled by containerd only and converted at most once. The disk of an image
containerd no longer has (the kubelet's image GC removed it there), held by no container, is
removed by ``prune`` through RemoveImage's steps: the kubelet counts and collects containerd's
store only. An image volume containerd
mounted for a container (``vmsandbox.containerd_image_volume``) becomes an image of the store the
same way, its layers read from the mount table and its config by way of its manifest.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import grpc

from gen.cri.runtime.v1 import api_pb2 as cri
from gen.cri.runtime.v1 import api_pb2_grpc as cri_grpc
from shim.image_store import ImageStore
from shim.model import RemoveImage
from shim.rpc.remove_image import remove_image
from vmsandbox import validation
from vmsandbox.adapters.layer_view import merged
from vmsandbox.containerd_image_volume import MAX_MOUNTINFO_BYTES, ImageVolumeAt, mounted_layers
from vmsandbox.containerd_rootfs import RootfsMount, image_layers
from vmsandbox.errors import InfrastructureError, NotFound
from vmsandbox.oci import MAX_DOCUMENT, Index, parse_document, select_platform

log = logging.getLogger(__name__)

STATUS_TIMEOUT_S = 10.0


class ContainerdImages:
    """The images of the node's containerd, read through its CRI socket and its content store."""

    def __init__(self, address: str, content_root: str, store: ImageStore) -> None:
        self.address = address
        self.blobs = Path(content_root) / "blobs" / "sha256"
        self.store = store
        self._channel = grpc.insecure_channel(f"unix://{address}")
        self._images = cri_grpc.ImageServiceStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def _status(self, name: str) -> cri.Image:
        try:
            reply = self._images.ImageStatus(
                cri.ImageStatusRequest(image=cri.ImageSpec(image=name)), timeout=STATUS_TIMEOUT_S
            )
        except grpc.RpcError as exc:
            raise InfrastructureError(
                f"containerd ({self.address}) did not say what image {validation.quote(name)} is: {exc.details()}"
            ) from None
        if not reply.HasField("image") or not reply.image.id:
            raise NotFound(f"image {validation.quote(name)} is not in containerd's store")
        return reply.image

    def _config(self, image_id: str) -> bytes:
        return self._blob(image_id, f"image {image_id[:80]}: its config")

    def _blob(self, digest: str, what: str) -> bytes:
        """The content store's blob ``digest`` (a document: bounded, never through a symlink)."""
        hex_ = digest.removeprefix("sha256:")
        if not validation.is_full_id(hex_):
            raise InfrastructureError(f"{what} is named {validation.quote(digest[:80])}, not by a digest")
        try:
            fd = os.open(self.blobs / hex_, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                raise NotFound(f"{what} is not in containerd's content store") from None
            raise
        with os.fdopen(fd, "rb") as f:
            data = f.read(MAX_DOCUMENT + 1)
        if len(data) > MAX_DOCUMENT:
            raise InfrastructureError(f"{what} is larger than {MAX_DOCUMENT} bytes")
        return data

    def adopt(self, name: str, rootfs: Sequence[RootfsMount]) -> str:
        """The id of the image ``name`` in vmsandbox's store, its disk made from containerd's
        snapshot ``rootfs`` when the store has none of its layers yet."""
        layers = image_layers(rootfs)
        image = self._status(name)
        config = self._config(image.id)
        work = self.store.disk.work
        names = (tuple(image.repo_tags), tuple(image.repo_digests))
        return self.store.adopt(image.id, config, names, lambda: merged(layers, work)).id

    def adopt_volume(self, at: ImageVolumeAt) -> str | None:
        """The id, in vmsandbox's store, of the image containerd mounted as the image volume
        ``at``; None when no overlay is mounted there (then it is no image volume of containerd's)."""
        with open("/proc/self/mountinfo", "rb") as f:
            text = f.read(MAX_MOUNTINFO_BYTES).decode(errors="replace")
        layers = mounted_layers(text, at.root)
        if layers is None:
            return None
        what = f"image volume {at.manifest[:12]}"
        doc = parse_document(self._blob("sha256:" + at.manifest, f"{what}: its manifest"), what)
        if isinstance(doc, Index):
            chosen = select_platform(doc, what)
            doc = parse_document(self._blob(chosen.digest, f"{what}: its manifest"), what)
            if isinstance(doc, Index):
                raise InfrastructureError(f"{what}: an index within an index")
        image_id = doc.config.digest
        config = self._config(image_id)
        image = self._status(image_id)
        names = (tuple(image.repo_tags), tuple(image.repo_digests))
        work = self.store.disk.work
        return self.store.adopt(image_id, config, names, lambda: merged(layers, work)).id

    def prune(self) -> list[str]:
        """Remove from vmsandbox's store the images adopted from containerd (no blobs of their own)
        that containerd no longer has and no container holds; their ids. Nothing is removed while
        containerd does not answer."""
        removed = []
        for record in self.store.list():
            if record.blobs or self.store.holders(record.id):
                continue
            with self.store.image_lock(record.id):  # no adoption of it meanwhile
                try:
                    self._status(record.id)
                    continue
                except NotFound:
                    pass
                if self.store.holders(record.id) == 0 and remove_image(self.store, RemoveImage(record.id)):
                    removed.append(record.id)
        if removed:
            log.info("images containerd no longer has, removed from vmsandbox's store: %s", ", ".join(removed))
        return removed
