"""The README's performance table (``bench/table.py``): it is the rendering of the JSON
``make bench`` kept in ``bench/results/``, it covers every benchmark ``make bench`` runs, and each
row is read from a document of its benchmark."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest

from bench import smoke, table

REPO = Path(__file__).resolve().parents[2]


def _make_bench() -> list[str]:
    text = (REPO / "Makefile").read_text()
    m = re.search(r"^BENCHMARKS := (.+)$", text, re.M)
    assert m is not None
    return m[1].split()


def test_the_readmes_table_is_the_rendering_of_the_kept_results() -> None:
    readme = (REPO / "README.md").read_text()
    assert table.replaced(readme, table.render()) == readme, "run bench/table.py (make perf-table)"


def test_every_benchmark_make_bench_runs_has_its_rows() -> None:
    assert sorted(set(_make_bench()) - set(table.ROWS)) == []
    assert sorted(set(table.ROWS) - set(_make_bench())) == []


def test_every_kept_result_is_a_document_of_its_benchmark_as_it_is_now() -> None:
    kept = sorted(table.RESULTS.glob("*.json"))
    assert kept, "bench/results/ holds no benchmark's JSON"
    for path in kept:
        assert path.stem in table.ROWS, path
        doc = json.loads(path.read_text())
        shape = importlib.import_module(f"bench.{path.stem}").SHAPE
        assert smoke.problems(doc, shape) == [], f"{path.name}: run bench/{path.stem}.py again (make bench)"


def test_a_benchmark_without_results_says_so(tmp_path: Path) -> None:
    rendered = table.render(tmp_path)
    assert rendered.count("not measured") == len(table.ROWS)


def test_rows_of_a_kept_document(tmp_path: Path) -> None:
    doc = {
        "apply_to_ready_s": {"runc": {"p50": 2.0}, "vmsandbox": {"p50": 3.0}},
        "ratio_p50": 1.5,
        "target_ratio_p50": 1.3,
        "met_ratio_p50": False,
        "burst": {"pods": 10, "all_ready_s": 6.0, "one_pod_p50_s": 3.0, "ratio": 2.0, "target_ratio": 3.0, "met": True},
        "floor": {"ready_s": 2.5, "ratio_p50": 1.25, "burst_all_ready_s": 4.5, "burst_ratio": 1.5},
    }
    (tmp_path / "cluster_start.json").write_text(json.dumps(doc))
    lines = [line for line in table.render(tmp_path).splitlines() if line.startswith("| `cluster_start`")]
    one = "kubectl apply to Ready, one pod (p50) | 3.00 s | runc pod 2.00 s | 1.50 | ≤ 1.3 (floor here 1.25) | **no** |"
    burst = (
        "10 VM pods applied at once, all Ready | 6.00 s | one VM pod 3.00 s | 2.00 | ≤ 3.0 (floor here 1.50) | yes |"
    )
    assert lines == [f"| `cluster_start` | {one}", f"| `cluster_start` | {burst}"]


@pytest.mark.parametrize("text", ["no markers", f"{table.BEGIN} only the start"])
def test_a_readme_without_its_markers_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="markers"):
        table.replaced(text, "| x |")
