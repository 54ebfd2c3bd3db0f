"""StopPodSandbox: a pod's guest and what it holds on the host let go; its record stays, NOTREADY.

A stop has nothing to undo: each step only lets go. A stop that fails at any of them leaves what
the same RPC called again finishes, as the kubelet calls it until it succeeds: every step does
nothing when it was done already (unknown ids and repeats succeed). RemovePodSandbox runs the
same steps first (``stop_steps``):

===============  ============================================================================
step             what it did
===============  ============================================================================
node-ports       a host-network pod's node ports closed, and the connections relayed there
loopback-        a shim-mode pod's loopback forward closed: its rule in the namespace deleted,
forward          its listener and the connections relayed there closed
guest-destroy    its QEMU gone
undefine         its libvirt domain undefined
release          its CPUs, pages, memory and devices free for other pods
notready         its containers EXITED, its row NOTREADY
network-detach   CNI DEL of its pod network (the namespace stays until RemovePodSandbox)
containers-stop  the copies of its containers' logs and its agent connection let go
nri-stopped      NRI plugins told StopContainer for its containers, then StopPodSandbox
===============  ============================================================================
"""

from __future__ import annotations

import logging

from shim import rpc
from shim.model import SANDBOX_NOTREADY, SandboxRecord, StopPodSandbox
from shim.pods import Pods

log = logging.getLogger(__name__)

RPC = "StopPodSandbox"
STOP_STEPS = (
    "node-ports",
    "loopback-forward",
    "guest-destroy",
    "undefine",
    "release",
    "notready",
    "network-detach",
    "containers-stop",
)
rpc.declare(RPC, *STOP_STEPS, "nri-stopped")


def stop_pod_sandbox(pods: Pods, req: StopPodSandbox) -> None:
    record = find(pods, req.sandbox_id)
    if record is None:
        return
    with rpc.steps(RPC) as s:
        stop_steps(pods, record, s)
        pods.nri.sandbox_stopped(record)
        s.done("nri-stopped")


def find(pods: Pods, sandbox_id: str | None) -> SandboxRecord | None:
    """The sandbox a Stop or Remove names; None for an id that names nothing here (another
    runtime's kind of id, an unknown one), since stopping or removing what is not there succeeds."""
    return None if sandbox_id is None else pods.records.find(sandbox_id)


def stop_steps(pods: Pods, record: SandboxRecord, s: rpc.Steps) -> None:
    """The steps of a stop, ``STOP_STEPS``, for StopPodSandbox and RemovePodSandbox (``s``)."""
    sb = pods.sandboxes
    sandbox_id = record.id
    if pods.host_ports is not None:
        pods.host_ports.close(sandbox_id)
    s.done("node-ports")
    if pods.loopback_forwards is not None:
        pods.loopback_forwards.close(sandbox_id)
    s.done("loopback-forward")
    with sb.locks.lock_for(sandbox_id):
        current = sb.records.find(sandbox_id)
        if current is not None:  # else removed meanwhile, by a call that stopped it first
            sb.hypervisor.destroy(current.domain)
            s.done("guest-destroy")
            sb.hypervisor.teardown(current.domain)
            s.done("undefine")
            sb.resources.release(sandbox_id)
            s.done("release")
            sb.records.exit_containers(sandbox_id, reason="SandboxStopped")
            if current.state != SANDBOX_NOTREADY:
                sb.records.put_sandbox(current.with_state(SANDBOX_NOTREADY))
                log.info("sandbox %s stopped: domain %s removed, resources released", sandbox_id[:12], current.domain)
            s.done("notready")
            sb.network.detach(sandbox_id)  # raises while CNI DEL fails; the next stop tries again
            s.done("network-detach")
    pods.containers.sandbox_stopped(sandbox_id)
    s.done("containers-stop")
