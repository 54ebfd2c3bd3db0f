"""``Reconciler``: the ledger and libvirt made to agree, and the guests that die or lose their agent.

At start-up, before the first RPC, and periodically beside RPCs (leaving alone every sandbox an
RPC is working on), ``lifecycle.reconcile_actions`` decides and this carries it out and logs
every decision: adopt a running guest, tear down a domain nobody records, forget a sandbox whose
RunPodSandbox did not finish, mark NOTREADY one whose guest is gone, release claims nobody
holds; then the pod networks, the sandbox directories and the console logs of forgotten
sandboxes are swept. Between reconciles, libvirt's events (``guest_stopped``, ``check_guests``)
and the owner of containers (``agent_lost``) turn a READY sandbox NOTREADY and its containers
EXITED, with the cause. It changes records through ``shim.records``, under each sandbox's lock.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from shim.console_logs import console_path, console_tail, remove_console_log
from shim.model import CONTAINER_EXITED, SANDBOX_NOTREADY, SANDBOX_READY, SandboxRecord
from shim.sandbox_part import SandboxPart
from vmsandbox import validation
from vmsandbox.claims import Claim
from vmsandbox.domain import domain_name
from vmsandbox.errors import VmSandboxError
from vmsandbox.lifecycle import Action, Guest, Row, Step, reconcile_actions

log = logging.getLogger(__name__)

LOST_EXIT_CODE = 255
LOST_REASON = "Unknown"
"""Exit code and reason of the containers of a lost agent (containerd's for a task it lost)."""


class Reconciler(SandboxPart):
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
            remove_console_log(self.config.console_dir, sid)
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
            "StopPodSandbox)%s",
            sandbox_id[:12],
            record.meta.namespace,
            record.meta.name,
            why,
            console_tail(console_path(self.config.console_dir, sandbox_id)),
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
