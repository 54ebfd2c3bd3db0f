"""PullImage: an image brought from its registry, verified, made into a disk and named.

The steps, each undone should a later one fail (``shim.rpc``):

==========  ==========================================================  =================================
step        what it did                                                 its undo
==========  ==========================================================  =================================
blobs       the manifest, config and layers in the blob store, as the   those no other image (or pull in
            registry served them, held in flight                        flight) uses deleted
disk        the layers unpacked and checked, the image's read-only      the disk deleted unless another
            disk made, checked and in place, held in flight             image uses it
catalogue   the catalogue names the image (its tag taken from any       every record it wrote as it was
            other image), its blobs and disk no longer in flight        before
==========  ==========================================================  =================================

An image stored already with its disk (verified against its config, its id, whatever manifest
names it now) takes the catalogue step alone. A shim killed after ``blobs`` or ``disk`` leaves
what the catalogue does not name, which the next start deletes. Concurrent pulls of one reference
(and the same credentials) share one run of these steps and its answer, pulls of one image by
different names run them one at a time (``ImageStore.single_flight``, ``ImageStore.image_lock``).
"""

from __future__ import annotations

from functools import partial

from shim import rpc
from shim.image_store import ImageStore, Pulling
from shim.model import PullImage

RPC = "PullImage"
rpc.declare(RPC, "blobs", "disk", "catalogue")


def pull_image(store: ImageStore, req: PullImage) -> str:
    """The image id of ``req.ref``, pulled unless it is stored."""
    return store.single_flight(req.ref, req.creds, partial(_pull, store, req))


def _pull(store: ImageStore, req: PullImage) -> tuple[str, int]:
    resolved = store.resolve(req.ref, req.creds)
    image_id = resolved.manifest.config.digest
    with store.image_lock(image_id), rpc.steps(RPC) as s:
        record = store.stored(image_id)
        pulling: Pulling | None = None
        if record is None:
            with store.work_dir() as work:
                pulling = store.download(req.ref, resolved, req.creds, work)
                s.done("blobs", partial(store.drop_blobs, pulling))
                record = store.unpack(pulling, work)
                s.done("disk", partial(store.drop_disk, pulling))
        else:
            s.done("blobs")
            s.done("disk")
        named = store.name(record, req.ref, resolved.top_digest, pulling)
        s.done("catalogue", partial(store.unname, named))
    return image_id, pulling.fetched if pulling is not None else 0
