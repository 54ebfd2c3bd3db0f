"""The benchmarks' shared smoke check (``bench/smoke.py``): a document is held to its shape key by
key, every problem is named by its key path, and ``report``/``require`` exit with the statuses the
smoke test reads (1: the JSON is wrong; 77: the host cannot run the benchmark)."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench import smoke
from bench.smoke import BOOL, COUNT, FINITE, NON_NEGATIVE, PERCENT, POSITIVE, TEXT, Each, Keyed, Maybe, problems

SHAPE: dict[str, Any] = {
    "benchmark": "demo",
    "runs": COUNT,
    "p50_s": POSITIVE,
    "added_ms": FINITE,
    "load": NON_NEGATIVE,
    "share_pct": PERCENT,
    "met": BOOL,
    "name": TEXT,
    "samples": Each(POSITIVE),
    "hosts": Each({"cpus": COUNT}, length=2),
    "per_case": Keyed(POSITIVE, frozenset({"a", "b"})),
    "cache_mib": Maybe(COUNT),
}
GOOD: dict[str, Any] = {
    "benchmark": "demo",
    "runs": 3,
    "p50_s": 0.25,
    "added_ms": -4.5,
    "load": 0,
    "share_pct": 100,
    "met": False,
    "name": "x",
    "samples": [0.2, 0.25, 0.3],
    "hosts": [{"cpus": 64}, {"cpus": 1024}],
    "per_case": {"a": 1, "b": 2.5},
    "cache_mib": None,
}


def with_(**changes: object) -> dict[str, Any]:
    return {**GOOD, **changes}


def without(key: str) -> dict[str, Any]:
    return {k: v for k, v in GOOD.items() if k != key}


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        pytest.param(GOOD, [], id="conforming"),
        pytest.param(with_(cache_mib=32), [], id="maybe-present"),
        pytest.param(without("p50_s"), ["p50_s: missing"], id="missing-key"),
        pytest.param(
            with_(extra=1), ["extra: unexpected key (not in the benchmark's shape)"], id="key-not-in-the-shape"
        ),
        pytest.param(with_(benchmark="other"), ['benchmark: expected "demo", got "other"'], id="literal-differs"),
        pytest.param(with_(p50_s=0), ["p50_s: expected a finite number > 0, got 0"], id="zero-not-positive"),
        pytest.param(with_(p50_s=-1.0), ["p50_s: expected a finite number > 0, got -1.0"], id="negative"),
        pytest.param(with_(p50_s=math.nan), ["p50_s: expected a finite number > 0, got nan"], id="nan"),
        pytest.param(with_(added_ms=math.inf), ["added_ms: expected a finite number, got inf"], id="infinite"),
        pytest.param(with_(p50_s="0.25"), ['p50_s: expected a finite number > 0, got "0.25"'], id="string-number"),
        pytest.param(with_(p50_s=True), ["p50_s: expected a finite number > 0, got true"], id="bool-not-number"),
        pytest.param(with_(runs=1.5), ["runs: expected an integer >= 1, got 1.5"], id="count-not-integer"),
        pytest.param(with_(load=-0.1), ["load: expected a finite number >= 0, got -0.1"], id="negative-load"),
        pytest.param(with_(share_pct=100.5), ["share_pct: expected a percentage from 0 to 100, got 100.5"], id="pct"),
        pytest.param(with_(met=1), ["met: expected true or false, got 1"], id="int-not-bool"),
        pytest.param(with_(name=""), ['name: expected a non-empty string, got ""'], id="empty-text"),
        pytest.param(with_(samples=[]), ["samples: expected a non-empty list, got []"], id="no-samples"),
        pytest.param(
            with_(samples=[0.2, None]), ["samples[1]: expected a finite number > 0, got null"], id="bad-sample"
        ),
        pytest.param(with_(hosts=[{"cpus": 64}]), ["hosts: expected 2 items, got 1"], id="list-of-the-wrong-length"),
        pytest.param(with_(hosts=[{"cpus": 64}, {}]), ["hosts[1].cpus: missing"], id="nested-missing"),
        pytest.param(
            with_(per_case={"a": 1}), ["per_case: expected the keys ['a', 'b'], got ['a']"], id="keyed-keys-differ"
        ),
        pytest.param(
            with_(per_case={"a": 1, "b": 0}), ["per_case.b: expected a finite number > 0, got 0"], id="keyed-value"
        ),
        pytest.param(with_(per_case={}), ["per_case: expected a non-empty object, got {}"], id="keyed-empty"),
        pytest.param(with_(cache_mib=0), ["cache_mib: expected an integer >= 1, got 0"], id="maybe-wrong"),
        pytest.param(
            with_(p50_s=None, samples="x"),
            ["p50_s: expected a finite number > 0, got null", 'samples: expected a non-empty list, got "x"'],
            id="every-problem-listed",
        ),
    ],
)
def test_problems(doc: object, expected: list[str]) -> None:
    assert problems(doc, SHAPE) == expected


def test_a_long_value_is_shown_cut_short() -> None:
    (found,) = problems([GOOD], SHAPE)
    assert found.startswith('the document: expected an object, got [{"benchmark": "demo"')
    assert found.endswith("...") and len(found) < 140


# -- invariants: a document is its own shape; any one leaf made wrong is named by its path ----------------
leaves = st.one_of(
    st.integers(min_value=1, max_value=10**9),
    st.floats(min_value=1e-6, max_value=1e9),
    st.booleans(),
    st.text(min_size=1, max_size=8),
)
keys = st.text(alphabet="abcdefgh_", min_size=1, max_size=6)
documents = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.dictionaries(keys, inner, min_size=1, max_size=4),
        st.lists(inner, min_size=1, max_size=3),
    ),
    max_leaves=12,
)


def shape_of(value: Any) -> Any:
    """The strictest shape a value satisfies: positive numbers and texts by kind, booleans as such."""
    if isinstance(value, dict):
        return {k: shape_of(v) for k, v in value.items()}
    if isinstance(value, list):
        return Each(_union(shape_of(v) for v in value), length=len(value))
    if isinstance(value, bool):
        return BOOL
    if isinstance(value, int | float):
        return POSITIVE
    return TEXT


def _union(shapes: Any) -> Any:
    """One shape for a list's items: equal shapes stay; differing ones cannot be stated, so the
    generated lists hold items of one shape (see ``paths``)."""
    first, *rest = list(shapes)
    return first if all(s == first for s in rest) else None


def paths(value: Any, path: str = "") -> list[tuple[str, Any]]:
    """(path, leaf) of every leaf, in ``problems``' spelling."""
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in paths(v, f"{path}.{k}" if path else k)]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in paths(v, f"{path}[{i}]")]
    return [(path, value)]


def uniform(value: Any) -> bool:
    """Lists whose items all have one shape (what a benchmark's lists are)."""
    if isinstance(value, dict):
        return all(uniform(v) for v in value.values())
    if isinstance(value, list):
        return all(uniform(v) for v in value) and _union(shape_of(v) for v in value) is not None
    return True


def replaced(value: Any, target: str, new: object, path: str = "") -> Any:
    if isinstance(value, dict):
        return {k: replaced(v, target, new, f"{path}.{k}" if path else k) for k, v in value.items()}
    if isinstance(value, list):
        return [replaced(v, target, new, f"{path}[{i}]") for i, v in enumerate(value)]
    return new if path == target else value


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(keys, documents, min_size=1, max_size=5).filter(uniform), st.data())
def test_one_wrong_leaf_is_named(doc: dict[str, Any], data: st.DataObject) -> None:
    shape = shape_of(doc)
    assert problems(doc, shape) == []
    path, leaf = data.draw(st.sampled_from(paths(doc)))
    wrong = data.draw(
        st.sampled_from([math.nan, math.inf, -1, 0, None]) if not isinstance(leaf, str | bool) else st.just(None)
    )
    found = problems(replaced(doc, path, wrong), shape)
    assert len(found) == 1 and found[0].startswith(f"{path}: expected "), found


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(keys, documents, min_size=1, max_size=5).filter(uniform), st.data())
def test_a_removed_key_is_named(doc: dict[str, Any], data: st.DataObject) -> None:
    key = data.draw(st.sampled_from(sorted(doc)))
    assert problems({k: v for k, v in doc.items() if k != key}, shape_of(doc)) == [f"{key}: missing"]


# -- report and require: what the smoke test reads ---------------------------------------------------------
def test_report_in_smoke_mode_exits_1_naming_each_problem(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        smoke.report(with_(p50_s=math.nan, met=None), SHAPE, smoke=True)
    assert exited.value.code == 1
    out, err = capsys.readouterr()
    assert '"p50_s": NaN' in out  # the document is printed first, as it is
    assert "the JSON is not what the benchmark promises" in err
    assert "  - p50_s: expected a finite number > 0, got nan" in err
    assert "  - met: expected true or false, got null" in err


def test_report_runs_the_invariants_only_on_a_document_of_the_right_shape() -> None:
    seen: list[dict[str, Any]] = []

    def invariants(doc: dict[str, Any]) -> list[str]:
        seen.append(doc)
        return ["runs: does not match the samples"] if doc["runs"] != len(doc["samples"]) else []

    smoke.report(GOOD, SHAPE, smoke=True, invariants=invariants)
    with pytest.raises(SystemExit) as exited:
        smoke.report(with_(runs=2), SHAPE, smoke=True, invariants=invariants)
    assert exited.value.code == 1
    with pytest.raises(SystemExit):
        smoke.report(without("samples"), SHAPE, smoke=True, invariants=invariants)
    assert len(seen) == 2


def test_report_without_smoke_only_prints(capsys: pytest.CaptureFixture[str]) -> None:
    smoke.report(without("p50_s"), SHAPE, smoke=False)
    assert '"benchmark": "demo"' in capsys.readouterr().out


def test_require_exits_77_naming_what_is_missing(capsys: pytest.CaptureFixture[str]) -> None:
    smoke.require(smoke.missing_tools("sh"), [])  # nothing missing: returns
    with pytest.raises(SystemExit) as exited:
        smoke.require(smoke.missing_tools("sh", "no-such-tool-vmsandbox"), smoke.missing_files("/no/such/file"))
    assert exited.value.code == smoke.SKIPPED == 77
    err = capsys.readouterr().err
    assert "cannot run it: no-such-tool-vmsandbox (not on PATH" in err and "/no/such/file" in err
    assert "sh (" not in err
