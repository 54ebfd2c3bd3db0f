"""Table tests of vmsandbox.lifecycle.reconcile_actions: what start-up and periodic reconciliation do."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vmsandbox.lifecycle import Action, Guest, Row, Step, reconcile_actions

ME = "instance-me"
A, B = "a" * 64, "b" * 64


def row(sid: str = A, state: str = "SANDBOX_READY", **kw: object) -> Row:
    return Row(sandbox_id=sid, state=state, domain=f"vmsandbox-{sid[:12]}", **kw)  # type: ignore[arg-type]


def guest(sid: str = A, active: bool = True, owner: str = ME) -> Guest:
    return Guest(sandbox_id=sid, name=f"vmsandbox-{sid[:12]}", active=active, owner=owner)


CASES = [
    ("ready and running: adopted", [row()], [guest()], [], [Step.ADOPT]),
    ("ready, guest shut off: torn down then stopped", [row()], [guest(active=False)], [A], [Step.TEAR_DOWN, Step.STOP]),
    ("ready, no guest at all: stopped", [row()], [], [A], [Step.STOP]),
    (
        "ready, claims differ: torn down then stopped",
        [row(claims_problem="its claims do not match its record")],
        [guest()],
        [A],
        [Step.TEAR_DOWN, Step.STOP],
    ),
    ("creating with a running guest", [row(state="creating")], [guest()], [A], [Step.TEAR_DOWN, Step.FORGET]),
    ("creating, never defined", [row(state="creating")], [], [A], [Step.FORGET]),
    (
        "notready, leftover domain and claims",
        [row(state="SANDBOX_NOTREADY", holds_claims=True)],
        [guest()],
        [A],
        [Step.TEAR_DOWN, Step.FINISH_STOP],
    ),
    ("notready, nothing left", [row(state="SANDBOX_NOTREADY")], [], [], []),
    ("our domain with no row", [], [guest()], [], [Step.TEAR_DOWN]),
    ("claims with no row and no domain", [], [], [A], [Step.RELEASE_ORPHAN]),
    ("claims with no row and a domain of ours", [], [guest()], [A], [Step.TEAR_DOWN, Step.RELEASE_ORPHAN]),
    ("another database's domain", [], [guest(owner="someone-else")], [], [Step.LEAVE_FOREIGN]),
    ("unrecorded owner, known row: ours", [row()], [guest(owner="")], [A], [Step.ADOPT]),
    ("unrecorded owner, unknown: foreign", [], [guest(owner="")], [], [Step.LEAVE_FOREIGN]),
]


@pytest.mark.parametrize(("rows", "guests", "owners", "steps"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_reconcile_actions(rows: list[Row], guests: list[Guest], owners: list[str], steps: list[Step]) -> None:
    assert [a.step for a in reconcile_actions(rows, guests, owners, ME)] == steps


def test_foreign_claims_of_a_foreign_domain_are_not_released() -> None:
    actions = reconcile_actions([], [guest(B, owner="other")], [B], ME)
    assert [a.step for a in actions] == [Step.LEAVE_FOREIGN]


def test_every_action_names_a_reason() -> None:
    actions = reconcile_actions([row(), row(B, state="creating")], [guest(active=False)], [A, B], ME)
    assert all(isinstance(a, Action) and a.reason for a in actions)


STATES = st.sampled_from(["creating", "SANDBOX_READY", "SANDBOX_NOTREADY"])
PROBLEMS = st.sampled_from(["", "claims differ"])
IDS = st.sampled_from(["a" * 64, "b" * 64, "c" * 64, "d" * 64])


@given(
    rows=st.lists(st.builds(row, IDS, STATES, claims_problem=PROBLEMS, holds_claims=st.booleans()), max_size=4),
    guests=st.lists(st.builds(guest, IDS, st.booleans(), st.sampled_from([ME, "", "other"])), max_size=4),
    owners=st.lists(IDS, max_size=4),
)
def test_invariants(rows: list[Row], guests: list[Guest], owners: list[str]) -> None:
    rows = list({r.sandbox_id: r for r in rows}.values())
    guests = list({g.sandbox_id: g for g in guests}.values())
    actions = reconcile_actions(rows, guests, owners, ME)
    per_sid: dict[str, list[Step]] = {}
    for a in actions:
        per_sid.setdefault(a.sandbox_id, []).append(a.step)
    for steps in per_sid.values():
        # a tear-down, when there is one, comes first; a sandbox is adopted alone or not at all
        if Step.TEAR_DOWN in steps:
            assert steps[0] is Step.TEAR_DOWN and steps.count(Step.TEAR_DOWN) == 1
        if Step.ADOPT in steps:
            assert steps == [Step.ADOPT]
        if Step.LEAVE_FOREIGN in steps:  # another database's domain is never torn down
            assert Step.TEAR_DOWN not in steps and Step.ADOPT not in steps
    # nothing of ours is left running unless adopted
    for g in guests:
        steps = per_sid.get(g.sandbox_id, [])
        assert steps and steps[0] in (Step.ADOPT, Step.TEAR_DOWN, Step.LEAVE_FOREIGN)
