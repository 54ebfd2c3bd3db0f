"""UpdatePodSandboxResources: the pod-level resources the kubelet now gives a pod. They must fit
its VM: the demand it was sized for, grown into its profile's resize headroom when it has some
(``vmsandbox.resize``; ``FAILED_PRECONDITION`` beyond it, naming both). Then they are recorded and
told to NRI plugins.

The steps, each undone should a later one fail (``shim.rpc``):

===========  ==================================================  ===================================
step         what it did                                         its undo
===========  ==================================================  ===================================
grow         the headroom the new resources need is plugged      the growth recorded before (what
             into the guest and the pod's growth recorded        was plugged stays: never unplugged)
record       the new resources are recorded                      the resources recorded before
nri-updated  NRI plugins told UpdatePodSandbox and               (nothing: plugins are not told of
             PostUpdatePodSandbox                                an update's undo)
===========  ==================================================  ===================================
"""

from __future__ import annotations

import functools
from dataclasses import replace

from shim import pod_growth, rpc
from shim.model import UpdatePodSandboxResources
from shim.pods import Pods
from shim.sandboxes import Sandboxes
from vmsandbox import admission, resize
from vmsandbox.sizing import LinuxResources

RPC = "UpdatePodSandboxResources"
rpc.declare(RPC, "grow", "record", "nri-updated")


def update_pod_sandbox_resources(pods: Pods, req: UpdatePodSandboxResources) -> None:
    sb = pods.sandboxes
    record = sb.records.get(req.sandbox_id)
    sandbox_id = record.id
    usage = admission.Usage.of_linux(req.resources)
    growth = resize.pod_growth(record.sized_shape(), usage, who="the pod's new resources")
    with rpc.steps(RPC) as s:
        pod_growth.grow(sb, pods.containers.hot_plug, record, growth)
        s.done("grow", functools.partial(pod_growth.put_growth, sb, sandbox_id, record.growth))
        with sb.locks.lock_for(sandbox_id):
            current = sb.records.get(sandbox_id)
            sb.records.put_sandbox(replace(current, updated_resources=req.resources))
            s.done("record", functools.partial(_put_back, sb, sandbox_id, current.updated_resources))
        pods.nri.sandbox_updated(sandbox_id, req.overhead, req.resources)
        s.done("nri-updated")


def _put_back(sb: Sandboxes, sandbox_id: str, resources: LinuxResources) -> None:
    """The record's resources as they were before the update (the rest of it as it is now)."""
    with sb.locks.lock_for(sandbox_id):
        current = sb.records.find(sandbox_id)
        if current is not None:
            sb.records.put_sandbox(replace(current, updated_resources=resources))
