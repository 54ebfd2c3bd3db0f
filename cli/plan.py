"""``vmsandbox plan``: what the shim would do with a pod, without doing any of it.

manifest -> KEP-4112 declaration (``vmsandbox.manifest``) -> demand and VM shape (the profile) ->
placement on this host's inventory or a fixture sysfs tree, with nothing claimed (or with what a
running shim holds, read-only, when ``--state-dir`` is given) -> the libvirt domain XML, with
placeholder ids so the output is stable. No libvirt connection, no state write.

Sidecars (``restartPolicy: Always``) come from the manifest, and ``spec.overhead`` is the
RuntimeClass overhead the kubelet would send; a note says when the pod's ``io.vmsandbox/sidecars``
annotation would make the shim size it otherwise.

Outcome: ``fits`` (exit 0), ``refused`` (exit 1: which resource, declared vs available), or an
``InvalidArgument`` for bad input (exit 2, raised to the caller).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from cli import textout
from shim.config import ShimConfig
from shim.host_policy import domain_for
from shim.host_resources import ResourceManager
from vmsandbox import record_docs
from vmsandbox.adapters.sysfs import read_inventory
from vmsandbox.claims import Claim
from vmsandbox.domain import SandboxIdentity
from vmsandbox.domain_xml import render
from vmsandbox.dra import PlannedRequest, network_device, plan_claims, planned_nics
from vmsandbox.dra_pci import pci_device, planned_groups, published_groups, with_claimed_groups
from vmsandbox.dra_select import Selection, select_claims
from vmsandbox.errors import CannotFit, InvalidArgument, VmSandboxError
from vmsandbox.host import choose_accel, format_cpulist
from vmsandbox.lifecycle import plan_sandbox, pod_demand
from vmsandbox.manifest import PodManifest, describe_all, pod_from_manifest, select_workload, workloads
from vmsandbox.placement import Placement
from vmsandbox.pod import PodMeta, SandboxSpec
from vmsandbox.profile import SIDECARS_ANNOTATION, Profile, select_profile
from vmsandbox.resources import ContainerResources
from vmsandbox.sizing import (
    LinuxResources,
    PodDemand,
    VmShape,
    demand_from_declaration,
    sidecars_from_annotations,
)

PLACEHOLDER_SANDBOX_ID = "0" * 64
PLACEHOLDER_UUID = "00000000-0000-0000-0000-000000000000"


@dataclass(frozen=True)
class HostSource:
    """Where the inventory comes from: the real host, or a fixture tree holding ``sys/`` (and ``proc/``)."""

    sys_root: str
    proc_root: str
    kvm_device: bool
    label: str

    @staticmethod
    def real(config: ShimConfig) -> HostSource:
        return HostSource(config.sys_root, config.proc_root, os.path.exists("/dev/kvm"), "this host")

    @staticmethod
    def fixture(directory: str) -> HostSource:
        """A directory with ``sys/`` (and ``proc/``) inside, or a sysfs root itself (``devices/system``)."""
        root = Path(directory)
        if (root / "sys" / "devices" / "system" / "cpu").is_dir():
            sys_root, proc_root = root / "sys", root / "proc"
        elif (root / "devices" / "system" / "cpu").is_dir():
            sys_root, proc_root = root, root.parent / "proc"
        else:
            raise InvalidArgument(f"--host-sysfs {directory}: no devices/system/cpu under it or under its sys/")
        # a fixture host has /dev/kvm exactly when its CPUs advertise vmx/svm
        return HostSource(str(sys_root), str(proc_root), kvm_device=True, label=str(directory))


@dataclass(frozen=True)
class Shortfall:
    """One resource the pod cannot get: what it declared or needs, and the most there is."""

    resource: str
    declared: str
    available: str


@dataclass(frozen=True)
class Plan:
    manifest: PodManifest
    profile: Profile
    handler: str
    host: HostSource
    owned_cpus: tuple[int, ...]
    nodes: tuple[int, ...]
    demand: PodDemand | None
    shape: VmShape | None
    placement: Placement | None
    accel: str
    domain_xml: str | None
    refusal: str | None
    shortfalls: tuple[Shortfall, ...]
    notes: tuple[str, ...]
    claims: tuple[PlannedRequest, ...] = ()  # the pod's ResourceClaims' requests (vmsandbox.dra.plan_claims)
    pci_devices: Mapping[str, str] = field(default_factory=dict)  # claim/request -> passthrough devices it shows
    selections: tuple[Selection, ...] = ()  # each of ``claims``: its selectors over this node's devices

    @property
    def fits(self) -> bool:
        return self.refusal is None


# -- inputs -----------------------------------------------------------------------------------------
def load_documents(path: str) -> list[Any]:
    """Every YAML document of the manifest file (the pod's claim and template manifests among them)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise InvalidArgument(f"{path}: cannot read: {exc.strerror}") from None
    try:
        return [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else path
        raise InvalidArgument(f"{where}: invalid YAML: {getattr(exc, 'problem', exc)}") from None


def load_manifest(path: str, index: int | None) -> PodManifest:
    docs = load_documents(path)
    try:
        found = workloads(docs)
        if index is None and len(found) > 1:
            raise InvalidArgument(
                f"the manifest holds {len(found)} pod templates ({describe_all(found)}); choose one with "
                "--document N (0-based)"
            )
        if index is not None and not 0 <= index < len(found):
            raise InvalidArgument(f"--document {index} is out of range: the manifest holds {len(found)} pods (0-based)")
        return pod_from_manifest(select_workload(docs, index))
    except InvalidArgument as exc:
        raise InvalidArgument(f"{path}: {exc}") from None


def choose_profile(
    profiles: Mapping[str, Profile], manifest: PodManifest, *, name: str, handler: str, default_handler: str
) -> tuple[Profile, str, list[str]]:
    """The profile and the handler it is planned for, and notes on how they were chosen.

    ``--profile NAME`` wins; else the handler (``--handler``, else the pod's runtimeClassName when a
    profile serves it, else the default handler) and the pod's profile annotation, as the shim chooses.
    """
    notes: list[str] = []
    if name:
        for p in profiles.values():
            if p.name == name:
                return p, p.handler, notes
        known = ", ".join(sorted(p.name for p in profiles.values()))
        raise InvalidArgument(f"--profile {name}: no such profile (profiles: {known})")
    if handler:
        if handler not in profiles:
            raise InvalidArgument(
                f"--handler {handler}: no profile serves it (handlers: {', '.join(sorted(profiles))})"
            )
    elif manifest.runtime_class in profiles:
        handler = manifest.runtime_class
    else:
        if manifest.runtime_class:
            notes.append(
                f"runtimeClassName {manifest.runtime_class!r} is not a handler of these profiles; assuming its "
                f"RuntimeClass maps to handler {default_handler!r} (use --handler)"
            )
        if default_handler not in profiles:
            raise InvalidArgument(
                f"default handler {default_handler!r} has no profile (handlers: {', '.join(sorted(profiles))}); "
                "use --handler or --profile"
            )
        handler = default_handler
    by_name = {p.name: p for p in profiles.values()}
    return select_profile(profiles, by_name, handler, dict(manifest.annotations)), handler, notes


def _shortfall_rows(exc: CannotFit, shape: VmShape | None) -> list[Shortfall]:
    """The refusal's shortfalls as "declared vs available" rows."""
    rows = []
    for s in exc.shortfalls:
        resource = s.resource
        if shape is not None and resource.startswith("hugepages-"):
            resource += f" (guest RAM {textout.size(shape.memory_bytes)})"
        if s.where.startswith("vcpu.max"):
            available = f"{s.available} ({s.where})"
        elif s.available[:1].isdigit():
            available = f"{s.available} free on {s.where}"
        else:
            available = s.available
        rows.append(Shortfall(resource, s.need, available))
    return rows


# -- the plan ---------------------------------------------------------------------------------------
def sandbox_request(manifest: PodManifest, handler: str) -> SandboxSpec:
    """The RunPodSandbox request a KEP-4112 kubelet would send for ``manifest`` (placeholder uid);
    for a pod with pod-level limits, what a kubelet sends instead: no pod_resources (they have no
    place for pod-level figures), its pod-level limits as LinuxPodSandboxConfig.resources."""
    return SandboxSpec(
        meta=PodMeta(name=manifest.name, namespace=manifest.namespace, uid=PLACEHOLDER_UUID),
        runtime_handler=handler,
        labels=dict(manifest.labels),
        annotations=dict(manifest.annotations),
        declaration=None if manifest.pod_level else manifest.declaration,
        linux_resources=manifest.kubelet_sandbox_resources() if manifest.pod_level else LinuxResources(),
        # spec.overhead, as the kubelet sends it (LinuxPodSandboxConfig.overhead)
        linux_overhead=LinuxResources(
            cpu_period=100_000 if manifest.overhead_cpu_millis else 0,
            cpu_quota=manifest.overhead_cpu_millis * 100,
            memory_limit_bytes=manifest.overhead_memory_bytes,
        ),
    )


def make_plan(
    manifest: PodManifest,
    profiles: Mapping[str, Profile],
    config: ShimConfig,
    host: HostSource,
    *,
    profile_name: str = "",
    handler: str = "",
    taken: Mapping[str, Claim] | None = None,
    docs: Sequence[Any] = (),
) -> Plan:
    """What the shim would do with ``manifest``; ``taken``: what a running shim holds (``--state-dir``);
    ``docs``: the manifest file's documents, where the pod's ResourceClaims and templates are looked up."""
    profile, handler, notes = choose_profile(
        profiles, manifest, name=profile_name, handler=handler, default_handler=config.default_handler
    )
    notes = list(manifest.notes) + notes
    claims = plan_claims(
        manifest.resource_claims, list(docs), manifest.namespace, config.dra.driver_name, config.dra.networks
    )
    for c in claims:
        if not c.source:
            notes.append(f"resourceClaims {c.claim}: its ResourceClaim or template is not in the manifest")
    inv = read_inventory(host.sys_root, host.proc_root)
    if not inv.cpus:
        raise InvalidArgument(f"{host.sys_root}: no online CPUs found")
    manager = ResourceManager.open(config, inv, held=taken or {}, label=host.label)
    published = published_groups(manager.pools.devices, config.dra.pci_pools)
    claims, selections, claims_refused = _selected(claims, docs, manifest.namespace, config, published)
    pod_name = f"{manifest.namespace}/{manifest.name}"
    try:
        nics = planned_nics(pod_name, PLACEHOLDER_SANDBOX_ID, claims, config.dra.networks)
        nics_refused = ""
    except VmSandboxError as exc:  # as RunPodSandbox refuses the pod
        nics, nics_refused = (), f"{exc} (the shim refuses RunPodSandbox)"
    policy = manager.policy
    owned = policy.owned_cpus
    accel = choose_accel(profile.accel, inv.hw_virt, host.kvm_device)

    def result(
        demand: PodDemand | None,
        shape: VmShape | None,
        placement: Placement | None,
        xml: str | None,
        refusal: str | None,
        shortfalls: Sequence[Shortfall] = (),
    ) -> Plan:
        return Plan(
            manifest=manifest,
            profile=profile,
            handler=handler,
            host=host,
            owned_cpus=tuple(sorted(owned)),
            nodes=inv.nodes,
            demand=demand,
            shape=shape,
            placement=placement,
            accel=accel,
            domain_xml=xml,
            refusal=refusal,
            shortfalls=tuple(shortfalls),
            notes=tuple(notes),
            claims=claims,
            pci_devices=pci_devices,
            selections=selections,
        )

    pci_devices: dict[str, str] = {}
    request = sandbox_request(manifest, handler)
    sidecars = frozenset(manifest.sidecars)
    try:
        on_the_wire = sidecars_from_annotations(request.annotations, manifest.declaration)
    except InvalidArgument as exc:  # the shim refuses it (INVALID_ARGUMENT)
        demand = pod_demand(request, profile, sidecars=sidecars)[1]
        return result(demand, None, None, None, f"{exc} (the shim refuses RunPodSandbox with INVALID_ARGUMENT)")
    if on_the_wire != sidecars and request.declaration is not None:
        demand = pod_demand(request, profile, sidecars=sidecars)[1]
        notes.append(_sidecar_note(manifest, profile, on_the_wire, demand, request.linux_overhead))
    facts = policy.facts(inv, request.declaration, kvm_device=host.kvm_device)
    try:  # the function RunPodSandbox runs, with the manifest's sidecars (the kubelet does not send them)
        planned = plan_sandbox(
            request, profiles, facts, default_handler=config.default_handler, profile=profile, sidecars=sidecars
        )
    except InvalidArgument as exc:  # the manifest is valid; the shim would refuse it (INVALID_ARGUMENT)
        demand = pod_demand(request, profile, sidecars=sidecars)[1]
        return result(demand, None, None, None, f"{exc} (the shim refuses RunPodSandbox with INVALID_ARGUMENT)")
    except CannotFit as exc:
        demand = pod_demand(request, profile, sidecars=sidecars)[1]
        return result(demand, None, None, None, str(exc), _shortfall_rows(exc, None))
    demand, shape = planned.demand, planned.shape
    if claims_refused:
        return result(demand, shape, None, None, claims_refused)
    candidates = {
        f"{c.claim}/{c.request}": (
            tuple(d for d in s.matches if d in published),
            max(1, sum(d in published for d in s.devices)),
        )
        for c, s in zip(claims, selections, strict=True)
        if c.pci
    }
    held = {a for c in (taken or {}).values() for a in c.pci}
    try:  # the passthrough devices of its claims, as RunPodSandbox adds them (vmsandbox.dra_pci)
        chosen = planned_groups(claims, published, held, candidates)
    except CannotFit as exc:
        return result(demand, shape, None, None, str(exc))
    for r, name in chosen:
        key = f"{r.claim}/{r.request}"
        pci_devices[key] = f"{pci_devices[key]}, {name}" if key in pci_devices else name
    devices = with_claimed_groups(planned.devices, [published[name] for _, name in chosen])
    try:
        placement = manager.place(shape, profile, devices)
    except CannotFit as exc:
        return result(demand, shape, None, None, str(exc), _shortfall_rows(exc, shape))
    if nics_refused:
        return result(demand, shape, placement, None, nics_refused)
    console = str(Path(config.console_dir) / f"{PLACEHOLDER_SANDBOX_ID}.log") if config.console_dir else None
    domain = domain_for(
        identity=SandboxIdentity(
            sandbox_id=PLACEHOLDER_SANDBOX_ID,
            pod_name=manifest.name,
            pod_namespace=manifest.namespace,
            pod_uid=PLACEHOLDER_UUID,
            attempt=0,
            runtime_handler=handler,
        ),
        uuid=PLACEHOLDER_UUID,
        shape=shape,
        placement=placement,
        profile=profile,
        accel=accel,
        console_log=console,
        claimed_nics=nics,
    )
    return result(demand, shape, placement, render(domain), None)


def _selected(
    claims: tuple[PlannedRequest, ...],
    docs: Sequence[Any],
    namespace: str,
    config: ShimConfig,
    published: Mapping[str, Any],
) -> tuple[tuple[PlannedRequest, ...], tuple[Selection, ...], str]:
    """The requests with the devices their selectors pick of those this node's vmsandbox publishes
    (``vmsandbox.dra_select``): the networks it would get, and whether it takes passthrough devices;
    and the refusal, when a selector fails (the scheduler allocates nothing) or a request of this
    driver's class finds too few devices here (the scheduler puts the pod on no such node)."""
    driver = config.dra.driver_name
    devices = [network_device(driver, n) for n in config.dra.networks]
    devices += [pci_device(driver, g) for g in published.values()]
    selections = select_claims(claims, list(docs), namespace, driver, devices)
    out, refused = [], ""
    for c, s in zip(claims, selections, strict=True):
        if c.source and (s.error or (s.ours and not s.devices and (not c.pci or s.matches))) and not refused:
            refused = s.error or f"resourceClaims {c.claim} request {c.request}: {s.reason}"
            refused += " (the scheduler allocates the claim no devices on this node)"
        networks = tuple(d for d in s.devices if d not in published)
        pci = any(d in published for d in s.devices) or (c.pci and not networks)
        out.append(replace(c, networks=networks, pci=pci))
    return tuple(out), selections, refused


def _sidecar_note(
    manifest: PodManifest, profile: Profile, on_the_wire: frozenset[str], demand: PodDemand, overhead: LinuxResources
) -> str:
    """Why the shim would size the pod differently: the kubelet does not send restartPolicy."""
    wanted = ",".join(manifest.sidecars)
    shim = demand_from_declaration(manifest.declaration, profile, sidecars=on_the_wire, overhead=overhead)
    sized = ", ".join(sorted(on_the_wire)) or "none"
    fix = f'"{SIDECARS_ANNOTATION}: {wanted}"' if wanted else f"no {SIDECARS_ANNOTATION} annotation"
    differs = (
        f": it would ask for cpu {shim.cpu_millis}m, memory {textout.size(shim.memory_bytes)} instead of "
        f"{demand.cpu_millis}m, {textout.size(demand.memory_bytes)}"
        if (shim.cpu_millis, shim.memory_bytes, shim.hugepages)
        != (demand.cpu_millis, demand.memory_bytes, demand.hugepages)
        else " (the same size for this pod)"
    )
    return (
        f"sidecars by restartPolicy: Always: {', '.join(manifest.sidecars) or 'none'}; the kubelet does not send "
        f"restartPolicy, so the shim takes them from the pod annotation {SIDECARS_ANNOTATION} (here: {sized})"
        f"{differs}; give the pod template {fix}"
    )


# -- output -----------------------------------------------------------------------------------------
def _resources_line(res: ContainerResources) -> str:
    req = " ".join(f"{k}={v.canonical()}" for k, v in res.requests) or "-"
    lim = " ".join(f"{k}={v.canonical()}" for k, v in res.limits) or "-"
    mounts = f"  mounts {','.join(sorted(m.container_path for m in res.mounts))}" if res.mounts else ""
    return f"requests {req}  limits {lim}{mounts}"


def _demand_line(demand: PodDemand) -> str:
    parts = [f"cpu {demand.cpu_millis}m", f"memory {textout.size(demand.memory_bytes)}"]
    parts += [f"hugepages-{textout.page_label(s)} {textout.size(b)}" for s, b in demand.hugepages]
    parts += [f"{n} {c}" for n, c in demand.extended]
    if demand.ephemeral_storage_bytes:
        parts.append(f"ephemeral-storage {textout.size(demand.ephemeral_storage_bytes)}")
    if demand.overhead_cpu_millis or demand.overhead_memory_bytes:
        parts.append(
            f"RuntimeClass overhead cpu {demand.overhead_cpu_millis}m "
            f"memory {textout.size(demand.overhead_memory_bytes)}"
        )
    return ", ".join(parts)


def _shape_line(shape: VmShape, profile: Profile) -> str:
    cpus = "pinned, exclusive" if shape.cpu_policy == "exclusive" else "shared, floating over the pool"
    if shape.hugepage_backed:
        page = textout.page_label(shape.backing_page_size)
        memory = f"{textout.size(shape.memory_bytes)} RAM on {page} hugepages ({shape.backing_pages} pages)"
    else:
        memory = f"{textout.size(shape.memory_bytes)} RAM on ordinary 4Ki pages"
    text = f"{shape.vcpus} vCPU{'s' if shape.vcpus != 1 else ''} ({cpus}), {memory}"
    if shape.guest_hugepages:
        text += ", guest hugepages " + " ".join(f"{n}x{textout.page_label(s)}" for s, n in shape.guest_hugepages)
    overhead = max(profile.memory_overhead_bytes, shape.demand.overhead_memory_bytes)
    text += f"; overhead {textout.size(overhead)}"
    if shape.has_headroom:
        pages = f" ({shape.reserved_pages - shape.backing_pages} pages)" if shape.hugepage_backed else ""
        text += (
            f"; resize headroom {shape.headroom_vcpus} vCPU{'s' if shape.headroom_vcpus != 1 else ''} and "
            f"{textout.size(shape.headroom_memory_bytes)}{pages}, reserved on the host now, plugged by a resize"
        )
    return text


def _placement_line(shape: VmShape, placement: Placement) -> str:
    node = ",".join(str(n) for n in placement.nodes)
    if shape.cpu_policy == "exclusive":
        cpus = ", ".join(f"vCPU {i} -> CPU {c}" for i, c in enumerate(placement.cpus))
    else:
        cpus = f"vCPUs float over CPUs {format_cpulist(placement.cpus)}"
    pages = "".join(f"; {n}x{textout.page_label(s)} pages from node {nd}" for nd, s, n in placement.hugepages)
    memory = "".join(f"; {textout.size(b)} of memory from node {nd}" for nd, b in placement.memory)
    devices = "".join(f"; {g.describe()}" for g in placement.devices)
    return f"NUMA node {node}: {cpus}{pages}{memory}{devices}"


def render_text(plan: Plan) -> str:
    m = plan.manifest
    source = m.kind if m.kind == "Pod" else f"pod template of {m.kind} {m.name}"
    host = (
        f"{plan.host.label}: {textout.plural(len(plan.owned_cpus), 'CPU')} owned ({format_cpulist(plan.owned_cpus)}), "
        f"{len(plan.nodes)} NUMA node{'s' if len(plan.nodes) != 1 else ''}, accel {plan.accel}"
    )
    pairs = [
        ("pod", f"{m.pod} ({source})"),
        ("handler", f"{plan.handler} (profile {plan.profile.name!r})"),
        ("declared", "pod_resources as a KEP-4112 kubelet would send it:"),
    ]
    out = [textout.fields(pairs, width=9)]
    rows = [
        ["init" + (" (sidecar)" if c.name in m.sidecars else ""), c.name, _resources_line(c.resources)]
        for c in m.declaration.init_containers
    ]
    rows += [["app", c.name, _resources_line(c.resources)] for c in m.declaration.containers]
    out.append("\n".join("  " + line for line in textout.table(["KIND", "CONTAINER", "RESOURCES"], rows).splitlines()))
    pairs = []
    if plan.demand is not None:
        pairs.append(("demand", _demand_line(plan.demand)))
    if plan.shape is not None:
        pairs.append(("VM", _shape_line(plan.shape, plan.profile)))
    pairs.append(("host", host))
    if plan.placement is not None and plan.shape is not None:
        pairs.append(("placement", _placement_line(plan.shape, plan.placement)))
    selections = plan.selections or tuple(Selection() for _ in plan.claims)
    for c, sel in zip(plan.claims, selections, strict=True):
        if c.source:
            pairs.append(("claim", _claim_line(c, plan.pci_devices.get(f"{c.claim}/{c.request}", ""), sel)))
    pairs.append(("verdict", "fits" if plan.fits else f"does not fit: {plan.refusal}"))
    out.append(textout.fields(pairs, width=9))
    if plan.shortfalls:
        rows = [[s.resource, s.declared, s.available] for s in plan.shortfalls]
        out.append(
            "\n".join("  " + line for line in textout.table(["RESOURCE", "DECLARED", "AVAILABLE"], rows).splitlines())
        )
    for note in plan.notes:
        out.append(f"note: {note}")
    if plan.domain_xml is not None:
        out.append("libvirt domain XML (placeholder sandbox id and uuid):")
        out.append(plan.domain_xml.rstrip("\n"))
    return "\n".join(out) + "\n"


def _claim_line(c: PlannedRequest, pci_device: str = "", sel: Selection | None = None) -> str:
    head = f"{c.claim} ({c.source}) request {c.request}, class {c.device_class}: "
    sel = sel or Selection()
    if sel.error:  # its claim and request are the line's
        return head + "selector error: " + sel.error.removeprefix(f"resourceClaims {c.claim} request {c.request}: ")
    matching = f" (its selectors match: {', '.join(sel.matches)})" if sel.matches else ""
    if c.pci and not c.networks:
        return (
            head + (f"passthrough device {pci_device}" if pci_device else "a passthrough device, none free") + matching
        )
    if not c.networks:
        return head + (sel.reason or "no device of this node's driver")
    if len(c.networks) == 1:
        line = head + f"a NIC on one of {', '.join(sel.matches or c.networks)} (plan: {c.networks[0]})"
    else:
        line = head + f"{len(c.networks)} NICs, on {', '.join(c.networks)}{matching}"
    if pci_device:
        line += f", passthrough device {pci_device}"
    if c.config.interface_name:
        line += f", interface {c.config.interface_name}"
    if c.config.addresses:
        line += f", addresses {', '.join(c.config.addresses)}"
    else:
        line += ", addresses from host-local at NodePrepareResources"
    return line


def _got(c: PlannedRequest, sel: Selection, pci_device: str) -> list[str]:
    """The devices a request gets: its networks and the passthrough devices free of ``--state-dir``'s
    sandboxes (the first its selectors match may be held)."""
    if not c.pci:
        return list(sel.devices)
    return list(c.networks) + [d for d in pci_device.split(", ") if d]


def plan_doc(plan: Plan) -> dict[str, Any]:
    m = plan.manifest
    return {
        "pod": {
            "kind": m.kind,
            "name": m.name,
            "namespace": m.namespace,
            "runtime_class": m.runtime_class,
            "labels": dict(m.labels),
            "sidecars": list(m.sidecars),
        },
        "handler": plan.handler,
        "profile": plan.profile.name,
        "pod_resources": record_docs.declaration_doc(m.declaration),
        "demand": record_docs.demand_doc(plan.demand) if plan.demand is not None else None,
        "shape": record_docs.shape_doc(plan.shape) if plan.shape is not None else None,
        "host": {
            "source": plan.host.label,
            "sys_root": plan.host.sys_root,
            "owned_cpus": format_cpulist(plan.owned_cpus),
            "numa_nodes": list(plan.nodes),
            "accel": plan.accel,
        },
        "placement": (
            {
                "nodes": list(plan.placement.nodes),
                "cpus": list(plan.placement.cpus),
                "hugepages": [{"node": n, "page_size": s, "pages": c} for n, s, c in plan.placement.hugepages],
                "memory": [{"node": n, "bytes": b} for n, b in plan.placement.memory],
                "devices": [g.to_doc() for g in plan.placement.devices],
            }
            if plan.placement is not None
            else None
        ),
        "fits": plan.fits,
        "refusal": (
            {
                "reason": plan.refusal,
                "shortfalls": [
                    {"resource": s.resource, "declared": s.declared, "available": s.available} for s in plan.shortfalls
                ],
            }
            if plan.refusal is not None
            else None
        ),
        "notes": list(plan.notes),
        "claims": [
            {
                "claim": c.claim,
                "source": c.source,
                "request": c.request,
                "device_class": c.device_class,
                "networks": list(c.networks),
                "interface_name": c.config.interface_name,
                "addresses": list(c.config.addresses),
                "pci_device": plan.pci_devices.get(f"{c.claim}/{c.request}", "") if c.pci else None,
                "devices": _got(c, sel, plan.pci_devices.get(f"{c.claim}/{c.request}", "")),
                "matching": list(sel.matches),  # every device its class's and its own selectors accept
                "unselected": sel.reason or None,  # why it gets none, or fewer than it asks for
                "selector_error": sel.error or None,
            }
            for c, sel in zip(plan.claims, plan.selections or tuple(Selection() for _ in plan.claims), strict=True)
        ],
        "domain_xml": plan.domain_xml,
    }
