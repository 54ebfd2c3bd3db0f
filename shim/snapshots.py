"""Snapshots of booted guests, per shape: made on first use (in the background) or by
``vmsandbox snapshot make``, and restored by RunPodSandbox (``shim.boot``).

This owner computes a pod's snapshot inputs (``vmsandbox.snapshot_rules.inputs_for``: the shape, the
guest image's digest, the QEMU and libvirt versions, ...), makes snapshots in domains of their own
(``vmsnapshot-<key>``, never taken for a sandbox) on resources claimed like a pod's, and restores
them: a copy of the image retargeted to the pod's domain (the spare copy made ahead when there is
one, so only its header is written on the pod's path), libvirt's restore with the pod's own XML,
then the agent's ``personalize``, sent as the connection's first request (one round trip: what the
agent would have said first is known from the making). Where snapshots are kept belongs to
``vmsandbox.adapters.snapshot_store``.

A snapshot made in the background never keeps a pod out: its claim is taken here only while no pod
is asking for room, and a pod that does not fit beside it takes the making's guest down and its
claim back (``give_way``) before that pod is placed again.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
import uuid as uuidlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from shim import faults
from shim.host_resources import ResourceManager
from vmsandbox.adapters.guest_channel import GuestChannel
from vmsandbox.adapters.hypervisor import Hypervisor
from vmsandbox.adapters.snapshot_store import SavedAgent, SnapshotStore, StoredSnapshot
from vmsandbox.agent_protocol import PERSONALIZE_VERSION, VERSION, GuestReport
from vmsandbox.domain import AGENT_CHANNEL, Domain, SharedDir
from vmsandbox.domain_xml import read_identity, render
from vmsandbox.errors import CannotFit, InfrastructureError, InternalError, VmSandboxError, WrongState
from vmsandbox.network import GuestNic
from vmsandbox.placement import Placement
from vmsandbox.profile import Profile
from vmsandbox.sizing import VmShape
from vmsandbox.snapshot_rules import (
    SEED_BYTES,
    SNAPSHOT_DOMAIN_PREFIX,
    SnapshotInputs,
    inputs_for,
    personalize_args,
    restore_domain,
    snapshot_domain,
)

log = logging.getLogger(__name__)

Progress = Callable[[str], None]


@dataclass(frozen=True)
class MakeRequest:
    """What a snapshot is made from: a pod's domain (its shape, devices, image) and the kernel
    command-line parameters that carried the pod's identity (left out of the snapshot)."""

    pod_domain: Domain
    network_args: tuple[str, ...]
    inputs: SnapshotInputs


class SnapshotUnusable(InfrastructureError):
    """The snapshot itself could not be restored (its image missing, truncated or corrupt, or
    refused by libvirt): it is dropped, so a later pod of its shape makes it again."""


class Snapshots:
    def __init__(self, state_dir: str, hypervisor: Hypervisor, owner: str, resources: ResourceManager) -> None:
        self.store = SnapshotStore(state_dir)
        self.hypervisor = hypervisor
        self.owner = owner  # the state database's instance id: snapshot domains carry it
        self.resources = resources  # where a background making's claim is held, under the snapshot's key
        self._versions: tuple[str, str] | None = None
        self._digests: dict[tuple[str, int, int, int], str] = {}
        self._making: set[str] = set()
        self._stopping = False
        self._lock = threading.Lock()  # guards the above; held while a making takes its claim
        # held while a snapshot guest is started and while a give-way removes them: a guest is either
        # started before the give-way looks (and removed by it) or not started at all
        self._starting = threading.Lock()
        self._give_way = threading.Event()  # a pod needs what the snapshot being made holds

    # -- inputs ---------------------------------------------------------------------------------
    def _host_versions(self) -> tuple[str, str]:
        if self._versions is None:
            self._versions = (self.hypervisor.qemu_version(), self.hypervisor.version())
        return self._versions

    def image_digest(self, domain: Domain) -> str:
        """sha256 over the guest's kernel and initramfs (re-hashed when either file changes)."""
        h = hashlib.sha256()
        for path in (domain.boot.kernel, domain.boot.initrd):
            st = os.stat(path)
            stamp = (path, st.st_ino, st.st_size, st.st_mtime_ns)
            digest = self._digests.get(stamp)
            if digest is None:
                with open(path, "rb") as f:
                    digest = hashlib.file_digest(f, "sha256").hexdigest()
                self._digests[stamp] = digest
            h.update(digest.encode())
        return h.hexdigest()

    def inputs(self, domain: Domain, network_args: tuple[str, ...]) -> SnapshotInputs:
        qemu, libvirt_version = self._host_versions()
        return inputs_for(
            domain,
            network_args,
            image_digest=self.image_digest(domain),
            qemu_version=qemu,
            libvirt_version=libvirt_version,
        )

    def find(self, inputs: SnapshotInputs) -> StoredSnapshot | None:
        return self.store.get(inputs.key)

    # -- making ---------------------------------------------------------------------------------
    def make(
        self,
        request: MakeRequest,
        pod_domain_for: Callable[[tuple[SharedDir, ...]], Domain],
        *,
        qemu_uid: int,
        boot_timeout_s: float,
        progress: Progress = lambda _line: None,
    ) -> StoredSnapshot:
        """Boot a guest of the request's shape with no pod identity, wait for its agent, save it.
        ``pod_domain_for`` builds the pod-like domain on resources the caller claimed for the
        snapshot, given the snapshot's own shared directories; its QEMU runs as ``qemu_uid``, which
        the caller chose from ``qemu_uids`` as for a pod (never root) and holds until this returns."""
        key = request.inputs.key
        started = time.monotonic()
        making = self.store.making_dir(key)
        shares = self.store.share_dirs(making, len(request.pod_domain.shared_dirs), qemu_uid)
        base = pod_domain_for(
            tuple(replace(s, source=src) for s, src in zip(request.pod_domain.shared_dirs, shares, strict=True))
        )
        if base.qemu_uid != qemu_uid or qemu_uid <= 0:
            self.store.abandon(key)
            raise InternalError(f"a snapshot guest's QEMU must run as its own unprivileged uid, not {base.qemu_uid}")
        domain = snapshot_domain(
            base,
            request.network_args,
            key=key,
            uuid=str(uuidlib.uuid4()),
            owner=self.owner,
            shared_dirs=base.shared_dirs,
            console_log=str(making / "console.log") if base.console else None,
        )
        try:
            log.info("snapshot %s: booting its guest (%s)", key[:12], request.inputs.describe())
            progress(f"booting a {request.inputs.describe()} guest ({domain.name})")
            with self._starting:
                self._check_give_way(key)
                self.hypervisor.create_transient(render(domain))
            faults.checkpoint("snapshot:after-start")
            path = self.hypervisor.channel_path(domain.name, AGENT_CHANNEL)
            with GuestChannel.open(path, boot_timeout_s, f"snapshot {key[:12]}") as channel:
                report = channel.report
            if report.errors:
                raise InfrastructureError(f"the snapshot guest reported problems: {'; '.join(report.errors)[:512]}")
            if report.protocol < PERSONALIZE_VERSION:
                raise InfrastructureError(
                    f"the guest agent speaks protocol {report.protocol}; restoring needs {PERSONALIZE_VERSION} "
                    "(rebuild the guest image)"
                )
            booted = time.monotonic()
            progress(f"guest ready in {booted - started:.1f} s; saving")
            self.hypervisor.save(domain.name, self.store.image_path(making))
            faults.checkpoint("snapshot:after-save")
            saved = time.monotonic()
            agent = SavedAgent(report.instance, report.protocol)
            stored = self.store.commit(key, request.inputs, making, int((saved - started) * 1000), agent)
        except BaseException:
            self._remove_domain(domain.name)
            self.store.abandon(key)
            raise
        self._remove_domain(domain.name)  # saving stopped it; a transient domain is then gone
        self._refill_spare(key)  # so that the first restore copies nothing either
        progress(f"saved {stored.size_bytes >> 20} MiB in {saved - booted:.2f} s (snapshot {key[:12]})")
        log.info(
            "snapshot %s made: %s, %d MiB, boot %d ms, save %d ms",
            key[:12],
            request.inputs.describe(),
            stored.size_bytes >> 20,
            (booted - started) * 1000,
            (saved - booted) * 1000,
        )
        return stored

    def _check_give_way(self, key: str) -> None:
        if self._give_way.is_set():
            raise WrongState(f"snapshot {key[:12]}: given up for a pod that needs its CPUs and pages")

    @contextmanager
    def claimed(self, key: str, shape: VmShape, profile: Profile) -> Iterator[Placement]:
        """Hold a pod's worth of resources of ``shape`` for making snapshot ``key`` while the ``with``
        block runs. Refused (``WrongState``) once a pod has asked the making to give way, so the
        claim is never taken after ``give_way`` looked; ``CannotFit`` when it does not fit."""
        with self._lock:
            self._check_give_way(key)
            placement = self.resources.reserve(key, shape, profile)
        try:
            yield placement
        finally:
            self.resources.release(key)  # nothing left to release when a give-way took it back

    def give_way(self) -> bool:
        """A pod does not fit while a snapshot is being made in the background: stop making it and
        take its claim back now, before the pod is placed again (the making thread ends on its
        own; the next pod of that shape makes the snapshot again). True when a making was stopped
        and holds nothing any more, so the pod may try again; False when none was being made or its
        guest could not be removed (it then still runs on what it holds)."""
        with self._lock:
            if not self._making:
                return False
            self._give_way.set()
            keys = sorted(self._making)
        log.info("snapshot %s: giving way to a pod that does not fit beside it", ", ".join(k[:12] for k in keys))
        if not self._remove_guests():
            return False
        for key in keys:
            if self.resources.release(key):
                log.info("snapshot %s: its claim released for the pod", key[:12])
        return True

    def make_in_background(self, key: str, work: Callable[[], object]) -> bool:
        """Run ``work`` (which makes snapshot ``key``, holding ``claimed``) in a thread of its own,
        unless one is making any snapshot already (one at a time: it holds a pod's worth of CPUs and
        pages). False when nothing was started."""
        with self._lock:
            if self._making or self._stopping:
                return False
            self._making.add(key)
            self._give_way.clear()

        def run() -> None:
            try:
                work()
            except CannotFit as exc:
                log.info("snapshot %s not made now: %s", key[:12], exc)
            except VmSandboxError as exc:
                log.warning("snapshot %s not made: %s", key[:12], exc)
            except Exception:
                log.exception("snapshot %s not made", key[:12])
            finally:
                with self._lock:
                    self._making.discard(key)
                    if not self._making:
                        self._give_way.clear()  # a later ``snapshot make`` in this process is not refused

        threading.Thread(target=run, name=f"snapshot-{key[:8]}", daemon=True).start()
        return True

    def _remove_guests(self) -> bool:
        """Remove the guests of snapshots being made, with none starting meanwhile (the caller set
        ``_give_way`` or ``_stopping`` first); True when none of ours is left."""
        with self._starting:
            try:
                self._remove_owned_domains()
                left = self._owned_domains()
            except VmSandboxError as exc:
                log.error("snapshot domains not listed: %s", exc)
                return False
        if left:
            log.error("snapshot domains %s still there: their claims stay held", ", ".join(left))
        return not left

    def _owned_domains(self) -> list[str]:
        """Our snapshot domains (other vmsandbox states' on the same libvirt are left alone)."""
        out = []
        for info in self.hypervisor.list_domains(SNAPSHOT_DOMAIN_PREFIX):
            ident = read_identity(info.xml)
            if ident is not None and ident.owner == self.owner:
                out.append(info.name)
        return out

    def _remove_owned_domains(self) -> None:
        for name in self._owned_domains():
            log.warning("removing snapshot domain %s", name)
            self._remove_domain(name)

    def _remove_domain(self, name: str) -> None:
        try:
            self.hypervisor.teardown(name)
        except VmSandboxError as exc:
            log.error("snapshot domain %s not removed (the next start removes it): %s", name, exc)

    # -- restoring ------------------------------------------------------------------------------
    def restore(
        self,
        snapshot: StoredSnapshot,
        sandbox_id: str,
        pod_domain: Domain,
        network_args: tuple[str, ...],
        *,
        nic: GuestNic | None,
        hostname: str,
        timeout_s: float,
    ) -> GuestReport:
        """Restore ``snapshot`` as the (already defined) domain ``pod_domain`` and make the guest
        this pod's; the guest's report after ``personalize``. On failure the caller tears the domain
        down (the domain's name is the pod's, as for a cold boot)."""
        xml = render(restore_domain(pod_domain, network_args))
        if snapshot.agent.protocol < PERSONALIZE_VERSION:
            raise SnapshotUnusable(f"the snapshot's agent speaks protocol {snapshot.agent.protocol}")
        started = time.monotonic()
        try:
            with self.store.staged(snapshot.key, sandbox_id, pod_domain.name, pod_domain.uuid) as path:
                faults.checkpoint("restore:after-stage")
                staged = time.monotonic()
                self.hypervisor.restore(path, xml)
        except InfrastructureError as exc:
            raise SnapshotUnusable(str(exc)) from exc
        faults.checkpoint("restore:after-restore")
        restored = time.monotonic()
        channel_path = self.hypervisor.channel_path(pod_domain.name, AGENT_CHANNEL)
        # the restored agent is the snapshot's, whose protocol the making recorded: personalize is the
        # connection's first request, and its answer the agent's report (one round trip)
        args = personalize_args(nic, hostname, seed=os.urandom(SEED_BYTES), time_ns=time.time_ns())
        with GuestChannel.open_with_request(
            channel_path,
            "personalize",
            args,
            version=min(VERSION, snapshot.agent.protocol),
            timeout_s=timeout_s,
            label=f"sandbox {sandbox_id[:12]}",
        ) as channel:
            report = channel.report
        faults.checkpoint("restore:after-personalize")
        if report.instance == snapshot.agent.instance:
            raise InfrastructureError("the restored agent kept the snapshot's instance id")
        log.info(
            "sandbox %s restore from snapshot %s: copy %d ms, libvirt restore %d ms, personalize %d ms",
            sandbox_id[:12],
            snapshot.key[:12],
            (staged - started) * 1000,
            (restored - staged) * 1000,
            (time.monotonic() - restored) * 1000,
        )
        self._refill_spare(snapshot.key)
        return report

    def _refill_spare(self, key: str) -> None:
        """Copy the image ahead for the next restore, in a thread of its own (never on a pod's path)."""

        def run() -> None:
            try:
                if self.store.refill_spare(key):
                    log.debug("snapshot %s: spare copy made for the next restore", key[:12])
            except (OSError, VmSandboxError) as exc:
                log.warning("snapshot %s: no spare copy (the next restore copies the image): %s", key[:12], exc)

        threading.Thread(target=run, name=f"spare-{key[:8]}", daemon=True).start()

    def stop(self) -> None:
        """At shutdown: make no more snapshots and remove the guest of one being made (it would
        hold its CPUs and pages until the next start); the half-made files go at the next start."""
        with self._lock:
            self._stopping = True
            self._give_way.set()  # a making between its claim and its guest's start starts none
            making = bool(self._making)
        if making:
            self._remove_guests()

    # -- start-up -------------------------------------------------------------------------------
    def sweep(self, keep_restores: set[str]) -> None:
        """Remove what a shim killed while making or restoring left: our snapshot domains, half-made
        snapshots, restore copies of sandboxes not in ``keep_restores``."""
        self._remove_owned_domains()
        for path in self.store.sweep(keep_restores):
            log.warning("removed %s left by an earlier run", Path(path).name)
