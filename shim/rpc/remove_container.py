"""RemoveContainer: a container gone from its guest, the host and the records.

An id that names no container of ours (another runtime's kind of id included) is removed
already: that succeeds, as containerd answers. Otherwise the container's record and its pod's
are read once. Then the steps; none has an undo, as a removal is not taken back: a removal that
fails at any of them leaves what the kubelet's next RemoveContainer finishes, since the record,
which that one finds the container by, goes last, and every step before does nothing when it was
done already:

=============  ===============================================================================
step           what it did
=============  ===============================================================================
log-copy       its log copy stopped, and where it stood forgotten
guest-delete   its guest deleted it (killed first if it ran; a guest that does not answer
               keeps it until the pod goes)
volumes        it uses no guest copy of a volume (one no other container uses is removed)
container-dir  its binds detached and its directory in the pod's share removed
image          its image, and its image volumes' images, no longer held for it (one removed
               while held is freed)
nri-removed    NRI plugins told RemoveContainer
record         its record gone
=============  ===============================================================================
"""

from __future__ import annotations

from shim import rpc
from shim.model import RemoveContainer
from shim.pods import Pods

RPC = "RemoveContainer"
rpc.declare(RPC, "log-copy", "guest-delete", "volumes", "container-dir", "image", "nri-removed", "record")


def remove_container(pods: Pods, req: RemoveContainer) -> None:
    c = pods.records.find_container(req.container_id) if req.container_id is not None else None
    if c is None:
        return
    containers = pods.containers
    sandbox = pods.records.get(c.sandbox_id)
    with rpc.steps(RPC) as s:
        containers.logs.forget(c.id)  # first: no read of its log races its deletion
        s.done("log-copy")
        if c.image_id:
            containers.delete_in_guest(c)
        s.done("guest-delete")
        containers.volumes.release(sandbox.id, c.id)
        s.done("volumes")
        containers.mounts.drop_container_dir(sandbox, c.id)
        s.done("container-dir")
        if c.image_id:
            containers.images.release(c.image_id, c.id)
        containers.release_volume_images(c, c.volume_images)
        s.done("image")
        pods.nri.container_removed(sandbox, c)
        s.done("nri-removed")
        pods.records.remove_container(c.id)
        containers.forget_lock(c.id)
        pods.forget_rates(c.id)
        s.done("record")
