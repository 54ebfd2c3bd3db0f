"""RemoveImage: the whole image a reference or id names (every tag), as containerd removes it.

The steps; none is undone: a removal that stops half-way is finished by the next RemoveImage of
the image (it finds the hidden image again: ``ImageStore.find_for_removal``) or at the next start
(``ImageStore.collect``).

======  ===================================================================================
step    what it did
======  ===================================================================================
hide    the catalogue hides the image: no lookup, list or pull sees it any more; while
        containers hold it, the removal ends here and its last holder's release frees it
free    its disk and the blobs no other image (or pull in flight) uses deleted
forget  the catalogue forgets it
======  ===================================================================================

An image that is not stored is removed already: that succeeds.
"""

from __future__ import annotations

from shim import rpc
from shim.image_store import ImageStore
from shim.model import RemoveImage

RPC = "RemoveImage"
rpc.declare(RPC, "hide", "free", "forget")


def remove_image(store: ImageStore, req: RemoveImage) -> str | None:
    """The id of the image removed (None: there was none)."""
    record = store.find_for_removal(req.image)
    if record is None:
        return None
    with rpc.steps(RPC) as s:
        held = store.hide(record.id)
        s.done("hide")
        if held:
            return record.id
        store.free(record.id)
        s.done("free")
        store.forget(record.id)
        s.done("forget")
    return record.id
