"""Sandbox orchestration: size, place, claim, boot, admit, tear down, reconcile.

It admits containers into its sandboxes (their records are then moved through their life by
``shim.containers``). The records themselves, sandboxes' and containers', the pod-name registry
and the records' generation, belong to ``shim.records``: typed values (``shim.model``) decoded
once, kept in memory and written through to the ledger (ledger first, then memory), so a lookup
never reads or decodes a row. Host resources belong to ``shim.resources``,
images to ``shim.images``, pod networks to ``shim.network``. It speaks core types (``shim.model``)
and drives the IO adapters (ledger, hypervisor, sysfs, guest channel). RunPodSandbox is transactional: any
failure after the claim tears the domain down and releases every claim before the error
leaves this module.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid as uuidlib
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from shim import faults, logs, metrics
from shim.config import ShimConfig
from shim.host_policy import domain_for
from shim.model import (
    CONTAINER_CREATED,
    CONTAINER_EXITED,
    SANDBOX_NOTREADY,
    SANDBOX_READY,
    ContainerRecord,
    ContainerSpec,
    PassedGroup,
    SandboxRecord,
    SandboxSpec,
    siblings_of,
)
from shim.network import Attachment, PodNetworks
from shim.records import Records, SandboxLocks, new_id
from shim.resources import ResourceManager
from shim.sandbox_dirs import SandboxDirs
from shim.snapshots import MakeRequest, Progress, Snapshots, SnapshotUnusable
from vmsandbox import admission, validation
from vmsandbox.adapters.guest_channel import wait_for_hello
from vmsandbox.adapters.hypervisor import Hypervisor
from vmsandbox.adapters.ledger import Ledger
from vmsandbox.adapters.snapshot_store import StoredSnapshot
from vmsandbox.adapters.sysfs import read_inventory
from vmsandbox.agent_protocol import GuestReport, report_to_body
from vmsandbox.claims import Claim
from vmsandbox.devices import NO_DEVICES
from vmsandbox.domain import AGENT_CHANNEL, Domain, NetworkInterface, SandboxIdentity, SharedDir, domain_name
from vmsandbox.domain_xml import render
from vmsandbox.errors import (
    CannotFit,
    Diverged,
    InfrastructureError,
    InvalidArgument,
    VmSandboxError,
)
from vmsandbox.host import HostInventory
from vmsandbox.lifecycle import (
    STATE_CREATING,
    Action,
    Admitted,
    ContainerAsk,
    Guest,
    Row,
    SandboxPlan,
    Step,
    admit_container,
    check_fits_beside,
    plan_sandbox,
    reconcile_actions,
)
from vmsandbox.network import GuestNic, guest_network_args
from vmsandbox.placement import Placement
from vmsandbox.profile import Profile, select_profile
from vmsandbox.qemu_user import pick_uid
from vmsandbox.resources import ContainerResources, hugepage_resource
from vmsandbox.sizing import (
    LinuxResources,
    VmShape,
)
from vmsandbox.snapshot import PLACEHOLDER_MAC, restore_domain, restore_refusal, snapshot_domain_name

log = logging.getLogger(__name__)
_CONSOLE_TAIL_BYTES = 16 * 1024
_CONSOLE_LINE_CHARS = 300

LOST_EXIT_CODE = 255
LOST_REASON = "Unknown"
"""Exit code and reason of the containers of a lost agent (containerd's for a task it lost)."""


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
        resources: ResourceManager | None = None,
        network: PodNetworks | None = None,
    ) -> None:
        self.config = config
        self.ledger = ledger
        self.hypervisor = hypervisor
        self.profiles = profiles
        self.profiles_by_name = {p.name: p for p in profiles.values()}
        self.network = network or PodNetworks(config)  # the one owner of pods' namespaces and CNI attachments
        self.inventory = inventory or (lambda: read_inventory(config.sys_root, config.proc_root))
        self._clock = clock
        self.locks = SandboxLocks()
        # the one owner of the sandbox and container records (and their ledger rows), pod names and the generation
        self.records = Records(ledger)
        # each sandbox's directory (the share its guest mounts over 9p): made for a boot, dropped when
        # a boot is rolled back or the sandbox removed, swept for sandboxes that no longer exist
        self.dirs = SandboxDirs(config.state_dir, hypervisor.daemon_pid)
        # the state directory as each domain's metadata names it (the real path, links resolved)
        self._state_path = os.path.realpath(config.state_dir)
        self._uid_lock = threading.Lock()  # held from choosing a QEMU uid until the record holding it is written
        # QEMU uids of snapshot guests being made (they run no pod, so no record holds them)
        self._snapshot_uids: set[int] = set()
        first = self.inventory()
        # the one owner of CPUs, pages, memory and devices: its free state is rebuilt from the ledger
        self.resources = resources or ResourceManager.open(config, first, ledger)
        self.policy = self.resources.policy
        # the one owner of snapshots (their making, storing and restoring)
        self.snapshots = Snapshots(config.state_dir, hypervisor, ledger.instance_id, self.resources)
        for problem in self.policy.problems(first, profiles.values()):
            log.warning("%s", problem)

    # -- helpers --------------------------------------------------------------------------------
    def profile_for(self, handler: str, annotations: dict[str, str]) -> Profile:
        return select_profile(self.profiles, self.profiles_by_name, handler or self.config.default_handler, annotations)

    # -- sandboxes ------------------------------------------------------------------------------
    def run(self, spec: SandboxSpec) -> str:
        started = time.monotonic()
        meta = spec.meta
        logs.bind(pod=f"{meta.namespace}/{meta.name}")
        for field_name in ("name", "namespace", "uid"):
            if not getattr(meta, field_name):
                raise InvalidArgument(f"PodSandboxConfig.metadata.{field_name} is empty")
        if meta.attempt < 0:
            raise InvalidArgument(f"PodSandboxConfig.metadata.attempt is negative ({meta.attempt})")
        plan = self.plan(spec)
        sandbox_id = new_id()
        self.records.reserve_name(meta, sandbox_id)
        self.locks.in_flight.add(sandbox_id)
        try:
            return self._run(spec, plan, sandbox_id, started)
        except BaseException:
            self.records.release_name(meta, sandbox_id)
            raise
        finally:
            self.locks.in_flight.discard(sandbox_id)

    def plan(self, spec: SandboxSpec) -> SandboxPlan:
        """What the pod gets (profile, shape, devices, accelerator): the same function ``vmsandbox plan`` runs."""
        facts = self.policy.facts(self.inventory(), spec.declaration, kvm_device=os.path.exists("/dev/kvm"))
        return plan_sandbox(spec, self.profiles, facts, default_handler=self.config.default_handler)

    def _run(self, spec: SandboxSpec, plan: SandboxPlan, sandbox_id: str, started: float) -> str:
        meta = spec.meta
        pod = f"{meta.namespace}/{meta.name}"
        profile, shape, devices, accel = plan.profile, plan.shape, plan.devices, plan.accel
        logs.bind(sandbox_id=sandbox_id)
        name = domain_name(sandbox_id)
        faults.checkpoint("run:before-claim")
        try:
            placement = self.resources.reserve(sandbox_id, shape, profile, devices)
        except CannotFit:
            # pods come first: a snapshot being made in the background gives its claim back
            if not self.snapshots.give_way():
                raise
            placement = self.resources.reserve(sandbox_id, shape, profile, devices)
        faults.checkpoint("run:after-claim")
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
            declaration=spec.declaration,
            shape=shape,
            cpus=tuple(placement.cpus),
            emulator_cpus=tuple(placement.emulator_cpus),
            hugepages=tuple(placement.hugepages),
            devices=tuple(PassedGroup.of(g) for g in placement.devices),
            accel=accel,
            linux_overhead=spec.linux_overhead,
            namespaces=spec.namespaces,
            port_mappings=tuple(spec.port_mappings),
            dns=spec.dns,
        )
        log.info(
            "sandbox %s for pod %s: %d vCPUs on %s, %d MiB, %s, claimed %s",
            sandbox_id[:12],
            pod,
            shape.vcpus,
            placement.cpus,
            shape.memory_bytes >> 20,
            ", ".join(g.describe() for g in placement.devices) or "no devices",
            placement.claim.describe(),
        )
        try:
            with self._uid_lock:
                record = replace(record, qemu_uid=self._pick_uid())
                self.records.put_sandbox(record)
            attachment = self.network.attach(
                sandbox_id, meta, spec.namespaces, spec.port_mappings, dict(spec.annotations)
            )
            faults.checkpoint("run:after-network")
            record = replace(record, network=attachment.network)
            record, make_snapshot = self._boot(
                record, profile, shape, placement, accel, attachment, plan.shared_storage_bytes
            )
        except BaseException as exc:
            outcome = self._rollback(sandbox_id, name)
            if isinstance(exc, VmSandboxError):
                log.error("sandbox %s for pod %s failed: %s (%s)", sandbox_id[:12], pod, exc, outcome)
                raise type(exc)(f"pod {pod}: {exc} ({outcome})") from exc
            raise
        faults.checkpoint("run:after-ready")
        metrics.observe_start(record.runtime_handler, time.monotonic() - started)
        if make_snapshot is not None:
            make_snapshot()
        return sandbox_id

    def _pick_uid(self) -> int:
        """A uid of ``qemu_uids`` no sandbox (creating ones too) and no snapshot guest has; the
        caller holds ``_uid_lock`` until whatever holds the uid is recorded."""
        used = {r.qemu_uid for r in self.records.every_sandbox()} | self._snapshot_uids
        uid = pick_uid(self.config.qemu_uids, used)
        if uid is None:
            raise CannotFit(
                f"every uid of qemu_uids ({self.config.qemu_uids}) runs a sandbox's or snapshot's QEMU: "
                "remove sandboxes or widen the range"
            )
        return uid

    @contextlib.contextmanager
    def _snapshot_uid(self, key: str) -> Iterator[int]:
        """An unprivileged uid of ``qemu_uids`` for the QEMU of snapshot ``key``'s guest, held as a
        pod's is while the ``with`` block runs; kept held after it when that guest is still there
        (its removal failed: the next start removes it), so that no pod's QEMU shares its uid."""
        with self._uid_lock:
            uid = self._pick_uid()
            self._snapshot_uids.add(uid)
        try:
            yield uid
        finally:
            try:
                gone = not self.hypervisor.is_active(snapshot_domain_name(key))
            except VmSandboxError:
                gone = False
            if gone:
                with self._uid_lock:
                    self._snapshot_uids.discard(uid)
            else:
                log.error("snapshot %s: its guest is still there; QEMU uid %d stays taken", key[:12], uid)

    def _boot(
        self,
        record: SandboxRecord,
        profile: Profile,
        shape: VmShape,
        placement: Placement,
        accel: str,
        attachment: Attachment,
        storage_bytes: int,
    ) -> tuple[SandboxRecord, Callable[[], None] | None]:
        """Start the pod's guest: restored from the snapshot of its shape when there is one (a
        restore that fails is rolled back, logged with its cause, and the pod cold-boots), else
        booted. Returns the READY record and, when the shape had no snapshot yet, the work that
        makes one (for the caller to start once the pod is READY, off its critical path)."""
        image = Path(profile.image_dir)
        kernel, initrd = image / "vmlinux", image / "initramfs.img"
        for f in (kernel, initrd):
            if not f.is_file():
                raise InfrastructureError(f"guest image file {f} is missing (run scripts/setup-host.sh)")
        console = None
        if self.config.console_dir:
            Path(self.config.console_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
            console = str(Path(self.config.console_dir) / f"{record.id}.log")
        nic = attachment.network.nic
        domain = domain_for(
            identity=SandboxIdentity(
                sandbox_id=record.id,
                pod_name=record.meta.name,
                pod_namespace=record.meta.namespace,
                pod_uid=record.meta.uid,
                attempt=record.meta.attempt,
                runtime_handler=record.runtime_handler,
                owner=self.ledger.instance_id,
                state_dir=self._state_path,
            ),
            uuid=str(uuidlib.uuid4()),
            shape=shape,
            placement=placement,
            profile=profile,
            accel=accel,
            console_log=console,
            shared_dirs=self.dirs.make(record.id, record.qemu_uid, storage_bytes),
            qemu_uid=record.qemu_uid,
            interfaces=(attachment.interface,) if attachment.interface else (),
            guest_nic=nic,
            hostname=record.hostname,
        )
        network_args = guest_network_args(nic, record.hostname)
        started = time.monotonic()
        make_later: Callable[[], None] | None = None
        report: GuestReport | None = None
        start: dict[str, Any] = {"by": "boot"}
        refusal = restore_refusal(domain, enabled=profile.snapshots)
        if refusal:
            start["why"] = refusal
        else:
            inputs = self.snapshots.inputs(domain, network_args)
            found = self.snapshots.find(inputs)
            if found is None:
                start["why"] = f"no snapshot for its shape yet ({inputs.key[:12]})"
                request = MakeRequest(domain, network_args, inputs)
                make_later = lambda: self._make_snapshot(request, profile, shape, accel)  # noqa: E731
            else:
                report = self._restore(record, domain, network_args, found, nic, profile)
                if report is None:
                    start["why"] = f"restore from snapshot {found.key[:12]} failed"
                else:
                    start = {"by": "restore", "snapshot": found.key}
        if report is None:
            report = self._cold_boot(record, domain, profile, console)
        boot_ms = int((time.monotonic() - started) * 1000)
        problems = [e for e in report.errors if e.startswith("network:")]
        if problems:
            raise InfrastructureError(f"the guest could not configure its network: {'; '.join(problems)[:512]}")
        if report.vcpus != shape.vcpus:
            raise InfrastructureError(f"guest reports {report.vcpus} vCPUs, the domain has {shape.vcpus}")
        for size, count in shape.guest_hugepages:
            pool = report.hugepages.get(size // 1024)
            got = pool.total if pool is not None else 0
            if got < count:
                raise InfrastructureError(
                    f"guest reserved {got} of the {count} {hugepage_resource(size)} pages its containers "
                    f"declared (guest RAM {shape.memory_bytes >> 20} MiB){self._console_tail(console)}"
                )
        ready = replace(record, state=SANDBOX_READY, guest={**_report_doc(report), "start": start}, boot_ms=boot_ms)
        self.records.put_sandbox(ready)
        log.info(
            "sandbox %s ready in %d ms by %s (guest: %d vCPUs, MemTotal %d KiB)%s",
            record.id[:12],
            boot_ms,
            start["by"],
            report.vcpus,
            report.mem_total_kib,
            f": {start['why']}" if "why" in start else "",
        )
        return ready, make_later

    def _cold_boot(self, record: SandboxRecord, domain: Domain, profile: Profile, console: str | None) -> GuestReport:
        started = time.monotonic()
        self.hypervisor.define(render(domain))
        faults.checkpoint("run:after-define")
        defined = time.monotonic()
        self.hypervisor.start(domain.name)
        faults.checkpoint("run:after-start")
        path = self.hypervisor.channel_path(domain.name, AGENT_CHANNEL)
        running = time.monotonic()
        try:
            report = wait_for_hello(path, profile.boot_timeout_s, f"sandbox {record.id[:12]}")
        except InfrastructureError as exc:
            raise InfrastructureError(f"{exc}{self._console_tail(console)}") from exc
        log.info(
            "sandbox %s boot: define %d ms, start %d ms, guest hello %d ms",
            record.id[:12],
            (defined - started) * 1000,
            (running - defined) * 1000,
            (time.monotonic() - running) * 1000,
        )
        return report

    def _restore(
        self,
        record: SandboxRecord,
        domain: Domain,
        network_args: tuple[str, ...],
        snapshot: StoredSnapshot,
        nic: GuestNic | None,
        profile: Profile,
    ) -> GuestReport | None:
        """Restore ``snapshot`` as the pod's domain; None when that failed and was undone (the
        domain removed; the snapshot dropped when it was the snapshot that could not be restored,
        so that a later pod makes it again), so the pod cold-boots. Raises when the failed restore
        cannot be undone (the caller's rollback then says so)."""
        try:
            self.hypervisor.define(render(restore_domain(domain, network_args)))
            faults.checkpoint("restore:after-define")
            return self.snapshots.restore(
                snapshot,
                record.id,
                domain,
                network_args,
                nic=nic,
                hostname=record.hostname,
                timeout_s=profile.boot_timeout_s,
            )
        except VmSandboxError as exc:
            log.warning(
                "sandbox %s: restore from snapshot %s failed, cold-booting instead: %s",
                record.id[:12],
                snapshot.key[:12],
                validation.bound(str(exc), 1024),
            )
            unusable = isinstance(exc, SnapshotUnusable)
        self.hypervisor.teardown(domain.name)  # raises when it cannot: the pod's rollback says so
        if unusable and self.snapshots.store.remove(snapshot.key):
            log.warning("snapshot %s removed after its restore failed; it is made again", snapshot.key[:12])
        return None

    def make_snapshot(self, spec: SandboxSpec, progress: Progress, *, force: bool = False) -> StoredSnapshot:
        """Make (now, in this thread) the snapshot the pods of ``spec`` would be restored from, on
        CPUs and pages claimed for it as for a pod; the stored one when it exists already (unless
        ``force``). ``vmsandbox snapshot make`` runs this."""
        plan = self.plan(spec)
        profile, shape, accel = plan.profile, plan.shape, plan.accel
        if plan.devices != NO_DEVICES:
            raise InvalidArgument("pods with passed-through devices always cold-boot: no snapshot is made for them")
        if not profile.snapshots:
            raise InvalidArgument(f"profile {profile.name!r} turns snapshots off (snapshots: false)")
        kind: Literal["user", "ethernet", ""] = (
            "user" if spec.namespaces.host_network else ("ethernet" if self.config.pod_network == "cni" else "")
        )
        owner = new_id()
        self.locks.in_flight.add(owner)
        try:
            placement = self.resources.reserve(owner, shape, profile)
            try:
                # the pod's shares give their shape only: the snapshot's guest gets empty ones of its own
                shared = self.dirs.make(owner, 0, None)
                pod_domain = self._snapshot_domain(
                    owner,
                    shape,
                    placement,
                    profile,
                    accel,
                    console=bool(self.config.console_dir),
                    shared=shared,
                    interfaces=(NetworkInterface(kind, PLACEHOLDER_MAC),) if kind else (),
                    qemu_uid=0,  # never started: the snapshot's inputs only (its guest gets a uid below)
                )
                refusal = restore_refusal(pod_domain, enabled=True)
                if refusal:
                    raise InvalidArgument(f"these pods always cold-boot: {refusal}")
                inputs = self.snapshots.inputs(pod_domain, ())
                found = self.snapshots.find(inputs)
                if found is not None and not force:
                    progress(f"snapshot {found.key[:12]} exists already ({inputs.describe()})")
                    return found
                with self._snapshot_uid(inputs.key) as uid:
                    return self.snapshots.make(
                        MakeRequest(pod_domain, (), inputs),
                        lambda dirs: replace(pod_domain, shared_dirs=dirs, qemu_uid=uid),
                        qemu_uid=uid,
                        boot_timeout_s=profile.boot_timeout_s,
                        progress=progress,
                    )
            finally:
                self.resources.release(owner)
                self.dirs.drop(owner)
        finally:
            self.locks.in_flight.discard(owner)

    def _snapshot_domain(
        self,
        owner: str,
        shape: VmShape,
        placement: Placement,
        profile: Profile,
        accel: str,
        *,
        console: bool,
        shared: tuple[SharedDir, ...],
        interfaces: tuple[NetworkInterface, ...],
        qemu_uid: int,
    ) -> Domain:
        """The domain a snapshot's guest boots in: a pod's of that shape, with no pod's identity,
        its QEMU as ``qemu_uid``."""
        return domain_for(
            identity=SandboxIdentity(owner, "", "", "", 0, "", self.ledger.instance_id, self._state_path),
            uuid=str(uuidlib.uuid4()),
            shape=shape,
            placement=placement,
            profile=profile,
            accel=accel,
            console_log="snapshot" if console else None,
            shared_dirs=shared,
            interfaces=interfaces,
            qemu_uid=qemu_uid,
        )

    def _make_snapshot(self, request: MakeRequest, profile: Profile, shape: VmShape, accel: str) -> None:
        """Make the snapshot of ``request``'s shape in the background, on CPUs and pages claimed for
        it like a pod's (under the snapshot's key, kept from the periodic reconcile while it runs;
        given back to a pod that needs them: ``Snapshots.give_way``)."""
        key = request.inputs.key

        def work() -> None:
            self.locks.in_flight.add(key)
            try:
                with self.snapshots.claimed(key, shape, profile) as placement, self._snapshot_uid(key) as uid:
                    self.snapshots.make(
                        request,
                        lambda shared: self._snapshot_domain(
                            key,
                            shape,
                            placement,
                            profile,
                            accel,
                            console=bool(request.pod_domain.console),
                            shared=shared,
                            interfaces=request.pod_domain.interfaces,
                            qemu_uid=uid,
                        ),
                        qemu_uid=uid,
                        boot_timeout_s=profile.boot_timeout_s,
                    )
            finally:
                self.locks.in_flight.discard(key)

        self.snapshots.make_in_background(key, work)

    @staticmethod
    def _console_tail(console: str | None) -> str:
        """The guest console's last lines for an error message: the guest writes the console, so
        only its last ``_CONSOLE_TAIL_BYTES`` are read and each line is cut short."""
        if not console:
            return ""
        try:
            with open(console, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - _CONSOLE_TAIL_BYTES))
                text = f.read(_CONSOLE_TAIL_BYTES).decode(errors="replace")
        except OSError:
            return ""
        lines = [validation.bound(line, _CONSOLE_LINE_CHARS) for line in text.strip().splitlines()[-5:]]
        return "; last console lines: " + " | ".join(lines) if lines else "; the guest console is empty"

    def _rollback(self, sandbox_id: str, name: str) -> str:
        """Undo a RunPodSandbox that failed; says what was undone, as it stands when it returns."""
        try:
            self.hypervisor.teardown(name)
        except VmSandboxError as exc:  # keep the claims: the domain may still hold the pages
            log.error("rollback of %s: tear-down failed, claims kept for reconciliation: %s", sandbox_id[:12], exc)
            return (
                f"rollback incomplete: domain {name} could not be removed, so its resources stay held until "
                "the shim's reconciliation removes it"
            )
        try:
            self.dirs.drop(sandbox_id)
        except VmSandboxError as exc:  # the sweep of the next reconcile tries again
            log.error("rollback of %s: shared directory not removed yet: %s", sandbox_id[:12], exc)
        try:
            self.network.remove(sandbox_id)
        except VmSandboxError as exc:  # the record stays: reconcile deletes it once the sandbox is gone
            log.error("rollback of %s: pod network not removed yet: %s", sandbox_id[:12], exc)
            self.resources.release(sandbox_id)
            self.records.delete_sandbox(sandbox_id)
            return f"rolled back: domain removed, resources released; pod network left for reconciliation ({exc})"
        self.resources.release(sandbox_id)
        self.records.delete_sandbox(sandbox_id)
        return "rolled back: domain removed, network removed, resources released"

    def stop(self, sandbox_id: str) -> None:
        """Destroy the guest and release its resources; unknown ids and repeats succeed."""
        found = self.records.find_for_teardown(sandbox_id)
        if found is None:
            return
        sandbox_id = found.id
        with self.locks.lock_for(sandbox_id):
            record = self.records.find(sandbox_id)
            if record is None:
                return
            self.hypervisor.destroy(record.domain)
            faults.checkpoint("remove:after-destroy")
            self.hypervisor.teardown(record.domain)  # undefine
            self.resources.release(sandbox_id)
            faults.checkpoint("remove:after-release")
            self.records.exit_containers(sandbox_id, reason="SandboxStopped")
            if record.state != SANDBOX_NOTREADY:
                self.records.put_sandbox(record.with_state(SANDBOX_NOTREADY))
                log.info("sandbox %s stopped: domain %s removed, resources released", sandbox_id[:12], record.domain)
            self.network.detach(sandbox_id)  # raises while CNI DEL fails; the next Stop tries again

    def remove(self, sandbox_id: str) -> None:
        # paths below are built from the id of a row we wrote, never the client's
        found = self.records.find_for_teardown(sandbox_id)
        if found is None:
            return
        sandbox_id = found.id
        self.stop(sandbox_id)
        with self.locks.lock_for(sandbox_id):
            self.network.remove(sandbox_id)
            record = self.records.find(sandbox_id)
            if record is not None:
                self.records.release_name(record.meta, record.id)
            self.records.delete_sandbox(sandbox_id)
            self._remove_console_log(sandbox_id)
        self.locks.forget(sandbox_id)

    def update_sandbox(self, sandbox_id: str, resources: LinuxResources) -> None:
        """UpdatePodSandboxResources: accepted and recorded when it fits the VM, else FAILED_PRECONDITION."""
        sandbox_id = self.records.get(sandbox_id).id
        with self.locks.lock_for(sandbox_id):
            record = self.records.get(sandbox_id)
            admission.check_envelope(
                record.sized_shape().demand, [], admission.Usage.of_linux(resources), who="the pod's new resources"
            )
            updated = replace(record, updated_resources=resources)
            self.records.put_sandbox(updated)

    # -- containers -----------------------------------------------------------------------------
    def create_container(self, sandbox_id: str, spec: ContainerSpec) -> str:
        if not spec.name:
            raise InvalidArgument("ContainerConfig.metadata.name is empty")
        if spec.attempt < 0:
            raise InvalidArgument(f"ContainerConfig.metadata.attempt is negative ({spec.attempt})")
        sandbox_id = self.records.get(sandbox_id).id
        with self.locks.lock_for(sandbox_id):
            record = self.records.get(sandbox_id)
            if record.state != SANDBOX_READY:
                raise Diverged(f"pod sandbox {sandbox_id[:12]} is not ready (it was stopped)")
            existing = self.records.containers(sandbox_id)
            admitted = self._admit(record, spec, existing)
            container = ContainerRecord(
                id=new_id(),
                sandbox_id=sandbox_id,
                name=spec.name,
                attempt=spec.attempt,
                state=CONTAINER_CREATED,
                created_ns=self._clock(),
                image=spec.image,
                labels=dict(spec.labels),
                annotations=dict(spec.annotations),
                log_path=validation.join_log_path(record.log_directory, spec.log_path),
                resources=admitted.resources,
                # what the container's cgroup holds: as sent, else implied by its kubernetes_resources
                linux=admitted.linux,
                reason="Created",
                message="admitted; not yet created in its guest",
            )
            self.records.put_container(container)
            log.info("container %s (%s) admitted into sandbox %s", spec.name, container.id[:12], sandbox_id[:12])
            return container.id

    def _admit(self, record: SandboxRecord, spec: ContainerSpec, existing: list[ContainerRecord]) -> Admitted:
        ask = ContainerAsk(spec.name, spec.attempt, spec.resources, spec.attachments, spec.linux)
        return admit_container(record.declaration, record.sized_shape(), ask, siblings_of(existing), record.annotations)

    @staticmethod
    def _usage(resources: ContainerResources | None, linux: LinuxResources) -> admission.Usage:
        return admission.Usage.of_resources(resources) if resources is not None else admission.Usage.of_linux(linux)

    def update_container(self, container_id: str, resources: ContainerResources | None, linux: LinuxResources) -> None:
        c = self.records.container(container_id)
        with self.locks.lock_for(c.sandbox_id):
            record = self.records.get(c.sandbox_id)
            new_linux = admission.implied_linux(resources) if resources is not None and linux.empty else linux
            check_fits_beside(
                record.sized_shape().demand,
                c.name,
                self._usage(resources, linux),
                siblings_of(self.records.containers(c.sandbox_id)),
                init_order=record.init_container_names,
                annotations=record.annotations,
                who=f'update of "{c.name}"',
            )
            changes: dict[str, Any] = {"linux": new_linux}
            if resources is not None:
                changes["resources"] = replace(c.resources, requests=resources.requests, limits=resources.limits)
            self.records.change_container(c.id, **changes)

    # -- start-up -------------------------------------------------------------------------------
    def reconcile(self, *, periodic: bool = False) -> dict[str, list[str]]:
        """Make the ledger and libvirt agree (``lifecycle.reconcile_actions`` decides; this carries it
        out and logs every decision). At start-up it runs before the first RPC; ``periodic`` runs
        beside RPCs and leaves alone every sandbox an RPC is working on (a RunPodSandbox in flight,
        or any sandbox whose lock is held), so only what a crash or a lost libvirt call left behind is
        cleaned up. A domain whose tear-down fails keeps its claims and is tried again next time.
        """
        report: dict[str, list[str]] = {
            "adopted": [],
            "removed_domains": [],
            "stopped": [],
            "forgotten": [],
            "released": [],
            "foreign": [],
            "failed": [],
            "network": [],
        }
        if not periodic:
            # snapshot domains and restore copies a killed shim left, before their claims are released below
            self.snapshots.sweep(set(self.locks.in_flight))
            self.resources.resync()
            self.records.reload()
        busy = set(self.locks.in_flight)
        docs = {sid: (state, doc) for sid, state, _, doc in self.ledger.sandboxes() if sid not in busy}
        owners = self.resources.owners() - busy
        rows = [
            Row(
                sid,
                state,
                str(doc.get("domain", domain_name(sid))),
                claims_problem=self._claims_problem(sid, doc) if state == SANDBOX_READY else "",
                holds_claims=sid in owners,
            )
            for sid, (state, doc) in docs.items()
        ]
        guests = [
            Guest(d.sandbox_id, d.name, d.active, d.owner)
            for d in self.hypervisor.list_ours()
            if d.sandbox_id not in busy
        ]
        actions = reconcile_actions(rows, guests, owners, self.ledger.instance_id)
        failed: set[str] = set()
        skipped: set[str] = set()
        for action in actions:
            sid = action.sandbox_id
            if sid in failed or sid in skipped:
                continue
            if action.step is Step.LEAVE_FOREIGN:
                report["foreign"].append(action.domain)
                if not periodic:
                    log.info(
                        "reconcile: domain %s (sandbox %s) belongs to another vmsandbox state (%s); left alone",
                        action.domain,
                        sid[:12],
                        action.reason,
                    )
                continue
            lock = self.locks.lock_for(sid)
            if not lock.acquire(blocking=False):
                skipped.add(sid)  # an RPC is working on it: next time
                continue
            try:
                row = self.ledger.get_sandbox(sid)
                if periodic and (sid in self.locks.in_flight or (row[0] if row else None) != docs.get(sid, (None,))[0]):
                    skipped.add(sid)  # it changed since we looked
                    continue
                if not self._carry_out(action, docs.get(sid, (None, None))[1], report, periodic):
                    failed.add(sid)
            finally:
                lock.release()
        remaining = {sid for sid, *_ in self.ledger.sandboxes()}
        report["network"] = self.network.reconcile(remaining | busy | set(self.locks.in_flight))
        foreign = {a.sandbox_id for a in actions if a.step is Step.LEAVE_FOREIGN}
        self._sweep_console_logs(remaining | failed | skipped | busy | foreign)
        try:
            self.dirs.sweep(remaining | failed | skipped | busy | foreign | set(self.locks.in_flight))
            if not periodic:  # a shim started in a mount namespace of its own sees its guests' files again
                adopted = self.dirs.adopt(remaining)
                if adopted:
                    log.info("reconcile: the file systems of %d sandboxes are seen here again", adopted)
        except VmSandboxError as exc:
            log.error("reconcile: %s", exc)
        if periodic:  # keep the names of RunPodSandbox calls in flight; drop those of forgotten sandboxes
            self.records.keep_names(lambda sid: sid in remaining or sid in self.locks.in_flight)
        else:
            self.records.names_from_records()
        if periodic and any(report[k] for k in ("removed_domains", "stopped", "forgotten", "released", "failed")):
            log.warning("periodic reconcile: %s", {k: len(v) for k, v in report.items() if v and k != "foreign"})
        return report

    def _carry_out(
        self, action: Action, doc: dict[str, Any] | None, report: dict[str, list[str]], periodic: bool
    ) -> bool:
        """One reconcile action; False when a tear-down failed (the sandbox's later actions are skipped).
        A periodic reconcile finds the sandboxes this process runs as ADOPT: those are not news."""
        sid = action.sandbox_id
        record = SandboxRecord.from_doc(doc) if doc is not None else None
        pod = f"{record.meta.namespace}/{record.meta.name}" if record else "(unknown pod)"
        if action.step is Step.ADOPT:
            assert record is not None
            report["adopted"].append(sid)
            log.log(
                logging.DEBUG if periodic else logging.INFO,
                "reconcile: adopted sandbox %s (domain %s) of pod %s: guest running, claims (%s) and "
                "%d container records kept",
                sid[:12],
                action.domain,
                pod,
                self.resources.held(sid).describe(),
                len(self.records.containers(sid)),
            )
        elif action.step is Step.TEAR_DOWN:
            log.warning("reconcile: tearing down domain %s of sandbox %s: %s", action.domain, sid[:12], action.reason)
            try:
                self.hypervisor.teardown(action.domain)
            except VmSandboxError as exc:
                log.error(
                    "reconcile: could not tear down domain %s of sandbox %s; its claims stay held until the "
                    "next reconcile: %s",
                    action.domain,
                    sid[:12],
                    exc,
                )
                report["failed"].append(action.domain)
                return False
            report["removed_domains"].append(action.domain)
        elif action.step is Step.FORGET:
            held = self.resources.release(sid)
            self.records.delete_sandbox(sid)
            self._remove_console_log(sid)
            log.warning(
                "reconcile: forgot sandbox %s (domain %s) of pod %s: its RunPodSandbox did not finish; "
                "%d claims released",
                sid[:12],
                action.domain,
                pod,
                held,
            )
            report["forgotten"].append(sid)
        elif action.step is Step.STOP:
            assert record is not None
            released = self.resources.release(sid)
            exited = 0
            for c in self.records.containers(sid):
                if c.state != CONTAINER_EXITED:
                    self.records.put_container(replace(c, state=CONTAINER_EXITED, reason="SandboxStopped"))
                    exited += 1
            self.records.put_sandbox(record.with_state(SANDBOX_NOTREADY))
            log.warning(
                "reconcile: sandbox %s (domain %s) of pod %s has no running guest: marked NOTREADY, "
                "%d claims released, %d containers marked exited",
                sid[:12],
                action.domain,
                pod,
                released,
                exited,
            )
            report["stopped"].append(sid)
        elif action.step is Step.FINISH_STOP:
            released = self.resources.release(sid)
            log.warning(
                "reconcile: released %d claims of stopped sandbox %s (domain %s): its StopPodSandbox did not finish",
                released,
                sid[:12],
                action.domain,
            )
            report["released"].append(sid)
        elif action.step is Step.RELEASE_ORPHAN:
            released = self.resources.release(sid)
            log.warning(
                "reconcile: released %d claims of sandbox %s (domain %s), which has no row: its RunPodSandbox "
                "died right after claiming",
                released,
                sid[:12],
                domain_name(sid),
            )
            report["released"].append(sid)
        return True

    # -- guests that die, agents that are lost -------------------------------------------------
    def guest_stopped(self, domain: str, why: str) -> bool:
        """libvirt says ``domain`` stopped: a READY sandbox whose guest is gone becomes NOTREADY and its
        containers EXITED, with the cause. Its claims stay until StopPodSandbox/RemovePodSandbox (the
        kubelet's answer to NOTREADY), which tear the domain down. True when a sandbox changed."""
        for sid, state, _, _doc in self.ledger.sandboxes():
            if state != SANDBOX_READY or domain_name(sid) != domain:
                continue
            with self.locks.lock_for(sid):
                record = self.records.find(sid)
                if record is None or record.state != SANDBOX_READY or self.hypervisor.is_active(domain):
                    return False  # stopped by us, or started again meanwhile
                self._turn_notready(record, "stopped", why, reason="SandboxDied", message=why)
            log.warning(
                "sandbox %s of pod %s/%s is NOTREADY: %s (its resources stay held until StopPodSandbox)",
                sid[:12],
                record.meta.namespace,
                record.meta.name,
                why,
            )
            return True
        return False

    def agent_lost(self, sandbox_id: str, why: str) -> bool:
        """The guest's agent is not the one that ran this sandbox's containers (it restarted, forgot a
        container, or broke the protocol's bounds): the guest's word now contradicts our records, so
        the sandbox turns NOTREADY and its containers EXITED as containerd reports a container whose
        task it lost (exit code 255, reason ``Unknown``), with the cause. As for a guest that died, the
        kubelet then stops the pod and starts a new one. True when a sandbox changed."""
        if self.records.find(sandbox_id) is None:
            return False  # removed meanwhile: no lock to make for it
        with self.locks.lock_for(sandbox_id):
            record = self.records.find(sandbox_id)
            if record is None or record.state != SANDBOX_READY:
                return False
            message = f"the pod's guest agent was lost ({why}); the container's state is unknown"
            self._turn_notready(record, "lost", why, reason=LOST_REASON, message=message, exit_code=LOST_EXIT_CODE)
        log.warning(
            "sandbox %s of pod %s/%s is NOTREADY: its guest agent was lost: %s (its resources stay held until "
            "StopPodSandbox)",
            sandbox_id[:12],
            record.meta.namespace,
            record.meta.name,
            why,
        )
        return True

    def _turn_notready(
        self, record: SandboxRecord, key: str, why: str, *, reason: str, message: str, exit_code: int | None = None
    ) -> None:
        """Record a READY sandbox as NOTREADY (``guest[key]`` says why) and its containers as EXITED
        with ``reason`` (and ``exit_code`` when given); the caller holds the sandbox's lock."""
        now = self._clock()
        lost = {"exit_code": exit_code, "finished_ns": now} if exit_code is not None else {}
        self.records.exit_containers(record.id, reason=reason, message=message, **lost)
        dead = replace(record, state=SANDBOX_NOTREADY, guest={**record.guest, key: why, f"{key}_ns": now})
        self.records.put_sandbox(dead)

    def check_guests(self) -> list[str]:
        """Re-check every READY sandbox's guest (after libvirt events may have been missed); the ids of
        the sandboxes found dead."""
        dead = []
        active = {d.name for d in self.hypervisor.list_ours() if d.active}
        for sid, state, _, _doc in self.ledger.sandboxes():
            gone = state == SANDBOX_READY and domain_name(sid) not in active
            if gone and self.guest_stopped(domain_name(sid), "the guest is no longer running"):
                dead.append(sid)
        return dead

    def _claims_problem(self, sid: str, doc: dict[str, Any]) -> str:
        """How a READY sandbox's claims differ from what its record says it holds ("" when they match)."""
        record = SandboxRecord.from_doc(doc)
        expected = Claim.of(
            record.cpus if record.exclusive else (),
            (a for d in record.devices for a in d.functions),
            record.hugepages,
        )
        return self.resources.holds(sid, expected) or ""

    def _remove_console_log(self, sandbox_id: str) -> None:
        if self.config.console_dir and validation.is_id(sandbox_id):
            (Path(self.config.console_dir) / f"{sandbox_id}.log").unlink(missing_ok=True)

    def _sweep_console_logs(self, keep: set[str]) -> None:
        """Remove the console logs of sandboxes nobody remembers (a crash between tear-down and unlink)."""
        if not self.config.console_dir:
            return
        try:
            files = sorted(Path(self.config.console_dir).glob("*.log"))
        except OSError:
            return
        for f in files:
            sid = f.stem
            if sid in keep or not validation.is_full_id(sid):
                continue
            f.unlink(missing_ok=True)
            log.info(
                "reconcile: removed console log %s of forgotten sandbox %s (domain %s)", f, sid[:12], domain_name(sid)
            )


def _report_doc(report: GuestReport) -> dict[str, Any]:
    return dict(report_to_body(report))
