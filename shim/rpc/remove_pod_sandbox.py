"""RemovePodSandbox: a pod stopped (as StopPodSandbox stops it) and then forgotten.

A removal has nothing to undo, as a stop has not: a removal that fails at any step leaves what
the same RPC called again finishes (unknown ids and repeats succeed), since the row, which that
one finds the sandbox by, goes last, and every step before does nothing when it was done
already. The steps: the stop's (``stop_pod_sandbox.STOP_STEPS``), then

=================  ==========================================================================
step               what it did
=================  ==========================================================================
containers-forget  its containers' guest side forgotten (image holds, log copies, binds) and
                   its sandbox directory removed
network-remove     its network namespace and the record of its pod network removed
console-log        its guest's console log removed
nri-removed        NRI plugins told RemoveContainer for its containers, then RemovePodSandbox
record             its row and its containers' rows deleted, its name free for a new sandbox
=================  ==========================================================================
"""

from __future__ import annotations

from shim import rpc
from shim.console_logs import remove_console_log
from shim.model import RemovePodSandbox
from shim.pods import Pods
from shim.rpc.stop_pod_sandbox import STOP_STEPS, find, stop_steps

RPC = "RemovePodSandbox"
rpc.declare(RPC, *STOP_STEPS, "containers-forget", "network-remove", "console-log", "nri-removed", "record")


def remove_pod_sandbox(pods: Pods, req: RemovePodSandbox) -> None:
    record = find(pods, req.sandbox_id)
    if record is None:
        return
    sb = pods.sandboxes
    sandbox_id = record.id  # paths below are built from the id of a row we wrote, never the client's
    members = sb.records.containers(sandbox_id)
    with rpc.steps(RPC) as s:
        stop_steps(pods, record, s)
        pods.containers.sandbox_removed(sandbox_id)
        s.done("containers-forget")
        with sb.locks.lock_for(sandbox_id):
            sb.network.remove(sandbox_id)
            s.done("network-remove")
            remove_console_log(sb.config.console_dir, sandbox_id)
            s.done("console-log")
        pods.nri.sandbox_removed(record, members)
        s.done("nri-removed")
        with sb.locks.lock_for(sandbox_id):
            sb.records.release_name(record.meta, sandbox_id)
            sb.records.delete_sandbox(sandbox_id)
            s.done("record")
    sb.locks.forget(sandbox_id)
    pods.forget_rates(sandbox_id, *(c.id for c in members))
