"""``bench/placement.py --quick`` runs the production placement path end to end and prints its report,
so the benchmark cannot rot: a changed API or a broken invariant (it asserts that the free state
rebuilt from the ledger equals the one kept in place, and that releasing everything empties both)
fails here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_quick_run_reports_every_figure() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "placement.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert [(h["cpus"], h["nodes"]) for h in doc["hosts"]] == [(64, 2), (64, 8)]
    for host in doc["hosts"]:
        assert host["placed"] > 0 and host["decisions"] == host["placed"] + host["refused"]
        assert host["decisions_per_s"] > 0 and host["claim_tx_us"] > 0 and host["release_tx_us"] > 0
        assert host["claims_when_full"]["sandboxes"] == round(host["pods_per_full_host"])
        assert host["rebuild_ms"]["open_manager"] > 0
        assert host["baseline_rebuild_each_decision"]["speedup"] > 0
    frag = doc["fragmentation_worst_over_hosts_and_seeds"]
    assert set(frag) == {"best-fit", "first-fit", "spread"}
    for figures in frag.values():
        assert 0 <= figures["unusable_2Mi_pages_pct"] <= 100 and 0 <= figures["unusable_exclusive_cpus_pct"] <= 100
    assert doc["target"]["best_packing"] in frag
