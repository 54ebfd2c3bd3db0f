"""CreateContainer: a container admitted into its pod, then made in the pod's guest.

Before any step nothing changes: the pod's record is read (once: every step is given it), the
container's user namespace checked to be the pod's (``vmsandbox.userns``), NRI
plugins adjust the container (a refusal, or an adjustment that leaves the pod's declaration or
VM, fails the RPC) and its host paths are checked, once, against the kubelet's pod directory and
the allowlist (``ContainerMounts.plan``). Then the steps, each undone should a later one fail
(``shim.rpc``); a pod an earlier version started is refused once the container is admitted:

===================  ====================================================  ==================================
step                 what it did                                           its undo
===================  ====================================================  ==================================
admit                admitted against the pod's declaration and VM, and    the record removed
                     recorded CREATED, naming no image yet
hold-image           its image held for it                                 released
hold-volume-images   the images of its image volumes held for it           released
container-dir        its directory in the pod's share                      its binds detached, the directory
                                                                           removed
volumes              guest copies of its atomic-writer volumes             released (a copy no other
                                                                           container uses is removed)
binds                its host paths bound into the guest's QEMU            detached
attach-disk          its image's disk in the guest (hot-plugged unless     detached, unless another
                     the pod has it)                                       container uses it
attach-volume-disks  the disks of its image volumes' images likewise       each detached likewise
                     (once per guest, whoever uses them)
guest-create         the guest made the container                          deleted in the guest
mark-created         the record names its image: the container exists      (the record goes with admit's)
node-ports           a host-network pod's privileged node ports opened,    closed again
                     for a container holding CAP_NET_BIND_SERVICE
nri-created          NRI plugins told PostCreateContainer                  told RemoveContainer
===================  ====================================================  ==================================

The pod's ``resolv.conf`` and ``hostname`` in its share are the pod's, written by its first
container and kept for the others: no step's. A shim killed after ``admit`` and before
``mark-created`` leaves a record naming no image, which the next start forgets with its guest
side (``Containers.reconcile_with_guests``): the kubelet never got its id.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from functools import partial

from shim import rpc
from shim.container_mounts import hugepage_mounts
from shim.model import CreateContainer, image_volumes
from shim.pods import Pods
from vmsandbox import oci_spec, userns
from vmsandbox.network import NET_BIND_SERVICE

log = logging.getLogger(__name__)

RPC = "CreateContainer"
rpc.declare(
    RPC,
    "admit",
    "hold-image",
    "hold-volume-images",
    "container-dir",
    "volumes",
    "binds",
    "attach-disk",
    "attach-volume-disks",
    "guest-create",
    "mark-created",
    "node-ports",
    "nri-created",
)


def create_container(pods: Pods, req: CreateContainer) -> str:
    """The new container's id."""
    records, containers, mounts = pods.records, pods.containers, pods.containers.mounts
    sandbox = records.get(req.sandbox_id)
    userns.check_same(sandbox.userns, req.run.userns, f'container "{req.spec.name}"')  # the pod's, or refused
    run = replace(req.run, hostname=sandbox.hostname)  # the pod's, whatever the request says
    spec, run, asked = pods.nri.adjust_container(sandbox, req.spec, run)
    planned = mounts.plan(sandbox, asked)
    what = f'container "{spec.name}" of sandbox {sandbox.id[:12]}'
    with rpc.steps(RPC, partial(_failed, what)) as s:
        c = containers.admission.admit(sandbox, spec, req.container_id)
        s.done("admit", partial(records.remove_container, c.id))
        containers.check_takes_containers(sandbox)  # after admission, whose refusal says more
        image, held = containers.hold_image(c)
        s.done("hold-image", partial(containers.images.release, image.id, c.id))
        volume_helds, volume_images = containers.hold_volume_images(c, image_volumes(asked))
        s.done("hold-volume-images", partial(containers.release_volume_images, c, volume_images))
        mounts.make_container_dir(sandbox, c.id)
        s.done("container-dir", partial(mounts.drop_container_dir, sandbox, c.id))
        by_index = mounts.attach_volumes(sandbox, c.id, planned)
        s.done("volumes", partial(containers.volumes.release, sandbox.id, c.id))
        by_index |= mounts.bind(sandbox, c.id, planned)
        s.done("binds", partial(mounts.unbind_container, sandbox, c.id))
        image_binds, image_mounts = mounts.image_volume_mounts(tuple(asked), volume_helds)
        by_index |= image_binds
        guest_mounts = tuple(by_index[i] for i in sorted(by_index))
        guest_mounts += mounts.pod_file_mounts(sandbox, {m.destination for m in guest_mounts})
        guest_mounts += hugepage_mounts(c.linux, guest_mounts)
        run = replace(run, mounts=guest_mounts)
        oci, signal = containers.guest_spec(c, run, req.user, req.stop_signal, image, held)
        lower, attached = mounts.attach_image(sandbox, held)
        s.done("attach-disk", partial(mounts.detach_unused, sandbox, held, attached))
        volume_disks = mounts.attach_volume_images(sandbox, volume_helds)
        s.done("attach-volume-disks", partial(mounts.detach_volume_images, sandbox, volume_disks))
        containers.create_in_guest(c, lower, oci, run, image_mounts)
        s.done("guest-create", partial(containers.delete_in_guest, c))
        net_bind = pods.host_ports is not None and oci_spec.has_capability(run, NET_BIND_SERVICE)
        c = containers.mark_created(c, sandbox, image, signal, run, net_bind, volume_images)
        s.done("mark-created")
        if pods.host_ports is not None and net_bind:
            granted = pods.host_ports.grant_privileged(sandbox.id)
            s.done("node-ports", partial(pods.host_ports.withdraw, sandbox.id, granted))
        else:
            s.done("node-ports")
        pods.nri.container_created(sandbox, c)
        s.done("nri-created", partial(pods.nri.container_removed, sandbox, c))
    return c.id


def _failed(what: str, exc: BaseException, outcome: str) -> None:
    log.info("CreateContainer of %s failed (%s); %s", what, exc, outcome)
