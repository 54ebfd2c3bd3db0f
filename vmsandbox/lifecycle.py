"""Lifecycle decisions of a sandbox, as pure functions: what a pod gets, whether a container is
admitted, and how to reconcile the ledger with libvirt.

``plan_sandbox`` turns a RunPodSandbox request into a ``SandboxPlan`` (profile, demand, VM shape,
devices, accelerator). RunPodSandbox and ``vmsandbox plan`` both call it, then ask the
ResourceManager to place the shape, so a dry run and a real run cannot disagree.
``admit_container`` decides a CreateContainer against what the pod declared (or, for pods sized
from LinuxPodSandboxConfig, against what fits in the VM).

The shim reconciles at start-up and periodically while it runs. The IO shell gathers what the
ledger holds (``Row``) and what libvirt has (``Guest``), asks ``reconcile_actions`` what to do, and
carries the actions out in order. The decisions:

- READY row, guest running, claims as recorded: **adopt** (the sandbox and its containers stay).
- ``creating`` row (RunPodSandbox died after claiming, defining or starting): the domain, if any,
  is torn down, then the row and its claims are **forgotten** (console log removed).
- READY row whose guest is not running, or whose claims do not match its record: the domain is
  torn down, then the sandbox is **stopped**: claims released, containers marked exited, NOTREADY.
- NOTREADY row with a leftover domain or claims: the tear-down is **finished**.
- a domain of ours with no row: torn down; claims whose owner has no row: **released**.
- a domain of another state database: left alone.

A tear-down that fails keeps the sandbox's claims (its guest may still hold the pages): every
later action for that sandbox is skipped and tried again at the next reconcile.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import Protocol, TypeVar

from vmsandbox import admission, resize, shared_storage, states, validation
from vmsandbox.cdi import CdiRegistry
from vmsandbox.devices import NO_DEVICES, DevicePools, DeviceRequest, request_devices
from vmsandbox.errors import AlreadyExists, Diverged, InvalidArgument
from vmsandbox.host import choose_accel
from vmsandbox.pod import SandboxSpec
from vmsandbox.profile import Profile, select_profile
from vmsandbox.resources import ContainerResources, PodDeclaration, is_extended
from vmsandbox.sizing import (
    LinuxResources,
    PodDemand,
    VmShape,
    demand_from_declaration,
    demand_from_linux,
    running_alongside,
    shape_for,
    sidecar_names,
    sidecars_from_annotations,
)

STATE_CREATING = states.SANDBOX_CREATING
STATE_READY = states.SANDBOX_READY


@dataclass(frozen=True)
class Row:
    """A sandbox the ledger knows: its state, its domain's name, and whether its claims match its record."""

    sandbox_id: str
    state: str
    domain: str
    claims_problem: str = ""  # how its claims differ from its record ("" when they match)
    holds_claims: bool = False


@dataclass(frozen=True)
class Guest:
    """A domain libvirt has that carries vmsandbox metadata."""

    sandbox_id: str
    name: str
    active: bool
    owner: str  # the instance id of the state database that defined it ("" before schema 2)


class Step(Enum):
    ADOPT = "adopt"
    TEAR_DOWN = "tear down"  # remove the domain; later steps of this sandbox depend on it
    FORGET = "forget"  # delete the row and its claims: its RunPodSandbox never finished
    STOP = "stop"  # release claims, containers exited, row NOTREADY
    FINISH_STOP = "finish stop"  # release what a NOTREADY sandbox still holds
    RELEASE_ORPHAN = "release orphan claims"  # claims whose owner has no row
    LEAVE_FOREIGN = "leave foreign"  # another state database's domain


@dataclass(frozen=True)
class Action:
    step: Step
    sandbox_id: str
    domain: str = ""
    reason: str = ""


def _adoption_problem(row: Row | None, guest: Guest) -> str | None:
    if row is None:
        return "the ledger has no row for it"
    if row.state == STATE_CREATING:
        what = "running" if guest.active else "defined, never started"
        return f"its RunPodSandbox did not finish (row still creating, guest {what})"
    if row.state != STATE_READY:
        return f"the sandbox is {row.state}: its StopPodSandbox did not finish"
    if not guest.active:
        return "the sandbox is READY but its guest is not running"
    if row.domain != guest.name:
        return f"the sandbox's row names domain {row.domain}"
    if row.claims_problem:
        return row.claims_problem
    return None


def reconcile_actions(
    rows: Iterable[Row], guests: Iterable[Guest], claim_owners: Iterable[str], instance_id: str
) -> list[Action]:
    """The ordered actions that make the ledger and libvirt agree.

    Per sandbox a ``TEAR_DOWN`` comes before the row action it enables; the executor skips a
    sandbox's later actions when its tear-down fails.
    """
    by_id: Mapping[str, Row] = {r.sandbox_id: r for r in rows}
    owners = set(claim_owners)
    actions: list[Action] = []
    ours: dict[str, Guest] = {}
    for g in sorted(guests, key=lambda g: g.name):
        mine = g.owner == instance_id or (not g.owner and (g.sandbox_id in by_id or g.sandbox_id in owners))
        if mine:
            ours[g.sandbox_id] = g
        else:
            actions.append(Action(Step.LEAVE_FOREIGN, g.sandbox_id, g.name, f"owned by {g.owner or 'unrecorded'}"))
    adopted: set[str] = set()
    for sid, g in sorted(ours.items()):
        problem = _adoption_problem(by_id.get(sid), g)
        if problem is None:
            adopted.add(sid)
            actions.append(Action(Step.ADOPT, sid, g.name, "guest running, claims as recorded"))
        else:
            actions.append(Action(Step.TEAR_DOWN, sid, g.name, problem))
    for sid, row in sorted(by_id.items()):
        if sid in adopted:
            continue
        if row.state == STATE_CREATING:
            actions.append(Action(Step.FORGET, sid, row.domain, "its RunPodSandbox did not finish"))
        elif row.state == STATE_READY:
            actions.append(Action(Step.STOP, sid, row.domain, "no running guest (or its claims do not match)"))
        elif row.holds_claims or sid in owners:
            actions.append(Action(Step.FINISH_STOP, sid, row.domain, "its StopPodSandbox did not finish"))
    foreign = {a.sandbox_id for a in actions if a.step is Step.LEAVE_FOREIGN}
    for owner in sorted(owners - set(by_id) - foreign):
        actions.append(Action(Step.RELEASE_ORPHAN, owner, "", "claims with no sandbox row"))
    return actions


# -- what a pod gets --------------------------------------------------------------------------------
@dataclass(frozen=True)
class HostFacts:
    """What planning needs to know of the host; gathered by the IO shell."""

    hw_virt: bool  # the CPUs have vmx/svm
    kvm_device: bool  # /dev/kvm exists
    device_pools: DevicePools  # the admin's pools resolved on this host
    cdi: CdiRegistry | None = None  # CDI specs, loaded when the pod names CDI devices (``wants_cdi``)


@dataclass(frozen=True)
class SandboxPlan:
    profile: Profile
    handler: str
    sidecars: frozenset[str]
    demand: PodDemand
    shape: VmShape
    devices: DeviceRequest
    accel: str
    # what the guest may write on the host: the sandbox directory's file system (vmsandbox.shared_storage)
    shared_storage_bytes: int


def wants_cdi(declaration: PodDeclaration | None) -> bool:
    """Whether planning this pod needs the CDI specs (so the shell reads them only then)."""
    return declaration is not None and any(c.resources.cdi_devices for c in declaration.all_containers())


def _wants_devices(declaration: PodDeclaration) -> bool:
    for c in declaration.all_containers():
        res = c.resources
        if res.cdi_devices or res.devices or any(is_extended(n) for n in (*res.requests.names(), *res.limits.names())):
            return True
    return False


def pod_demand(
    request: SandboxSpec, profile: Profile, *, sidecars: frozenset[str] | None = None
) -> tuple[frozenset[str], PodDemand]:
    """The pod's sidecars and effective demand under ``profile``: from its declaration (KEP-753
    sidecars by annotation unless given), else from LinuxPodSandboxConfig; overhead included."""
    decl = request.declaration
    if decl is None:
        return frozenset(), demand_from_linux(
            request.linux_resources, request.annotations, profile, overhead=request.linux_overhead
        )
    chosen = sidecars if sidecars is not None else sidecars_from_annotations(request.annotations, decl)
    return chosen, demand_from_declaration(decl, profile, sidecars=chosen, overhead=request.linux_overhead)


def plan_sandbox(
    request: SandboxSpec,
    profiles: Mapping[str, Profile],
    host: HostFacts,
    *,
    default_handler: str,
    profile: Profile | None = None,
    sidecars: frozenset[str] | None = None,
) -> SandboxPlan:
    """The profile, demand, VM shape, devices and accelerator of a pod; raises InvalidArgument or
    CannotFit (a pod larger than its profile allows) with the reason.

    The profile is the handler's (or the one the pod chose by annotation); sidecars are read from
    the pod's annotation, as on the wire. ``profile`` and ``sidecars`` override both for
    ``vmsandbox plan``, which knows them from a manifest or the command line.
    """
    handler = request.runtime_handler or default_handler
    if profile is None:
        by_name = {p.name: p for p in profiles.values()}
        profile = select_profile(profiles, by_name, handler, request.annotations)
    chosen, demand = pod_demand(request, profile, sidecars=sidecars)
    devices = NO_DEVICES
    decl = request.declaration
    if decl is not None and _wants_devices(decl):
        devices = request_devices(
            decl, demand.extended, profile.extended_resources, profile.name, host.device_pools, host.cdi
        )
    shape = shape_for(demand, profile)
    accel = choose_accel(profile.accel, host.hw_virt, host.kvm_device)
    storage = shared_storage.capacity(decl, chosen, profile.shared_storage_bytes)
    return SandboxPlan(profile, handler, chosen, demand, shape, devices, accel, storage)


# -- whether a container is admitted ----------------------------------------------------------------
@dataclass(frozen=True)
class ContainerAsk:
    """A CreateContainer's resources: ``resources`` is None when the kubelet sent no
    kubernetes_resources; ``attachments`` are its mounts, devices and CDI devices."""

    name: str
    attempt: int
    resources: ContainerResources | None
    attachments: ContainerResources
    linux: LinuxResources


@dataclass(frozen=True)
class Sibling:
    """A container the sandbox already has."""

    name: str
    attempt: int
    linux: LinuxResources
    exited: bool


@dataclass(frozen=True)
class Admitted:
    """The resources recorded for an admitted container and what its cgroup holds."""

    resources: ContainerResources
    linux: LinuxResources


class _Attempt(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def attempt(self) -> int: ...


AttemptT = TypeVar("AttemptT", bound=_Attempt)


def live_attempts(
    containers: Iterable[AttemptT], skip: Collection[str], exited: Callable[[AttemptT], bool]
) -> list[AttemptT]:
    """The containers that hold resources: per name the latest attempt (a retry supersedes earlier
    ones), not exited, and not named in ``skip``."""
    latest: dict[str, AttemptT] = {}
    for c in containers:
        if c.name not in skip and (c.name not in latest or c.attempt > latest[c.name].attempt):
            latest[c.name] = c
    return [c for c in latest.values() if not exited(c)]


def check_fits_beside(
    demand: PodDemand,
    name: str,
    usage: admission.Usage,
    siblings: Iterable[Sibling],
    *,
    init_order: Sequence[str] = (),
    annotations: Mapping[str, str] | None = None,
    who: str,
) -> None:
    """The envelope rule, written once (CreateContainer, UpdateContainerResources and NRI
    plugins' adjustments of either are held to it): container ``name`` using ``usage`` fits the
    VM's ``demand`` beside every set of its siblings that may run with it, phase by phase
    (KEP-753: sidecars stay, plain init containers end; ``init_order`` and the sidecar annotations
    say which is which). A sibling counts as its latest attempt, and not once it exited;
    CannotFit naming ``who`` otherwise."""
    for others in _beside(name, siblings, init_order, annotations):
        admission.check_envelope(demand, others, usage, who=who)


def growth_beside(
    shape: VmShape,
    growth: resize.Growth,
    name: str,
    usage: admission.Usage,
    siblings: Iterable[Sibling],
    *,
    init_order: Sequence[str] = (),
    annotations: Mapping[str, str] | None = None,
    who: str,
) -> resize.Growth:
    """``check_fits_beside`` for a pod whose envelope may grow into its resize headroom: the growth
    (``growth`` or more) with which container ``name`` using ``usage`` fits beside its siblings in
    every phase; Diverged naming ``who`` when the headroom cannot hold it."""
    for others in _beside(name, siblings, init_order, annotations):
        growth = resize.container_growth(shape, growth, others, usage, who=who)
    return growth


def _beside(
    name: str, siblings: Iterable[Sibling], init_order: Sequence[str], annotations: Mapping[str, str] | None
) -> Iterator[list[admission.Usage]]:
    """The limits of the siblings container ``name`` may run beside, one list per phase."""
    live = {o.name: o for o in live_attempts(siblings, {name}, lambda o: o.exited)}
    sidecars = frozenset(sidecar_names(annotations or {}))
    for phase in running_alongside(name, init_order, sidecars, live):
        yield [admission.Usage.of_linux(live[n].linux) for n in sorted(phase) if n in live]


def admit_container(
    declaration: PodDeclaration | None,
    shape: VmShape,
    ask: ContainerAsk,
    siblings: Sequence[Sibling],
    annotations: Mapping[str, str] | None = None,
    growth: resize.Growth | None = None,
) -> Admitted:
    """Admit a CreateContainer or raise Diverged / AlreadyExists naming every difference.

    A declared pod admits exactly what it declared for the name (kubernetes_resources when sent,
    else what LinuxContainerResources implies, and the same mounts, devices and CDI devices). A pod
    sized from LinuxPodSandboxConfig admits a container while all live containers fit the VM.
    """
    requested = (
        replace(ask.attachments, requests=ask.resources.requests, limits=ask.resources.limits)
        if ask.resources is not None
        else ask.attachments
    )
    linux = admission.implied_linux(ask.resources) if ask.linux.empty and ask.resources is not None else ask.linux
    names = [admission.Existing(c.name, c.attempt) for c in siblings]
    if declaration is not None:
        if ask.resources is not None:
            admission.admit_declared(declaration, ask.name, ask.attempt, requested, names)
        else:
            admission.check_name(declaration, ask.name, ask.attempt, names)
            decl = declaration.find(ask.name)
            assert decl is not None  # check_name refused undeclared names
            diffs = admission.linux_differences(ask.name, decl.resources, ask.linux)
            diffs += admission.attachment_differences(ask.name, decl.resources, ask.attachments)
            if diffs:
                raise Diverged("resources diverge from the pod's declaration: " + "; ".join(diffs))
        return Admitted(requested, linux)
    if ask.attachments.devices:
        device = min(ask.attachments.devices, key=lambda d: d.host_path)
        raise InvalidArgument(
            f'container "{ask.name}": device {validation.quote(device.host_path)} cannot reach the guest: this '
            "pod declared no devices at RunPodSandbox (no pod_resources) and a VM's devices are fixed when it "
            "boots; host device nodes are never passed through, only VFIO groups of the admin's device_pools "
            "declared in pod_resources"
        )
    for c in siblings:
        if c.name == ask.name and c.attempt == ask.attempt:
            raise AlreadyExists(f'container "{ask.name}" (attempt {ask.attempt}) already exists')
    usage = (
        admission.Usage.of_resources(ask.resources)
        if ask.resources is not None
        else admission.Usage.of_linux(ask.linux)
    )
    envelope = resize.grown(shape.demand, growth or resize.Growth())
    check_fits_beside(envelope, ask.name, usage, siblings, annotations=annotations, who=f'container "{ask.name}"')
    return Admitted(requested, linux)
