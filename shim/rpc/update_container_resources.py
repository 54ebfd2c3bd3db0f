"""UpdateContainerResources: a container's new cgroup limits, held to its pod's VM (grown into
the profile's resize headroom when they need it and it has some: ``vmsandbox.resize``), recorded
and applied.

The container's record and its pod's are read once; NRI plugins have their say on the new
limits (a refusal fails the RPC; their changes to other containers are carried out at once).
Then the steps, each undone should a later one fail (``shim.rpc``):

===========  ==================================================  ===================================
step         what it did                                         its undo
===========  ==================================================  ===================================
grow         the headroom the limits need is plugged into the    the growth recorded before (what
             guest and the pod's growth recorded                 was plugged stays: never unplugged)
record       the limits fit the VM beside the pod's other        the limits recorded before
             containers, and are recorded
guest        its guest applied them to the container's cgroup    its guest applies those before
nri-updated  NRI plugins told PostUpdateContainer                (nothing: plugins are not told of
                                                                 an update's undo)
===========  ==================================================  ===================================
"""

from __future__ import annotations

from functools import partial

from shim import pod_growth, rpc
from shim.model import UpdateContainerResources
from shim.pods import Pods

RPC = "UpdateContainerResources"
rpc.declare(RPC, "grow", "record", "guest", "nri-updated")


def update_container_resources(pods: Pods, req: UpdateContainerResources) -> None:
    containers = pods.containers
    c = pods.records.resolve_container(req.container_id)
    sandbox = pods.records.get(c.sandbox_id)
    linux = pods.nri.update_container(sandbox, c, req.linux)
    growth = containers.admission.growth(sandbox, c, req.resources, linux)
    before = sandbox.growth
    with rpc.steps(RPC) as s:
        sandbox = pod_growth.grow(pods.sandboxes, containers.hot_plug, sandbox, growth)
        s.done("grow", partial(pod_growth.put_growth, pods.sandboxes, c.sandbox_id, before))
        updated = containers.admission.update(sandbox, c, req.resources, linux)
        s.done("record", partial(containers.admission.restore, c))
        containers.apply_limits(updated)
        s.done("guest", partial(containers.apply_limits, c))
        pods.nri.container_updated(sandbox, updated)
        s.done("nri-updated")
