"""The README's performance table, made from the benchmarks' JSON: ``make bench`` keeps each
benchmark's last document in ``bench/results/<name>.json``; this renders one row per headline
figure of each (the figure, the baseline it was run beside, their ratio, the target and whether it
was met; the README keeps to one or two per benchmark, docs/benchmarks.md has the rest) and writes
the table between the README's ``perf-table`` markers.

    .venv/bin/python bench/table.py            # rewrite README.md's table from bench/results/
    .venv/bin/python bench/table.py --check    # exit 1 when README.md's table is not what they give

Which figures make the headline is said once, here, per benchmark (``ROWS``); a benchmark with no
document in ``bench/results/`` gets a row saying so. ``tests/bench/test_bench_table.py`` checks that
the README's table is this rendering of the committed documents.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
README = REPO / "README.md"
BEGIN = "<!-- perf-table:begin (bench/table.py writes this table from bench/results/*.json) -->"
END = "<!-- perf-table:end -->"


@dataclass(frozen=True)
class Row:
    """One headline figure: what was measured, against which baseline of the same run."""

    what: str
    figure: str
    baseline: str
    ratio: float | None
    target: str
    met: bool | None


def _s(v: float) -> str:
    return f"{v:.2f} s"


def _ms(v: float) -> str:
    return f"{v:.1f} ms" if v < 100 else f"{v:.0f} ms"


def _mib(v: float) -> str:
    return f"{v:.0f} MiB"


def _sandbox_start(d: dict[str, Any]) -> list[Row]:
    direct = d["direct_qemu_s"]["p50"]
    restore, boot = d["ratio_restore_p50"], d["ratio_p50"]
    memory = d["vmm_memory_beyond_guest_mib"]["sandbox"]["private"]["p50"]
    return [
        Row("RunPodSandbox by restore", _s(d["restore_s"]["p50"]), f"bare QEMU boot {_s(direct)}", restore,
            f"≤ {d['target_restore_ratio']}", restore <= d["target_restore_ratio"]),
        Row("RunPodSandbox by cold boot", _s(d["sandbox_s"]["p50"]), f"bare QEMU boot {_s(direct)}", boot,
            f"≤ {d['target_ratio']}", boot <= d["target_ratio"]),
        Row("QEMU private memory beyond guest RAM, per pod", _mib(memory), "", None, "≤ 32 MiB", memory <= 32),
    ]  # fmt: skip


def _container_start(d: dict[str, Any]) -> list[Row]:
    c = d["create_start_first_log_line"]
    return [
        Row("CreateContainer + StartContainer to the first log line", _ms(c["cri"]["p50_ms"]),
            f"the agent's own create + start {_ms(c['agent_baseline']['p50_ms'])}", c["ratio_p50"], "", None),
    ]  # fmt: skip


def _admission(d: dict[str, Any]) -> list[Row]:
    p = d["pure"]
    return [
        Row(f"admission decisions, a {p['containers_in_pod']}-container pod (slowest case)",
            f"{p['slowest_decisions_per_s']:,.0f}/s", "", None, f"≥ {p['target_per_s']:,}/s", p["meets_target"]),
    ]  # fmt: skip


def _placement(d: dict[str, Any]) -> list[Row]:
    t = d["target"]
    return [
        Row("placement decisions on the largest host", f"{t['measured']:,.0f}/s", "", None,
            f"≥ {t['decisions_per_s_on_largest_host']:,}/s", t["met"]),
    ]  # fmt: skip


def _image_pull(d: dict[str, Any]) -> list[Row]:
    f = d["formats"]["oci"]
    return [
        Row("PullImage (OCI)", _s(f["ours_median_s"]), f"skopeo copy + umoci unpack {_s(f['skopeo_umoci_median_s'])}",
            f["ratio"], f"≤ {d['target_ratio']}", f["meets_target"]),
    ]  # fmt: skip


def _pod_network(d: dict[str, Any]) -> list[Row]:
    r = d["run_pod_sandbox_s"]
    return [
        Row("RunPodSandbox with the CNI network", _s(r["with_cni_p50"]),
            f"without a network {_s(r['without_network_p50'])}", r["ratio_p50"], "", None),
    ]  # fmt: skip


def _cri_scale(d: dict[str, Any]) -> list[Row]:
    big = d["sizes"][-1]
    return [
        Row(f"ListContainers with {big['containers']} containers, p50", _ms(big["list_containers"]["p50_ms"]),
            f"decoding every row {_ms(big['baseline_decode_all_rows_ms'])}",
            big["list_containers"]["p50_ms"] / big["baseline_decode_all_rows_ms"], "see docs", d["meets_targets"]),
    ]  # fmt: skip


def _resize(d: dict[str, Any]) -> list[Row]:
    u = d["update_pod_sandbox_resources_ms"]
    return [
        Row("UpdatePodSandboxResources into the headroom (vCPU + 128 MiB plugged)", _ms(u["plug_p50"]),
            f"a resize the VM holds {_ms(u['fits_p50'])}", u["ratio_p50"], "", None),
    ]  # fmt: skip


def _cluster_start(d: dict[str, Any]) -> list[Row]:
    a, b, f = d["apply_to_ready_s"], d["burst"], d["floor"]
    return [
        Row("kubectl apply to Ready, one pod (p50)", _s(a["vmsandbox"]["p50"]), f"runc pod {_s(a['runc']['p50'])}",
            d["ratio_p50"], f"≤ {d['target_ratio_p50']} (floor here {f['ratio_p50']:.2f})", d["met_ratio_p50"]),
        Row(f"{b['pods']} VM pods applied at once, all Ready", _s(b["all_ready_s"]),
            f"one VM pod {_s(b['one_pod_p50_s'])}", b["ratio"],
            f"≤ {b['target_ratio']} (floor here {f['burst_ratio']:.2f})", b["met"]),
    ]  # fmt: skip


def _density(d: dict[str, Any]) -> list[Row]:
    vm, runc = d["vm"], d["runc"]
    return [
        Row(f"host memory per idle VM pod ({d['pods_fit']} fit in {d['capacity']['capacity_mib']:.0f} MiB)",
            _mib(vm["host_memory_per_pod_mib"]), f"runc pod {runc['host_memory_per_pod_mib']:.1f} MiB",
            d["ratio_memory_vm_runc"], "", None),
    ]  # fmt: skip


ROWS: dict[str, Callable[[dict[str, Any]], list[Row]]] = {
    "sandbox_start": _sandbox_start,
    "container_start": _container_start,
    "cluster_start": _cluster_start,
    "admission": _admission,
    "placement": _placement,
    "image_pull": _image_pull,
    "pod_network": _pod_network,
    "cri_scale": _cri_scale,
    "resize": _resize,
    "density": _density,
}


def rows(results: Path = RESULTS) -> Iterable[tuple[str, Row | None]]:
    """(benchmark, row) per headline figure, in ``ROWS``' order; row None: no document for it."""
    for name, make in ROWS.items():
        path = results / f"{name}.json"
        if not path.is_file():
            yield name, None
            continue
        for row in make(json.loads(path.read_text())):
            yield name, row


def render(results: Path = RESULTS) -> str:
    lines = [
        "| benchmark | measured | figure | baseline, same run | ratio | target | met |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in rows(results):
        if row is None:
            lines.append(f"| `{name}` | not measured: no bench/results/{name}.json | | | | | |")
            continue
        ratio = f"{row.ratio:.2f}" if row.ratio is not None else ""
        met = {True: "yes", False: "**no**", None: ""}[row.met]
        lines.append(f"| `{name}` | {row.what} | {row.figure} | {row.baseline} | {ratio} | {row.target} | {met} |")
    return "\n".join(lines)


def replaced(readme: str, table: str) -> str:
    """``readme`` with the text between its markers replaced by ``table``."""
    head, found, rest = readme.partition(BEGIN)
    _, found_end, tail = rest.partition(END)
    if not found or not found_end:
        raise ValueError(f"README.md has no {BEGIN!r} ... {END!r} markers")
    return f"{head}{BEGIN}\n{table}\n{END}{tail}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when README.md's table is not the rendering")
    args = ap.parse_args()
    text = README.read_text()
    new = replaced(text, render())
    if args.check:
        if new != text:
            print("README.md's performance table is not what bench/results/ gives: run bench/table.py", file=sys.stderr)
            return 1
        return 0
    README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
