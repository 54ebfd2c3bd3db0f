"""RunPodSandbox: a pod's VM from its plan to READY, then its node ports and the NRI plugins' word.

Its steps, in order (``shim.rpc``: each a fault point, each undo pushed as its step succeeds):

- ``planned``: sized from its declaration and the host's facts; nothing held yet;
- ``name-reserved``: its name, namespace, uid and attempt name this sandbox (undo: released);
- ``claimed``: its CPUs, pages, memory and devices, taken back from a snapshot being made in the
  background when the pod does not fit beside it (undo: released);
- ``recorded``: its ``creating`` row, with a QEMU uid of its own (undo: deleted);
- ``network-attached``: its pod network (undo: removed);
- ``share-made``: its sandbox directory, the share its guest mounts (undo: dropped);
- ``domain-defined``: for a restore from its shape's snapshot, or for a cold boot (undo: torn down);
- ``guest-started``: restored (or, when that fails, cold-booted) or booted, its agent answering;
- ``ready``: the guest's report checked, the row READY;
- ``node-ports-opened``: a host-network pod's, listened on (undo: closed);
- ``plugins-told``: the NRI plugins did not refuse it (undo: told it is removed).

When the domain cannot be torn down the unwinding stops there: the guest may still hold the
pod's CPUs and pages, so they stay claimed (with the row, network, directory and name) until the
reconcile removes the domain, and the error says so. Once READY and answered, the snapshot of a
shape that has none yet is made in the background.
"""

from __future__ import annotations

import copy
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import replace

from shim import logs, metrics, rpc
from shim.model import RunPodSandbox, SandboxSpec
from shim.pods import Pods
from shim.records import new_id
from shim.sandboxes import Sandboxes
from vmsandbox.errors import CannotFit, VmSandboxError
from vmsandbox.lifecycle import SandboxPlan
from vmsandbox.placement import Placement

log = logging.getLogger(__name__)

RPC = "RunPodSandbox"
rpc.declare(
    RPC,
    "planned",
    "name-reserved",
    "claimed",
    "recorded",
    "network-attached",
    "share-made",
    "domain-defined",
    "guest-started",
    "ready",
    "node-ports-opened",
    "plugins-told",
)


def run_pod_sandbox(pods: Pods, request: RunPodSandbox) -> str:
    """Run the pod of ``request``; its sandbox id. Any failure unwinds what was done and says what."""
    started = time.monotonic()
    spec = request.spec
    sb = pods.sandboxes
    pod = f"{spec.meta.namespace}/{spec.meta.name}"
    logs.bind(pod=pod)
    sandbox_id = new_id()
    with sb.locks.running(sandbox_id), rpc.steps(RPC, functools.partial(_failed, pod, sandbox_id)) as s:
        plan = sb.plan(spec)
        s.done("planned")
        sb.records.reserve_name(spec.meta, sandbox_id)
        s.done("name-reserved", functools.partial(sb.records.release_name, spec.meta, sandbox_id))
        logs.bind(sandbox_id=sandbox_id)
        placement = _claim(sb, sandbox_id, plan)
        s.done("claimed", functools.partial(sb.resources.release, sandbox_id))
        record = sb.boot.record(spec, plan, placement, sandbox_id)
        s.done("recorded", functools.partial(sb.records.delete_sandbox, sandbox_id))
        attachment = sb.network.attach(
            sandbox_id, spec.meta, spec.namespaces, spec.port_mappings, dict(spec.annotations)
        )
        s.done("network-attached", functools.partial(sb.network.remove, sandbox_id))
        record = replace(record, network=attachment.network)
        shared = sb.dirs.make(sandbox_id, record.qemu_uid, plan.shared_storage_bytes)
        s.done("share-made", functools.partial(sb.dirs.drop, sandbox_id))
        guest = sb.boot.guest(record, plan, placement, attachment, shared)
        booting = time.monotonic()
        sb.boot.define(guest)
        s.done("domain-defined", functools.partial(sb.boot.remove_domain, guest.domain.name))
        report, how = sb.boot.start(record, guest)
        s.done("guest-started")
        record = sb.boot.ready(record, guest, report, how, int((time.monotonic() - booting) * 1000))
        s.done("ready")
        s.done("node-ports-opened", _open_node_ports(pods, sandbox_id, spec))
        pods.nri.sandbox_started(sandbox_id)
        s.done("plugins-told", functools.partial(pods.nri.sandbox_removed, record, []))
    metrics.observe_start(record.runtime_handler, time.monotonic() - started)
    sb.boot.make_snapshot_later(guest)
    return sandbox_id


def _claim(sb: Sandboxes, sandbox_id: str, plan: SandboxPlan) -> Placement:
    """Claim what the pod needs. Pods come first: a snapshot being made in the background gives
    its claim back when the pod does not fit beside it."""
    try:
        return sb.resources.reserve(sandbox_id, plan.shape, plan.profile, plan.devices)
    except CannotFit:
        if not sb.snapshots.give_way():
            raise
        return sb.resources.reserve(sandbox_id, plan.shape, plan.profile, plan.devices)


def _open_node_ports(pods: Pods, sandbox_id: str, spec: SandboxSpec) -> Callable[[], None] | None:
    """Listen on the node for a host-network pod's port mappings; the undo (None: nothing opened)."""
    ports = pods.host_ports
    if ports is None:
        return None
    ports.open(sandbox_id, spec.namespaces, spec.port_mappings)
    return functools.partial(ports.close, sandbox_id)


def _failed(pod: str, sandbox_id: str, exc: BaseException, outcome: str) -> BaseException | None:
    """The error to answer: the pod named and what the unwinding did, once anything was held."""
    if not isinstance(exc, VmSandboxError) or outcome == rpc.NOTHING_UNDONE:
        return None
    log.error("sandbox %s for pod %s failed: %s (%s)", sandbox_id[:12], pod, exc, outcome)
    said = copy.copy(exc)  # its type and what it carries (a refusal's shortfalls, ...), saying more
    said.args = (f"pod {pod}: {exc} ({outcome})",)
    return said
