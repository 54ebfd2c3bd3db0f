"""UpdatePodSandboxResources: the pod-level resources the kubelet now gives a pod, recorded when
they fit its VM (which cannot grow: ``FAILED_PRECONDITION`` otherwise), then told to NRI plugins.

Its steps, in order (``shim.rpc``: each a fault point, each undo pushed as its step succeeds):

- ``recorded``: the record holds the new resources (undo: the ones it held before);
- ``plugins-told``: the NRI plugins told of the update (UpdatePodSandbox, PostUpdatePodSandbox).
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
rpc.declare(RPC, "recorded", "plugins-told")


def update_pod_sandbox_resources(pods: Pods, request: UpdatePodSandboxResources) -> None:
    sb = pods.sandboxes
    sandbox_id = sb.records.get(request.sandbox_id).id
    with rpc.steps(RPC) as s:
        with sb.locks.lock_for(sandbox_id):
            record = sb.records.get(sandbox_id)
            demand = record.sized_shape().demand
            usage = admission.Usage.of_linux(request.resources)
            admission.check_envelope(demand, [], usage, who="the pod's new resources")
            sb.records.put_sandbox(replace(record, updated_resources=request.resources))
            s.done("recorded", functools.partial(_put_back, sb, sandbox_id, record.updated_resources))
        pods.nri.sandbox_updated(sandbox_id, request.overhead, request.resources)
        s.done("plugins-told")


def _put_back(sb: Sandboxes, sandbox_id: str, resources: LinuxResources) -> None:
    """The record's resources as they were before the update (the rest of it as it is now)."""
    with sb.locks.lock_for(sandbox_id):
        current = sb.records.find(sandbox_id)
        if current is not None:
            sb.records.put_sandbox(replace(current, updated_resources=resources))
