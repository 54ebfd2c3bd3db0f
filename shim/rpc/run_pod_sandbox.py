"""RunPodSandbox: a pod's VM from its plan to READY, then its node ports and the NRI plugins' word.

The steps, each undone should a later one fail (``shim.rpc``):

============  ==================================================  ================================
step          what it did                                         its undo
============  ==================================================  ================================
plan          sized the pod from its declaration and the host's
              facts; nothing held yet
claimed-nics  the NICs of the DRA claims prepared for the pod
              (``vmsandbox.dra.claimed_nics``): a tap on each
              claimed bridge network, a macvtap on each macvlan
              one, which libvirt makes with the domain and
              removes with it (``define``'s undo); nothing held
              yet, a device that cannot be attached refused
claimed-      the IOMMU groups of the DRA claims' passthrough
devices       devices (``vmsandbox.dra_pci.claimed_groups``)
              join the groups the pod names, so ``claim`` holds
              them in the ledger beside its vCPUs and pages and
              ``define`` gives the domain their ``<hostdev>``s;
              nothing held yet, a device not published refused
reserve-name  its name, namespace, uid and attempt name this      released
              sandbox
claim         its CPUs, pages, memory and devices, taken back     released
              from a snapshot being made in the background when
              the pod does not fit beside it
record        its ``creating`` row, with a QEMU uid of its own    deleted
network       its pod network: a namespace of its own and CNI     removed: the macvtap, CNI DEL
              ADD, or the namespace the request gave              and the namespace; of a given
              (``given_netns``), read; the macvtap its guest's    namespace, the macvtap only
              NIC uses on the namespace's ``eth0``
share         its sandbox directory, the share its guest mounts   dropped
define        its domain defined, for a restore from its shape's  torn down
              snapshot or for a cold boot
cgroup        its QEMU, all threads, moved into the pod's         moved back
              ``cgroup_parent`` (cpu, cpuacct, memory, pids),
              when the pod names one: before its vCPUs run
              when it cold-boots, once restored when restored
guest-start   its guest restored (or, when that fails,            (the domain's)
              cold-booted) or booted, its agent answering
ready         the guest's report checked, the row READY           (the row's)
              (and the DRA claims' status written: their NICs
              as the guest reports them)
loopback-     in a given namespace (shim mode): TCP to its        its rule deleted, closed
forward       loopback redirected to a listener there, which
              relays each connection into the guest
node-ports    a host-network pod's node ports listened on         closed
nri-started   NRI plugins told RunPodSandbox, and none refused    told RemovePodSandbox
============  ==================================================  ================================

When the domain cannot be torn down the unwinding stops there: the guest may still hold the
pod's CPUs and pages, so they stay claimed (with the row, network, directory and name) until the
reconcile removes the domain, and the error says so. Once READY and answered, the snapshot of a
shape that has none yet is made in the background. A pod with DRA claims that fails, once unwound,
has each claimed device's ``Ready`` condition ``False`` with the reason (``NotAsClaimed``: the
guest's NIC is not as claimed; else ``AttachFailed``) and the error as its message.
"""

from __future__ import annotations

import copy
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from shim import logs, metrics, rpc
from shim.boot import CLAIMED_NICS_WRONG
from shim.model import RunPodSandbox, SandboxRecord, SandboxSpec
from shim.pods import Pods
from shim.records import new_id
from shim.sandboxes import Sandboxes
from vmsandbox.dra import PreparedClaim, claimed_nics
from vmsandbox.dra_pci import claimed_groups, network_claims, published_groups, with_claimed_groups
from vmsandbox.errors import AlreadyExists, CannotFit, VmSandboxError
from vmsandbox.lifecycle import SandboxPlan
from vmsandbox.placement import Placement

log = logging.getLogger(__name__)

RPC = "RunPodSandbox"
rpc.declare(
    RPC,
    "plan",
    "claimed-nics",
    "claimed-devices",
    "reserve-name",
    "claim",
    "record",
    "network",
    "share",
    "define",
    "cgroup",
    "guest-start",
    "ready",
    "loopback-forward",
    "node-ports",
    "nri-started",
)


def run_pod_sandbox(pods: Pods, req: RunPodSandbox) -> str:
    """Run the pod ``req`` asks for; its sandbox id. Any failure unwinds what was done and says what."""
    started = time.monotonic()
    spec = req.spec
    sb = pods.sandboxes
    pod = f"{spec.meta.namespace}/{spec.meta.name}"
    logs.bind(pod=pod)
    claims = pods.prepared_claims(spec.meta.uid)
    sandbox_id = req.sandbox_id or new_id()
    if req.sandbox_id and (sandbox_id in sb.locks.in_flight or sandbox_id in sb.records.ids_with_prefix(sandbox_id)):
        raise AlreadyExists(f"sandbox {sandbox_id} exists already")
    failed = functools.partial(_claims_failed, pods, claims, functools.partial(_failed, pod, sandbox_id))
    with sb.locks.running(sandbox_id), rpc.steps(RPC, failed) as s:
        plan = sb.plan(spec)
        s.done("plan")
        nic_claims = network_claims(claims)
        nics = claimed_nics(pod, sandbox_id, nic_claims, sb.config.dra.networks) if nic_claims else ()
        s.done("claimed-nics")
        plan = _with_claimed_devices(sb, pod, claims, plan)
        s.done("claimed-devices")
        sb.records.reserve_name(spec.meta, sandbox_id)
        s.done("reserve-name", functools.partial(sb.records.release_name, spec.meta, sandbox_id))
        logs.bind(sandbox_id=sandbox_id)
        placement = _claim(sb, sandbox_id, plan)
        s.done("claim", functools.partial(sb.resources.release, sandbox_id))
        record = sb.boot.record(spec, plan, placement, sandbox_id)
        s.done("record", functools.partial(sb.records.delete_sandbox, sandbox_id))
        attachment = sb.network.attach(
            sandbox_id,
            spec.meta,
            spec.namespaces,
            spec.port_mappings,
            dict(spec.annotations),
            given_netns=req.given_netns,
        )
        s.done("network", functools.partial(sb.network.remove, sandbox_id))
        record = replace(record, network=attachment.network)
        shared = sb.dirs.make(sandbox_id, record.qemu_uid, plan.shared_storage_bytes)
        s.done("share", functools.partial(sb.dirs.drop, sandbox_id))
        guest = sb.boot.guest(record, plan, placement, attachment, shared, nics)
        booting = time.monotonic()
        define_ms = sb.boot.define(guest)
        s.done("define", functools.partial(sb.boot.remove_domain, guest.domain.name))

        def placed(record: SandboxRecord = record) -> None:  # its QEMU runs: into the pod's cgroup
            s.timed("cgroup", functools.partial(sb.boot.place, record))

        report, how = sb.boot.start(record, guest, define_ms, placed)
        s.done("guest-start")
        record = sb.boot.ready(record, guest, report, how, int((time.monotonic() - booting) * 1000))
        s.done("ready")
        if claims:  # their status.devices[], as the guest reports their NICs (not undone: the claim's)
            pods.claim_status(claims, nics, report.nics)
        s.done("loopback-forward", _open_loopback_forward(pods, sandbox_id, req.given_netns))
        s.done("node-ports", _open_node_ports(pods, sandbox_id, spec))
        pods.nri.sandbox_started(sandbox_id)
        s.done("nri-started", functools.partial(pods.nri.sandbox_removed, record, []))
    metrics.observe_start(record.runtime_handler, time.monotonic() - started)
    sb.boot.make_snapshot_later(guest)
    return sandbox_id


def _with_claimed_devices(sb: Sandboxes, pod: str, claims: Sequence[PreparedClaim], plan: SandboxPlan) -> SandboxPlan:
    """The plan with the passthrough devices of the pod's claims among the groups it names."""
    if not claims:
        return plan
    groups = claimed_groups(pod, claims, published_groups(sb.resources.pools.devices, sb.config.dra.pci_pools))
    return replace(plan, devices=with_claimed_groups(plan.devices, groups)) if groups else plan


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


def _open_loopback_forward(pods: Pods, sandbox_id: str, given_netns: str | None) -> Callable[[], None] | None:
    """Forward the loopback of the namespace the caller gave into the guest (containerd's
    PortForward dials it); the undo (None: nothing opened, as for a namespace of the shim's own,
    whose PortForward the shim serves itself)."""
    forwards = pods.loopback_forwards
    if forwards is None or given_netns is None:
        return None
    forwards.open(sandbox_id, given_netns)
    return functools.partial(forwards.close, sandbox_id)


def _claims_failed(
    pods: Pods,
    claims: Sequence[PreparedClaim],
    then: Callable[[BaseException, str], BaseException | None],
    exc: BaseException,
    outcome: str,
) -> BaseException | None:
    """Once unwound, a pod with DRA claims has their devices' ``Ready`` condition set ``False``
    with the reason (best effort, bounded: ``DraDriver.write_failure``); then ``then``'s error."""
    if claims and isinstance(exc, Exception):
        reason = "NotAsClaimed" if CLAIMED_NICS_WRONG in str(exc) else "AttachFailed"
        try:
            pods.claim_failure(claims, reason, f"RunPodSandbox failed: {exc}")
        except Exception as write_exc:  # never in place of the pod's own error
            log.warning("claims' failure status not written: %s", write_exc)
    return then(exc, outcome)


def _failed(pod: str, sandbox_id: str, exc: BaseException, outcome: str) -> BaseException | None:
    """The error to answer: the pod named and what the unwinding did, once anything was held."""
    if not isinstance(exc, VmSandboxError) or outcome == rpc.NOTHING_UNDONE:
        return None
    log.error("sandbox %s for pod %s failed: %s (%s)", sandbox_id[:12], pod, exc, outcome)
    said = copy.copy(exc)  # its type and what it carries (a refusal's shortfalls, ...), saying more
    said.args = (f"pod {pod}: {exc} ({outcome})",)
    return said
