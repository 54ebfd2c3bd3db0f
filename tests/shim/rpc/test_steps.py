"""``shim.rpc.steps``: undo exactly what was done, newest first; stop at an undo that fails; every
step a fault point."""

from __future__ import annotations

import functools

import pytest

from shim import faults, rpc
from vmsandbox.errors import InfrastructureError, InvalidArgument

rpc.declare("test-rpc", "one", "two", "three")


def _run(fail_at: str | None, log: list[str], undo_fails: str = "") -> None:
    def undo(step: str) -> None:
        if step == undo_fails:
            raise InfrastructureError(f"cannot undo {step}")
        log.append(f"undo {step}")

    with rpc.steps("test-rpc") as s:
        for step in ("one", "two", "three"):
            if step == fail_at:
                raise InvalidArgument(f"{step} refused")
            log.append(step)
            s.done(step, functools.partial(undo, step))


@pytest.mark.parametrize(
    ("fail_at", "expect"),
    [
        (None, ["one", "two", "three"]),
        ("one", []),
        ("two", ["one", "undo one"]),
        ("three", ["one", "two", "undo two", "undo one"]),
    ],
)
def test_a_failure_undoes_what_was_done_newest_first(fail_at: str | None, expect: list[str]) -> None:
    log: list[str] = []
    if fail_at is None:
        _run(None, log)
    else:
        with pytest.raises(InvalidArgument):
            _run(fail_at, log)
    assert log == expect


@pytest.mark.parametrize("point", rpc.rpc_points("test-rpc"))
def test_every_step_is_a_fault_point_and_its_injection_unwinds(point: str) -> None:
    log: list[str] = []
    with faults.raising(point), pytest.raises(faults.InjectedFault, match=point):
        _run(None, log)
    done = [s for s in log if not s.startswith("undo")]
    assert [s for s in log if s.startswith("undo")] == [f"undo {s}" for s in reversed(done)]
    assert done[-1] == point.split(":")[1]


def test_an_undo_that_fails_stops_the_unwinding_and_says_what_is_left() -> None:
    log: list[str] = []
    outcomes: list[str] = []

    def keep(exc: BaseException, outcome: str) -> None:
        outcomes.append(outcome)

    with pytest.raises(InvalidArgument), rpc.steps("test-rpc", keep) as s:
        s.done("one", functools.partial(log.append, "one"))
        s.done("two", _fail)
        raise InvalidArgument("three refused")
    assert log == []  # "one" was not undone: it stays for the reconcile
    assert outcomes == ["rollback incomplete: undoing two failed (no); left for the reconcile: two, one"]


def _fail() -> None:
    raise InfrastructureError("no")


def test_an_undeclared_step_or_point_is_a_bug() -> None:
    with pytest.raises(AssertionError), rpc.steps("test-rpc") as s:
        s.done("four")
    with pytest.raises(ValueError), faults.raising("test-rpc:four"):
        pass


def test_a_call_says_how_long_each_step_took() -> None:
    ticks = iter([10.0, 10.002, 10.012, 10.5, 10.501])
    s = rpc.Steps("test-rpc", _clock=lambda: next(ticks))
    s.done("one")
    s.done("two")
    s.done("three")
    assert s.timings() == "501 ms: one 2, two 10, three 488"


def test_a_step_timed_inside_another_counts_only_its_own_time() -> None:
    # one done at 10.002; two runs from 10.300 to 10.310 (inside three); three done at 10.500
    ticks = iter([10.0, 10.002, 10.300, 10.310, 10.310, 10.5, 10.501])
    s = rpc.Steps("test-rpc", _clock=lambda: next(ticks))
    undone: list[str] = []
    s.done("one")
    s.timed("two", lambda: functools.partial(undone.append, "two"))
    s.done("three")
    assert s.timings() == "501 ms: one 2, two 10, three 488"
    assert s.unwind() == "rolled back: two undone" and undone == ["two"]


def test_a_call_that_succeeded_logs_its_timings(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="shim.rpc"):
        _run(None, [])
    (line,) = [r.getMessage() for r in caplog.records if r.name == "shim.rpc"]
    assert line.startswith("test-rpc done in ") and line.endswith(": one 0, two 0, three 0"), line


def test_a_call_that_failed_logs_no_timings(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="shim.rpc"), pytest.raises(InvalidArgument):
        _run("two", [])
    assert [r for r in caplog.records if r.name == "shim.rpc" and "done in" in r.getMessage()] == []
