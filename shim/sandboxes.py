"""Sandbox orchestration: size, place, claim, boot, admit, tear down, reconcile.

The only stateful piece of the shim. It speaks core types (``shim.model``) and drives the IO
adapters (ledger, hypervisor, sysfs, guest channel). RunPodSandbox is transactional: any
failure after the claim tears the domain down and releases every claim before the error
leaves this module.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
import uuid as uuidlib
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from shim.config import ShimConfig
from shim.model import (
    CONTAINER_CREATED,
    CONTAINER_EXITED,
    SANDBOX_NOTREADY,
    SANDBOX_READY,
    ContainerRecord,
    ContainerSpec,
    SandboxRecord,
    SandboxSpec,
)
from vmsandbox import admission, records
from vmsandbox.agent_protocol import GuestReport, report_to_body
from vmsandbox.domain import AGENT_CHANNEL, SandboxIdentity, build_domain, domain_name
from vmsandbox.domain_xml import render
from vmsandbox.errors import (
    AlreadyExists,
    CannotFit,
    Diverged,
    InfrastructureError,
    InvalidArgument,
    NotFound,
    VmSandboxError,
)
from vmsandbox.guest_channel import wait_for_hello
from vmsandbox.host import HostInventory, choose_accel
from vmsandbox.hypervisor import Hypervisor
from vmsandbox.ledger import ClaimConflict, Ledger
from vmsandbox.placement import HugepageBudget, Placement, place
from vmsandbox.profile import Profile
from vmsandbox.resources import ContainerResources, is_extended
from vmsandbox.sizing import LinuxResources, VmShape, demand_from_declaration, demand_from_linux, shape_for
from vmsandbox.sysfs import read_inventory

log = logging.getLogger(__name__)

STATE_CREATING = "creating"
PROFILE_ANNOTATION = "io.vmsandbox/profile"


def _new_id() -> str:
    return secrets.token_hex(32)


class Sandboxes:
    def __init__(
        self,
        config: ShimConfig,
        ledger: Ledger,
        hypervisor: Hypervisor,
        profiles: dict[str, Profile],
        *,
        inventory: Callable[[], HostInventory] | None = None,
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        self.config = config
        self.ledger = ledger
        self.hypervisor = hypervisor
        self.profiles = profiles
        self._inventory = inventory or (lambda: read_inventory(config.sys_root, config.proc_root))
        self._clock = clock
        self._place_lock = threading.Lock()
        self._sandbox_locks: dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()
        first = self._inventory()
        online = {c.id for c in first.cpus}
        pool = set(config.cpu_pool) if config.cpu_pool is not None else online
        missing = pool - online
        if missing:
            raise InvalidArgument(f"cpu_pool names CPUs that are not online: {sorted(missing)}")
        self.owned_cpus = frozenset(pool)

    # -- helpers --------------------------------------------------------------------------------
    def _lock_for(self, sandbox_id: str) -> threading.Lock:
        with self._locks_lock:
            return self._sandbox_locks.setdefault(sandbox_id, threading.Lock())

    def profile_for(self, handler: str, annotations: dict[str, str]) -> Profile:
        name = handler or self.config.default_handler
        profile = self.profiles.get(name)
        if profile is None:
            raise InvalidArgument(
                f'failed to get sandbox runtime: no runtime for "{name}" is configured '
                f"(configured handlers: {', '.join(sorted(self.profiles))})"
            )
        return profile

    def _budgets(self, inv: HostInventory) -> dict[tuple[int, int], HugepageBudget]:
        budgets = {}
        caps = dict(self.config.hugepages or {})
        remaining = dict(caps)
        for pool in inv.hugepages:
            pages = pool.total
            if self.config.hugepages is not None:
                pages = min(pages, remaining.get(pool.page_size, 0))
                remaining[pool.page_size] = remaining.get(pool.page_size, 0) - pages
            budgets[(pool.node, pool.page_size)] = HugepageBudget(
                node=pool.node, page_size=pool.page_size, pages=pages, host_free=pool.free
            )
        return budgets

    def _claim(self, sandbox_id: str, shape: VmShape) -> Placement:
        """Place and claim under one lock; a conflict with another process is retried once."""
        for attempt in range(3):
            with self._place_lock:
                inv = self._inventory()
                placement = place(shape, inv, self.owned_cpus, self.ledger.taken(), self._budgets(inv))
                try:
                    self.ledger.claim(sandbox_id, placement.claims)
                    return placement
                except ClaimConflict as exc:
                    log.warning("claim conflict for %s (attempt %d): %s", sandbox_id, attempt, exc)
        raise CannotFit("host resources are changing under us; no consistent placement after 3 attempts")

    # -- sandboxes ------------------------------------------------------------------------------
    def run(self, spec: SandboxSpec) -> str:
        meta = spec.meta
        for field_name in ("name", "namespace", "uid"):
            if not getattr(meta, field_name):
                raise InvalidArgument(f"PodSandboxConfig.metadata.{field_name} is empty")
        if meta.attempt < 0:
            raise InvalidArgument(f"PodSandboxConfig.metadata.attempt is negative ({meta.attempt})")
        profile = self.profile_for(spec.runtime_handler, spec.annotations)
        pod = f"{meta.namespace}/{meta.name}"
        if spec.declaration is not None:
            self._check_passthrough(spec, profile)
            demand = demand_from_declaration(spec.declaration, profile)
        else:
            demand = demand_from_linux(spec.linux_resources, spec.annotations, profile)
        shape = shape_for(demand, profile)
        inv = self._inventory()
        accel = choose_accel(profile.accel, inv.hw_virt, os.path.exists("/dev/kvm"))
        sandbox_id = _new_id()
        name = domain_name(sandbox_id)
        placement = self._claim(sandbox_id, shape)
        record = SandboxRecord(
            id=sandbox_id,
            meta=meta,
            state=STATE_CREATING,
            created_ns=self._clock(),
            runtime_handler=spec.runtime_handler or self.config.default_handler,
            profile=profile.name,
            domain=name,
            labels=dict(spec.labels),
            annotations=dict(spec.annotations),
            hostname=spec.hostname,
            log_directory=spec.log_directory,
            declaration=records.declaration_doc(spec.declaration) if spec.declaration else None,
            shape=records.shape_doc(shape),
            cpus=list(placement.cpus),
            emulator_cpus=list(placement.cpus),
            hugepages=[list(h) for h in placement.hugepages],
            accel=accel,
        )
        log.info(
            "sandbox %s for pod %s: %d vCPUs on %s, %d MiB, claiming %d resources",
            sandbox_id[:12],
            pod,
            shape.vcpus,
            placement.cpus,
            shape.memory_bytes >> 20,
            len(placement.claims),
        )
        try:
            self.ledger.put_sandbox(sandbox_id, STATE_CREATING, record.created_ns, record.to_doc())
            record = self._boot(record, profile, shape, placement, accel)
        except BaseException as exc:
            self._rollback(sandbox_id, name)
            if isinstance(exc, VmSandboxError):
                log.error("sandbox %s for pod %s failed and was rolled back: %s", sandbox_id[:12], pod, exc)
                raise type(exc)(f"pod {pod}: {exc} (rolled back: domain removed, resources released)") from exc
            raise
        return sandbox_id

    def _check_passthrough(self, spec: SandboxSpec, profile: Profile) -> None:
        assert spec.declaration is not None
        for c in spec.declaration.all_containers():
            res = c.resources
            for key in (*res.requests.names(), *res.limits.names()):
                if is_extended(key):
                    if key not in profile.extended_resources:
                        raise InvalidArgument(
                            f'container "{c.name}": extended resource {key} is not mapped to a device pool '
                            f"by profile {profile.name!r}"
                        )
                    raise InvalidArgument(
                        f'container "{c.name}": extended resource {key} maps to device pool '
                        f"{profile.extended_resources[key]!r}, but device passthrough is not available in this build"
                    )
            if res.devices or res.cdi_devices:
                raise InvalidArgument(
                    f'container "{c.name}": devices and CDI devices need passthrough, '
                    "which is not available in this build"
                )

    def _boot(
        self, record: SandboxRecord, profile: Profile, shape: VmShape, placement: Placement, accel: str
    ) -> SandboxRecord:
        image = Path(profile.image_dir)
        kernel, initrd = image / "vmlinux", image / "initramfs.img"
        for f in (kernel, initrd):
            if not f.is_file():
                raise InfrastructureError(f"guest image file {f} is missing (run scripts/setup-host.sh)")
        console = None
        if self.config.console_dir:
            Path(self.config.console_dir).mkdir(parents=True, exist_ok=True)
            console = str(Path(self.config.console_dir) / f"{record.id}.log")
        domain = build_domain(
            identity=SandboxIdentity(
                sandbox_id=record.id,
                pod_name=record.meta.name,
                pod_namespace=record.meta.namespace,
                pod_uid=record.meta.uid,
                attempt=record.meta.attempt,
                runtime_handler=record.runtime_handler,
            ),
            uuid=str(uuidlib.uuid4()),
            shape=shape,
            host_cpus=placement.cpus,
            emulator_cpus=placement.cpus,
            hugepage_nodes=tuple(n for n, _, _ in placement.hugepages),
            accel="kvm" if accel == "kvm" else "tcg",
            kernel=str(kernel),
            initrd=str(initrd),
            machine=profile.machine,
            extra_cmdline=profile.kernel_cmdline,
            shape_json="",
            console_log=console,
        )
        started = time.monotonic()
        self.hypervisor.define(render(domain))
        self.hypervisor.start(domain.name)
        path = self.hypervisor.channel_path(domain.name, AGENT_CHANNEL)
        try:
            report = wait_for_hello(path, profile.boot_timeout_s)
        except InfrastructureError as exc:
            raise InfrastructureError(f"{exc}{self._console_tail(console)}") from exc
        boot_ms = int((time.monotonic() - started) * 1000)
        if report.vcpus != shape.vcpus:
            raise InfrastructureError(f"guest reports {report.vcpus} vCPUs, the domain has {shape.vcpus}")
        ready = replace(record, state=SANDBOX_READY, guest=_report_doc(report), boot_ms=boot_ms)
        self.ledger.put_sandbox(record.id, SANDBOX_READY, record.created_ns, ready.to_doc())
        log.info(
            "sandbox %s ready in %d ms (guest: %d vCPUs, MemTotal %d KiB)",
            record.id[:12],
            boot_ms,
            report.vcpus,
            report.mem_total_kib,
        )
        return ready

    @staticmethod
    def _console_tail(console: str | None) -> str:
        if not console:
            return ""
        try:
            lines = Path(console).read_text(errors="replace").strip().splitlines()[-5:]
        except OSError:
            return ""
        return "; last console lines: " + " | ".join(lines) if lines else "; the guest console is empty"

    def _rollback(self, sandbox_id: str, name: str) -> None:
        try:
            self.hypervisor.teardown(name)
        except VmSandboxError as exc:  # keep the claims: the domain may still hold the pages
            log.error("rollback of %s: tear-down failed, claims kept for reconciliation: %s", sandbox_id[:12], exc)
            return
        self.ledger.delete_sandbox(sandbox_id)

    def get(self, sandbox_id: str) -> SandboxRecord:
        if not sandbox_id:
            raise InvalidArgument("pod_sandbox_id is empty")
        row = self.ledger.get_sandbox(sandbox_id)
        if row is None or row[0] == STATE_CREATING:
            raise NotFound(f"pod sandbox {sandbox_id!r} not found")
        return SandboxRecord.from_doc(row[2])

    def find(self, sandbox_id: str) -> SandboxRecord | None:
        try:
            return self.get(sandbox_id)
        except NotFound:
            return None

    def list_sandboxes(self) -> list[SandboxRecord]:
        return [SandboxRecord.from_doc(doc) for _, state, _, doc in self.ledger.sandboxes() if state != STATE_CREATING]

    def stop(self, sandbox_id: str) -> None:
        """Destroy the guest and release its resources; unknown ids and repeats succeed."""
        if not sandbox_id:
            raise InvalidArgument("pod_sandbox_id is empty")
        with self._lock_for(sandbox_id):
            record = self.find(sandbox_id)
            if record is None:
                return
            self.hypervisor.teardown(record.domain)
            self.ledger.release(sandbox_id)
            for c in self.containers(sandbox_id):
                if c.state != CONTAINER_EXITED:
                    self._put_container(replace(c, state=CONTAINER_EXITED, reason="SandboxStopped"))
            if record.state != SANDBOX_NOTREADY:
                stopped = record.with_state(SANDBOX_NOTREADY)
                self.ledger.put_sandbox(sandbox_id, SANDBOX_NOTREADY, record.created_ns, stopped.to_doc())
                log.info("sandbox %s stopped: domain %s removed, resources released", sandbox_id[:12], record.domain)

    def remove(self, sandbox_id: str) -> None:
        if not sandbox_id:
            raise InvalidArgument("pod_sandbox_id is empty")
        self.stop(sandbox_id)
        with self._lock_for(sandbox_id):
            self.ledger.delete_sandbox(sandbox_id)
            if self.config.console_dir:
                (Path(self.config.console_dir) / f"{sandbox_id}.log").unlink(missing_ok=True)
        with self._locks_lock:
            self._sandbox_locks.pop(sandbox_id, None)

    def update_sandbox(self, sandbox_id: str, resources: LinuxResources) -> None:
        record = self.get(sandbox_id)
        shape = records.shape_from_doc(record.shape)
        admission.check_envelope(shape.demand, [], admission.Usage.of_linux(resources), who="the pod's new resources")

    # -- containers -----------------------------------------------------------------------------
    def containers(self, sandbox_id: str | None = None) -> list[ContainerRecord]:
        return [ContainerRecord.from_doc(doc) for *_, doc in self.ledger.containers(sandbox_id)]

    def container(self, container_id: str) -> ContainerRecord:
        if not container_id:
            raise InvalidArgument("container_id is empty")
        for c in self.containers():
            if c.id == container_id:
                return c
        raise NotFound(f"container {container_id!r} not found")

    def _put_container(self, c: ContainerRecord) -> None:
        self.ledger.put_container(c.id, c.sandbox_id, c.name, c.attempt, c.state, c.created_ns, c.to_doc())

    def create_container(self, sandbox_id: str, spec: ContainerSpec) -> str:
        if not spec.name:
            raise InvalidArgument("ContainerConfig.metadata.name is empty")
        if spec.attempt < 0:
            raise InvalidArgument(f"ContainerConfig.metadata.attempt is negative ({spec.attempt})")
        with self._lock_for(sandbox_id):
            record = self.get(sandbox_id)
            if record.state != SANDBOX_READY:
                raise Diverged(f"pod sandbox {sandbox_id[:12]} is not ready (it was stopped)")
            existing = self.containers(sandbox_id)
            admitted = self._admit(record, spec, existing)
            container = ContainerRecord(
                id=_new_id(),
                sandbox_id=sandbox_id,
                name=spec.name,
                attempt=spec.attempt,
                state=CONTAINER_CREATED,
                created_ns=self._clock(),
                image=spec.image,
                labels=dict(spec.labels),
                annotations=dict(spec.annotations),
                log_path=spec.log_path,
                resources=records.resources_doc(admitted),
                linux=asdict(spec.linux),
                reason="Created",
                message="admitted; vmsandbox does not run container processes in the guest yet",
            )
            self._put_container(container)
            log.info("container %s (%s) admitted into sandbox %s", spec.name, container.id[:12], sandbox_id[:12])
            return container.id

    def _admit(self, record: SandboxRecord, spec: ContainerSpec, existing: list[ContainerRecord]) -> ContainerResources:
        attachments = spec.attachments
        requested = (
            replace(attachments, requests=spec.resources.requests, limits=spec.resources.limits)
            if spec.resources is not None
            else attachments
        )
        names = [admission.Existing(c.name, c.attempt) for c in existing]
        if record.declaration is not None:
            declaration = records.declaration_from_doc(record.declaration)
            if spec.resources is not None:
                admission.admit_declared(declaration, spec.name, spec.attempt, requested, names)
            else:
                admission.check_name(declaration, spec.name, spec.attempt, names)
                decl = declaration.find(spec.name)
                assert decl is not None
                diffs = admission.linux_differences(spec.name, decl.resources, spec.linux)
                diffs += admission.attachment_differences(spec.name, decl.resources, attachments)
                if diffs:
                    raise Diverged("resources diverge from the pod's declaration: " + "; ".join(diffs))
            return requested
        for c in existing:
            if c.name == spec.name and c.attempt == spec.attempt:
                raise AlreadyExists(f'container "{spec.name}" (attempt {spec.attempt}) already exists')
        shape = records.shape_from_doc(record.shape)
        usage = self._usage(spec.resources, spec.linux)
        others = [
            self._usage(None, LinuxResources(**_linux_args(c.linux)))
            for c in existing
            if c.state != CONTAINER_EXITED and c.name != spec.name
        ]
        admission.check_envelope(shape.demand, others, usage, who=f'container "{spec.name}"')
        return requested

    @staticmethod
    def _usage(resources: ContainerResources | None, linux: LinuxResources) -> admission.Usage:
        return admission.Usage.of_resources(resources) if resources is not None else admission.Usage.of_linux(linux)

    def start_container(self, container_id: str) -> None:
        self.container(container_id)
        raise NotImplementedError(
            "vmsandbox does not run container processes in the guest yet; the container was admitted "
            "and recorded (state CONTAINER_CREATED)"
        )

    def stop_container(self, container_id: str) -> None:
        try:
            c = self.container(container_id)
        except NotFound:
            return
        if c.state != CONTAINER_EXITED:
            self._put_container(replace(c, state=CONTAINER_EXITED, reason="Stopped"))

    def remove_container(self, container_id: str) -> None:
        if not container_id:
            raise InvalidArgument("container_id is empty")
        self.ledger.delete_container(container_id)

    def update_container(self, container_id: str, resources: ContainerResources | None, linux: LinuxResources) -> None:
        c = self.container(container_id)
        with self._lock_for(c.sandbox_id):
            record = self.get(c.sandbox_id)
            shape = records.shape_from_doc(record.shape)
            others = [
                self._usage(None, LinuxResources(**_linux_args(o.linux)))
                for o in self.containers(c.sandbox_id)
                if o.id != c.id and o.state != CONTAINER_EXITED
            ]
            new_linux = admission.implied_linux(resources) if resources is not None else linux
            admission.check_envelope(shape.demand, others, self._usage(resources, linux), who=f'update of "{c.name}"')
            self._put_container(replace(c, linux=asdict(new_linux)))

    # -- start-up -------------------------------------------------------------------------------
    def reconcile(self) -> dict[str, list[str]]:
        """Make the ledger and libvirt agree; adopt what is whole, remove what is half-made."""
        report: dict[str, list[str]] = {"adopted": [], "removed_domains": [], "stopped": [], "released": []}
        domains = {d.sandbox_id: d for d in self.hypervisor.list_ours()}
        rows = {sid: (state, doc) for sid, state, _, doc in self.ledger.sandboxes()}
        for sid, dom in domains.items():
            state = rows.get(sid, (None, None))[0]
            if state == SANDBOX_READY and dom.active:
                report["adopted"].append(sid)
                log.info("reconcile: adopted running sandbox %s (domain %s)", sid[:12], dom.name)
                continue
            log.warning("reconcile: removing domain %s (ledger state %s, active %s)", dom.name, state, dom.active)
            self.hypervisor.teardown(dom.name)
            report["removed_domains"].append(dom.name)
        for sid, (state, doc) in rows.items():
            if state == STATE_CREATING:
                log.warning("reconcile: sandbox %s was half-made; forgetting it", sid[:12])
                self.ledger.delete_sandbox(sid)
                report["released"].append(sid)
            elif state == SANDBOX_READY and (sid not in domains or not domains[sid].active):
                log.warning("reconcile: sandbox %s lost its guest; marking it NOTREADY", sid[:12])
                record = SandboxRecord.from_doc(doc)
                self.ledger.release(sid)
                self.ledger.put_sandbox(
                    sid, SANDBOX_NOTREADY, record.created_ns, record.with_state(SANDBOX_NOTREADY).to_doc()
                )
                report["stopped"].append(sid)
        known = {sid for sid, (state, _) in rows.items() if state == SANDBOX_READY}
        for owner in self.ledger.claim_owners() - known:
            if owner in report["adopted"]:
                continue
            log.warning("reconcile: releasing claims of %s, which has no running sandbox", owner[:12])
            self.ledger.release(owner)
            report["released"].append(owner)
        return report


def _linux_args(doc: dict[str, Any]) -> dict[str, Any]:
    args = dict(doc)
    args["hugepage_limits"] = tuple(tuple(p) for p in args.get("hugepage_limits", ()))
    return args


def _report_doc(report: GuestReport) -> dict[str, Any]:
    return dict(report_to_body(report))
