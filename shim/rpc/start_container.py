"""StartContainer: a created container started in its guest, its log copied to the kubelet's file.

The container's record is read once, under the container's lock (held to the end, so two starts
of one container never race), and must say CREATED and created in its guest; NRI plugins are
told StartContainer. Then the steps, each undone should a later one fail (``shim.rpc``):

============  ==================================================  ====================================
step          what it did                                         its undo
============  ==================================================  ====================================
log-copy      its log copied from the guest to the kubelet's      the copy stopped
              file
guest-start   the guest started it                                the guest kills it (its next status
                                                                  is its exit)
mark-running  the record says RUNNING, since the host's now       the record as it was
nri-started   NRI plugins told PostStartContainer                 (nothing: plugins are not told of
                                                                  a start's undo)
============  ==================================================  ====================================

A shim killed after ``guest-start`` leaves a record saying CREATED of a container its guest
runs, which the next start records RUNNING (``Containers.reconcile_with_guests``).
"""

from __future__ import annotations

from functools import partial

from shim import rpc
from shim.model import StartContainer
from shim.pods import Pods

RPC = "StartContainer"
rpc.declare(RPC, "log-copy", "guest-start", "mark-running", "nri-started")


def start_container(pods: Pods, req: StartContainer) -> None:
    records, containers = pods.records, pods.containers
    cid = records.resolve_container(req.container_id).id  # a client's prefix names one lock
    with containers.lock_for(cid):
        c = records.resolve_container(cid)
        containers.check_startable(c)
        sandbox = records.get(c.sandbox_id)
        pods.nri.container_starting(sandbox, c)
        with rpc.steps(RPC) as s:
            containers.start_log_copy(c)
            s.done("log-copy", partial(containers.logs.stop, c.id))
            st = containers.start_in_guest(c)
            s.done("guest-start", partial(containers.kill_in_guest, c))
            running = containers.mark_running(c, st)
            s.done("mark-running", partial(containers.mark_not_running, c))
            pods.nri.container_started(sandbox, running)
            s.done("nri-started")
