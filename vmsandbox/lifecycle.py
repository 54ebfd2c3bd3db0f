"""Lifecycle decisions of a sandbox, as pure functions: reconciling the ledger with libvirt.

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

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum

STATE_CREATING = "creating"
STATE_READY = "SANDBOX_READY"


@dataclass(frozen=True)
class Row:
    """A sandbox the ledger knows: its state, its domain's name, and whether its claims match its record."""

    sandbox_id: str
    state: str
    domain: str
    claims_match: bool = True
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
    if not row.claims_match:
        return "its claims do not match its record"
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
