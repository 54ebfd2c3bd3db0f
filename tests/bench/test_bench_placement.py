"""``bench/placement.py --smoke`` runs the production placement path end to end and checks its report,
so the benchmark cannot rot: a changed API, a broken invariant (the run asserts that the free state
rebuilt from the ledger equals the one kept in place, and that releasing everything empties both) or a
report whose figures disagree fails here. It needs no guest, so it runs with the fast tests too."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench import placement, smoke

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "placement.py"), "--smoke"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    doc: dict[str, Any] = json.loads(done.stdout)
    return doc


def test_smoke_run_reports_every_figure(report: dict[str, Any]) -> None:
    assert [(h["cpus"], h["nodes"]) for h in report["hosts"]] == [(64, 2), (64, 8)]
    assert set(report["fragmentation_worst_over_hosts_and_seeds"]) == {"best-fit", "first-fit", "spread"}
    assert smoke.problems(report, placement.SHAPE) == [] and placement.invariants(report) == []


def _set(path: tuple[str | int, ...], value: object) -> Callable[[dict[str, Any]], None]:
    def change(doc: dict[str, Any]) -> None:
        node: Any = doc
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return change


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (_set(("hosts", 1, "refused"), 0), "hosts[1].refused: expected an integer >= 1"),
        (_set(("hosts", 0, "decisions"), 1), "hosts[0]: 1 decisions, but"),
        (_set(("hosts", 0, "claims_when_full", "sandboxes"), 10**6), "hosts[0]: the full ledger holds"),
        (_set(("target", "best_packing"), "worst-fit"), "target.best_packing: 'worst-fit' is not a packing"),
        (_set(("growth", "mean_us_per_decision_ratio"), float("nan")), "growth.mean_us_per_decision_ratio"),
    ],
)
def test_the_check_names_a_figure_that_is_off(
    report: dict[str, Any], change: Callable[[dict[str, Any]], None], named: str
) -> None:
    doc = copy.deepcopy(report)
    change(doc)
    found = smoke.problems(doc, placement.SHAPE) or placement.invariants(doc)
    assert any(p.startswith(named) for p in found), found
