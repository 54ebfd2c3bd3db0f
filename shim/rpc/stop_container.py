"""StopContainer: a container's stop signal, SIGKILL after its grace period, its exit recorded.

An id that names no container of ours (another runtime's kind of id included) is stopped
already: that succeeds, as containerd answers. Otherwise the container's record is read once and
brought up to date with its guest. Then the steps; none has an undo, as a stop cannot be taken
back: a stop that fails at any of them leaves what the kubelet's next StopContainer finishes
(each step does nothing when it was done already):

===========  =================================================================================
step         what it did
===========  =================================================================================
guest-stop   a running container was sent its stop signal and, still running after the
             timeout, SIGKILL, and it exited
exited       its exit recorded as its guest says it (one that never ran: stopped before it
             started), its log copied to the end, its volumes let go
nri-stopped  NRI plugins told StopContainer
===========  =================================================================================
"""

from __future__ import annotations

from shim import rpc
from shim.model import CONTAINER_CREATED, CONTAINER_EXITED, StopContainer
from shim.pods import Pods

RPC = "StopContainer"
rpc.declare(RPC, "guest-stop", "exited", "nri-stopped")


def stop_container(pods: Pods, req: StopContainer) -> None:
    c = pods.records.find_container(req.container_id) if req.container_id is not None else None
    if c is None:
        return
    containers = pods.containers
    sandbox = pods.records.get(c.sandbox_id)
    c = containers.refresh(c, sandbox)
    with rpc.steps(RPC) as s:
        if c.image_id and c.state not in (CONTAINER_CREATED, CONTAINER_EXITED):
            containers.stop_in_guest(c, req.timeout_s)
        s.done("guest-stop")
        c = containers.record_stop(c, sandbox)
        s.done("exited")
        pods.nri.container_stopped(sandbox, c)
        s.done("nri-stopped")
