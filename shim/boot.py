"""``Boot``: a pod's guest — its record's QEMU uid, its domain, its start (restored from the
snapshot of its shape, or cold-booted) and the checks of its report — and the snapshots its
shape is restored from.

Each method is one step of RunPodSandbox (``shim.rpc.run_pod_sandbox``), which orders them and
undoes them: ``record`` writes the ``creating`` row with a QEMU uid of its own (``qemu_uids``,
shared with the guests that make snapshots, which no record holds), ``guest`` builds the domain
and chooses a restore or a cold boot (through ``Snapshots``), ``define`` and ``start`` bring the
guest up (a restore that fails is undone here and the guest cold-boots), ``ready`` checks its
report and writes the READY row, and ``remove_domain`` is the undo of ``define``; ``place`` moves
its QEMU into the pod's cgroup on the host. It also makes
snapshots: in the background for a shape's first pod (``make_snapshot_later``), and on demand for
``vmsandbox snapshot make``. Records are written through ``shim.records``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
import uuid as uuidlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from shim.console_logs import console_path, console_tail
from shim.host_policy import domain_for
from shim.model import SANDBOX_READY, PassedGroup, SandboxRecord, SandboxSpec
from shim.pod_networks import Attachment
from shim.records import new_id
from shim.sandbox_part import Owners, SandboxPart
from shim.snapshots import MakeRequest, Progress, SnapshotUnusable
from vmsandbox import validation
from vmsandbox.adapters.guest_channel import wait_for_hello
from vmsandbox.adapters.host_cgroup import HostCgroups
from vmsandbox.adapters.snapshot_store import StoredSnapshot
from vmsandbox.agent_protocol import GuestReport, report_to_body
from vmsandbox.devices import NO_DEVICES
from vmsandbox.domain import AGENT_CHANNEL, Domain, NetworkInterface, SandboxIdentity, SharedDir, domain_name
from vmsandbox.domain_xml import render
from vmsandbox.dra import ClaimedNic, claimed_nic_problems
from vmsandbox.errors import CannotFit, InfrastructureError, InvalidArgument, VmSandboxError
from vmsandbox.lifecycle import STATE_CREATING, SandboxPlan
from vmsandbox.network import GuestNic, guest_network_args
from vmsandbox.placement import Placement
from vmsandbox.profile import Profile
from vmsandbox.qemu_user import pick_uid
from vmsandbox.resources import hugepage_resource
from vmsandbox.sizing import VmShape
from vmsandbox.snapshot_rules import PLACEHOLDER_MAC, restore_domain, restore_refusal, snapshot_domain_name

log = logging.getLogger(__name__)
CLAIMED_NICS_WRONG = "the guest's claimed NICs are not as claimed"  # the ready check's error, for the claims' status


@dataclass(frozen=True)
class Guest:
    """How a pod's guest starts: its domain, and the snapshot it is restored from (None: it
    cold-boots, for the reason ``why`` gives)."""

    domain: Domain
    plan: SandboxPlan
    nic: GuestNic | None
    network_args: tuple[str, ...]  # the kernel command line's network parameters (a snapshot's input)
    console: str | None
    snapshot: StoredSnapshot | None
    why: str
    make: MakeRequest | None  # the shape has no snapshot yet: the one to make once the pod is READY
    claimed_nics: tuple[ClaimedNic, ...] = ()  # its DRA claims' NICs (vmsandbox.dra.claimed_nics)


class Boot(SandboxPart):
    def __init__(self, owners: Owners) -> None:
        super().__init__(owners)
        # the state directory as each domain's metadata names it (the real path, links resolved)
        self._state_path = os.path.realpath(self.config.state_dir)
        self._uid_lock = threading.Lock()  # held from choosing a QEMU uid until the record holding it is written
        # QEMU uids of snapshot guests being made (they run no pod, so no record holds them)
        self._snapshot_uids: set[int] = set()
        # the host's cgroups a pod's QEMU joins (its record's cgroup_parent)
        self.cgroups = HostCgroups(self.config.cgroup_root, self.config.proc_root)

    def record(self, spec: SandboxSpec, plan: SandboxPlan, placement: Placement, sandbox_id: str) -> SandboxRecord:
        """Write the pod's ``creating`` row: what it asked for, what it was given (``placement``,
        claimed for it) and a QEMU uid no other sandbox or snapshot guest has."""
        meta, shape = spec.meta, plan.shape
        record = SandboxRecord(
            id=sandbox_id,
            meta=meta,
            state=STATE_CREATING,
            created_ns=self._clock(),
            runtime_handler=spec.runtime_handler or self.config.default_handler,
            profile=plan.profile.name,
            domain=domain_name(sandbox_id),
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
            accel=plan.accel,
            linux_overhead=spec.linux_overhead,
            namespaces=spec.namespaces,
            userns=spec.userns,
            port_mappings=tuple(spec.port_mappings),
            dns=spec.dns,
            cgroup_parent=spec.cgroup_parent,
            sysctls=dict(spec.sysctls),
        )
        log.info(
            "sandbox %s for pod %s/%s: %d vCPUs on %s, %d MiB, %s, claimed %s",
            sandbox_id[:12],
            meta.namespace,
            meta.name,
            shape.vcpus,
            placement.cpus,
            shape.memory_bytes >> 20,
            ", ".join(g.describe() for g in placement.devices) or "no devices",
            placement.claim.describe(),
        )
        with self._uid_lock:
            record = replace(record, qemu_uid=self._pick_uid())
            self.records.put_sandbox(record)
        return record

    def guest(
        self,
        record: SandboxRecord,
        plan: SandboxPlan,
        placement: Placement,
        attachment: Attachment,
        shared: tuple[SharedDir, ...],
        claimed_nics: tuple[ClaimedNic, ...] = (),
    ) -> Guest:
        """The pod's domain (on ``placement``, its NIC from ``attachment``, then its claimed NICs,
        its shares ``shared``) and how its guest starts: restored from the snapshot of its shape
        when there is one (never with claimed NICs: ``restore_refusal``)."""
        profile = plan.profile
        image = Path(profile.image_dir)
        for f in (image / "vmlinux", image / "initramfs.img"):
            if not f.is_file():
                raise InfrastructureError(f"guest image file {f} is missing (run scripts/setup-host.sh)")
        console = None
        if self.config.console_dir:
            Path(self.config.console_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
            console = console_path(self.config.console_dir, record.id)
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
            shape=plan.shape,
            placement=placement,
            profile=profile,
            accel=plan.accel,
            console_log=console,
            shared_dirs=shared,
            qemu_uid=record.qemu_uid,
            interfaces=(attachment.interface,) if attachment.interface else (),
            guest_nic=nic,
            claimed_nics=claimed_nics,
            hostname=record.hostname,
        )
        network_args = guest_network_args(nic, record.hostname)
        refusal = restore_refusal(domain, enabled=profile.snapshots)
        if refusal:
            return Guest(domain, plan, nic, network_args, console, None, refusal, None, claimed_nics)
        inputs = self.snapshots.inputs(domain, network_args)
        found = self.snapshots.find(inputs)
        if found is None:
            why = f"no snapshot for its shape yet ({inputs.key[:12]})"
            return Guest(domain, plan, nic, network_args, console, None, why, MakeRequest(domain, network_args, inputs))
        return Guest(domain, plan, nic, network_args, console, found, "", None)

    def define(self, guest: Guest) -> int:
        """Define the pod's domain: as its snapshot's restore needs it, or for a cold boot. How long
        that took, in ms (for the boot's log line)."""
        started = time.monotonic()
        if guest.snapshot is not None:
            self.hypervisor.define(render(restore_domain(guest.domain, guest.network_args)))
        else:
            self.hypervisor.define(render(guest.domain))
        return int((time.monotonic() - started) * 1000)

    def remove_domain(self, name: str) -> None:
        """Tear the pod's domain down (the undo of ``define``). When libvirt cannot, the guest may
        still hold the pod's CPUs and pages: the error says that they stay held."""
        try:
            self.hypervisor.teardown(name)
        except VmSandboxError as exc:
            raise InfrastructureError(
                f"domain {name} could not be removed, so its resources stay held until the shim's reconciliation "
                f"removes it: {exc}"
            ) from exc

    def start(
        self, record: SandboxRecord, guest: Guest, define_ms: int, started: Callable[[], None] = lambda: None
    ) -> tuple[GuestReport, dict[str, Any]]:
        """Start the guest of the defined domain: restored from its snapshot (a restore that fails is
        undone, logged with its cause, and the guest cold-boots instead) or booted. ``define_ms``:
        how long ``define`` took, for the boot's log line. ``started`` is called once the pod's QEMU
        runs, before its guest does when it cold-boots (its vCPUs paused until then), right after
        the restore when it is restored. Its report, and how it started (as the READY record keeps it)."""
        why = guest.why
        if guest.snapshot is not None:
            report = self._restore(record, guest, guest.snapshot)
            if report is not None:
                started()
                return report, {"by": "restore", "snapshot": guest.snapshot.key}
            why = f"restore from snapshot {guest.snapshot.key[:12]} failed"
            defining = time.monotonic()
            self.hypervisor.define(render(guest.domain))  # the restore's domain is gone: the cold boot's in its place
            define_ms = int((time.monotonic() - defining) * 1000)
        return self._cold_boot(record, guest, define_ms, started), {"by": "boot", "why": why}

    def ready(
        self, record: SandboxRecord, guest: Guest, report: GuestReport, start: dict[str, Any], boot_ms: int
    ) -> SandboxRecord:
        """Check the guest's report against its domain and write the READY record."""
        shape = guest.plan.shape
        problems = [e for e in report.errors if e.startswith("network:")]
        if problems:
            raise InfrastructureError(f"the guest could not configure its network: {'; '.join(problems)[:512]}")
        claimed = claimed_nic_problems(guest.claimed_nics, report.nics)
        if claimed:
            raise InfrastructureError(f"{CLAIMED_NICS_WRONG}: {'; '.join(claimed)[:512]}")
        if report.vcpus != shape.vcpus:
            raise InfrastructureError(f"guest reports {report.vcpus} vCPUs, the domain has {shape.vcpus}")
        for size, count in shape.guest_hugepages:
            pool = report.hugepages.get(size // 1024)
            got = pool.total if pool is not None else 0
            if got < count:
                raise InfrastructureError(
                    f"guest reserved {got} of the {count} {hugepage_resource(size)} pages its containers "
                    f"declared (guest RAM {shape.memory_bytes >> 20} MiB){console_tail(guest.console)}"
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
            f": {start['why']}" if start.get("why") else "",
        )
        return ready

    def place(self, record: SandboxRecord) -> Callable[[], None] | None:
        """Move the pod's QEMU, all its threads, into the pod's cgroup (its record's
        ``cgroup_parent``), where the kubelet accounts and evicts; the undo that moves it back
        (None: the pod names no cgroup, QEMU stays in libvirt's)."""
        if not record.cgroup_parent:
            return None
        pid = self.hypervisor.emulator_pid(record.domain)
        if pid is None:
            raise InfrastructureError(f"sandbox {record.id[:12]}: no QEMU process to move into {record.cgroup_parent}")
        placed = self.cgroups.place(pid, record.cgroup_parent)
        log.info("sandbox %s: QEMU (pid %d) in the cgroup %s", record.id[:12], pid, record.cgroup_parent)
        return functools.partial(self.cgroups.put_back, placed)

    def make_snapshot_later(self, guest: Guest) -> None:
        """Start making the snapshot of the guest's shape in the background when it had none (off
        the pod's critical path: its RunPodSandbox has answered)."""
        if guest.make is not None:
            plan = guest.plan
            self._make_snapshot(guest.make, plan.profile, plan.shape, plan.accel)

    def _cold_boot(
        self, record: SandboxRecord, guest: Guest, define_ms: int, qemu_started: Callable[[], None]
    ) -> GuestReport:
        name = guest.domain.name
        started = time.monotonic()
        # a pod with a cgroup of its own: QEMU moves there before the guest touches a page (its
        # memory is charged to the cgroup that first touched it, and a v1 move leaves charges behind)
        if record.cgroup_parent:
            self.hypervisor.start(name, paused=True)
            qemu_started()
            self.hypervisor.resume(name)
        else:
            self.hypervisor.start(name)
            qemu_started()
        path = self.hypervisor.channel_path(name, AGENT_CHANNEL)
        running = time.monotonic()
        try:
            report = wait_for_hello(path, guest.plan.profile.boot_timeout_s, f"sandbox {record.id[:12]}")
        except InfrastructureError as exc:
            raise InfrastructureError(f"{exc}{console_tail(guest.console)}") from exc
        log.info(
            "sandbox %s boot: define %d ms, start %d ms, guest hello %d ms",
            record.id[:12],
            define_ms,
            (running - started) * 1000,
            (time.monotonic() - running) * 1000,
        )
        return report

    def _restore(self, record: SandboxRecord, guest: Guest, snapshot: StoredSnapshot) -> GuestReport | None:
        """Restore ``snapshot`` as the pod's (defined) domain; None when that failed and was undone
        (the domain removed; the snapshot dropped when it was the snapshot that could not be
        restored, so that a later pod makes it again), so the pod cold-boots. Raises when the
        failed restore cannot be undone (the RPC's unwinding then says so)."""
        domain = guest.domain
        try:
            return self.snapshots.restore(
                snapshot,
                record.id,
                domain,
                guest.network_args,
                nic=guest.nic,
                hostname=record.hostname,
                timeout_s=guest.plan.profile.boot_timeout_s,
            )
        except VmSandboxError as exc:
            log.warning(
                "sandbox %s: restore from snapshot %s failed, cold-booting instead: %s",
                record.id[:12],
                snapshot.key[:12],
                validation.bound(str(exc), 1024),
            )
            unusable = isinstance(exc, SnapshotUnusable)
        self.hypervisor.teardown(domain.name)  # raises when it cannot: the RPC's unwinding says so
        if unusable and self.snapshots.store.remove(snapshot.key):
            log.warning("snapshot %s removed after its restore failed; it is made again", snapshot.key[:12])
        return None

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

    def make_snapshot(
        self, spec: SandboxSpec, plan: SandboxPlan, progress: Progress, *, force: bool = False
    ) -> StoredSnapshot:
        """Make (now, in this thread) the snapshot the pods of ``spec`` (which get ``plan``) would be
        restored from, on CPUs and pages claimed for it as for a pod; the stored one when it exists
        already (unless ``force``). ``vmsandbox snapshot make`` runs this."""
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


def _report_doc(report: GuestReport) -> dict[str, Any]:
    return dict(report_to_body(report))
