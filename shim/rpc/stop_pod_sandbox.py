"""StopPodSandbox: a pod's guest and what it holds on the host let go; its record stays, NOTREADY.

Its steps, in order (``shim.rpc``: each a fault point):

- ``node-ports-closed``: a host-network pod's node ports, and the connections relayed through them;
- ``guest-destroyed``: its QEMU gone;
- ``domain-removed``: its libvirt domain undefined;
- ``claims-released``: its CPUs, pages, memory and devices free for other pods;
- ``notready``: its containers EXITED, its row NOTREADY;
- ``network-detached``: CNI DEL of its pod network (the namespace stays until RemovePodSandbox);
- ``containers-stopped``: the copies of its containers' logs, its agent connection let go;
- ``plugins-told``: the NRI plugins told of its containers' and its own stop.

A stop has nothing to undo: each step only lets go. A failure part-way leaves a sandbox that the
same RPC called again finishes, as the kubelet calls it until it succeeds: every step finds what
is gone already and goes on (unknown ids and repeats succeed). RemovePodSandbox runs the same
steps first (``stop_steps``).
"""

from __future__ import annotations

import logging

from shim import rpc
from shim.model import SANDBOX_NOTREADY, SandboxRecord, StopPodSandbox
from shim.pods import Pods

log = logging.getLogger(__name__)

RPC = "StopPodSandbox"
STOP_STEPS = (
    "node-ports-closed",
    "guest-destroyed",
    "domain-removed",
    "claims-released",
    "notready",
    "network-detached",
    "containers-stopped",
)
rpc.declare(RPC, *STOP_STEPS, "plugins-told")


def stop_pod_sandbox(pods: Pods, request: StopPodSandbox) -> None:
    record = find(pods, request.sandbox_id)
    if record is None:
        return
    with rpc.steps(RPC) as s:
        stop_steps(pods, record, s)
        pods.nri.sandbox_stopped(record)
        s.done("plugins-told")


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
    s.done("node-ports-closed")
    with sb.locks.lock_for(sandbox_id):
        current = sb.records.find(sandbox_id)
        if current is not None:  # else removed meanwhile, by a call that stopped it first
            sb.hypervisor.destroy(current.domain)
            s.done("guest-destroyed")
            sb.hypervisor.teardown(current.domain)
            s.done("domain-removed")
            sb.resources.release(sandbox_id)
            s.done("claims-released")
            sb.records.exit_containers(sandbox_id, reason="SandboxStopped")
            if current.state != SANDBOX_NOTREADY:
                sb.records.put_sandbox(current.with_state(SANDBOX_NOTREADY))
                log.info("sandbox %s stopped: domain %s removed, resources released", sandbox_id[:12], current.domain)
            s.done("notready")
            sb.network.detach(sandbox_id)  # raises while CNI DEL fails; the next stop tries again
            s.done("network-detached")
    pods.containers.sandbox_stopped(sandbox_id)
    s.done("containers-stopped")
