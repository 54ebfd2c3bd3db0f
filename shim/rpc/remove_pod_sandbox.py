"""RemovePodSandbox: a pod stopped (as StopPodSandbox stops it) and then forgotten.

Its steps, in order (``shim.rpc``: each a fault point): the stop's (``stop_pod_sandbox.STOP_STEPS``),
then

- ``network-removed``: its network namespace and the record of its pod network;
- ``console-log-removed``: its guest's console log;
- ``plugins-told``: the NRI plugins told of its containers' and its own removal;
- ``containers-removed``: its containers' guest side forgotten (image holds, log copies, binds)
  and its sandbox directory removed;
- ``record-deleted``: its row and its containers' rows deleted, its name free for a new sandbox.

As a stop, a removal has nothing to undo: a failure part-way leaves a sandbox that the same RPC
called again finishes (unknown ids and repeats succeed). The row goes last, so that a retry still
finds the sandbox whatever step failed; the containers' image holds, which a second release would
take from other containers, are let go right before it.
"""

from __future__ import annotations

from shim import rpc
from shim.model import RemovePodSandbox
from shim.pods import Pods
from shim.reconcile import remove_console_log
from shim.rpc.stop_pod_sandbox import STOP_STEPS, find, stop_steps

RPC = "RemovePodSandbox"
rpc.declare(
    RPC, *STOP_STEPS, "network-removed", "console-log-removed", "plugins-told", "containers-removed", "record-deleted"
)


def remove_pod_sandbox(pods: Pods, request: RemovePodSandbox) -> None:
    record = find(pods, request.sandbox_id)
    if record is None:
        return
    sb = pods.sandboxes
    sandbox_id = record.id  # paths below are built from the id of a row we wrote, never the client's
    members = sb.records.containers(sandbox_id)
    with rpc.steps(RPC) as s:
        stop_steps(pods, record, s)
        with sb.locks.lock_for(sandbox_id):
            sb.network.remove(sandbox_id)
            s.done("network-removed")
            remove_console_log(sb.config.console_dir, sandbox_id)
            s.done("console-log-removed")
        pods.nri.sandbox_removed(record, members)
        s.done("plugins-told")
        pods.containers.sandbox_removed(sandbox_id)
        s.done("containers-removed")
        with sb.locks.lock_for(sandbox_id):
            sb.records.release_name(record.meta, sandbox_id)
            sb.records.delete_sandbox(sandbox_id)
            s.done("record-deleted")
    sb.locks.forget(sandbox_id)
    pods.forget_rates(sandbox_id, *(c.id for c in members))
