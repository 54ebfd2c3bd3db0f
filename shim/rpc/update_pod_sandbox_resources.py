"""UpdatePodSandboxResources: the pod-level resources the kubelet now gives a pod, recorded when
they fit its VM (which cannot grow: ``FAILED_PRECONDITION`` otherwise), then told to NRI plugins.

The steps, each undone should a later one fail (``shim.rpc``):

===========  ==================================================  ===================================
step         what it did                                         its undo
===========  ==================================================  ===================================
record       the new resources fit the VM and are recorded       the resources recorded before
nri-updated  NRI plugins told UpdatePodSandbox and               (nothing: plugins are not told of
             PostUpdatePodSandbox                                an update's undo)
===========  ==================================================  ===================================
"""

from __future__ import annotations

import functools
from dataclasses import replace

from shim import rpc
from shim.model import UpdatePodSandboxResources
from shim.pods import Pods
from shim.sandboxes import Sandboxes
from vmsandbox import admission
from vmsandbox.sizing import LinuxResources

RPC = "UpdatePodSandboxResources"
rpc.declare(RPC, "record", "nri-updated")


def update_pod_sandbox_resources(pods: Pods, req: UpdatePodSandboxResources) -> None:
    sb = pods.sandboxes
    sandbox_id = sb.records.get(req.sandbox_id).id
    with rpc.steps(RPC) as s:
        with sb.locks.lock_for(sandbox_id):
            record = sb.records.get(sandbox_id)
            demand = record.sized_shape().demand
            usage = admission.Usage.of_linux(req.resources)
            admission.check_envelope(demand, [], usage, who="the pod's new resources")
            sb.records.put_sandbox(replace(record, updated_resources=req.resources))
            s.done("record", functools.partial(_put_back, sb, sandbox_id, record.updated_resources))
        pods.nri.sandbox_updated(sandbox_id, req.overhead, req.resources)
        s.done("nri-updated")


def _put_back(sb: Sandboxes, sandbox_id: str, resources: LinuxResources) -> None:
    """The record's resources as they were before the update (the rest of it as it is now)."""
    with sb.locks.lock_for(sandbox_id):
        current = sb.records.find(sandbox_id)
        if current is not None:
            sb.records.put_sandbox(replace(current, updated_resources=resources))
