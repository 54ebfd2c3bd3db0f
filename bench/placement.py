"""Placement decisions per second on synthetic hosts (DESIGN §9: >= 10k decisions/s on a 1024-CPU,
8-node host, with the cost per decision near-constant as hosts grow).

    .venv/bin/python bench/placement.py                 # 64/2, 256/4, 1024/8 (CPUs/NUMA nodes)
    .venv/bin/python bench/placement.py --rounds 3 --seed 7

Each host has SMT (two threads per core), one shared core and one housekeeping core per node, 512
2 MiB pages per CPU (1 GiB of guest RAM per CPU) plus 2 x 1 GiB pages per node, and four GPUs
per node, each an IOMMU group of two functions (pool ``gpu``). A round fills the host with a
realistic mix of pods until 50 decisions in a row are refused (a shared pod on 4 KiB pages holds
nothing the placer counts, so it does not restart the count), then releases everything; rounds
repeat until enough decisions were timed. The mix: 1, 2, 4, 8, 16 or 32 vCPUs (35/30/20/10/4/1 %),
1-4 GiB per vCPU; 75 % exclusive on 2 MiB pages, 5 % on 1 GiB pages, 10 % shared on 2 MiB pages,
10 % shared on 4 KiB; 2 % ask for a GPU; NUMA policy single-numa-node for 70 %, best-effort 20 %,
restricted 10 %.

A *decision* is one ``placement.decide`` on the host's ``FreeState`` (placed or refused), plus
``FreeState.take`` when placed: what the shim's placer does per RunPodSandbox, given the free state.
Reported beside it, measured in the same run:

* ``claim_keys_us``: materialising the ledger keys of a placement (one key per CPU, page and PCI
  function); the ledger inserts them, so this grows with the pod's size, not the host's;
* ``rebuild_ms``: ``FreeState.from_taken`` on the keys a full host holds, i.e. the cost of
  starting from the ledger's keys instead of keeping the state (it is O(keys held)).

Prints one JSON document; ``growth`` compares the mean cost per decision on the largest host with
the smallest (1.0 = constant).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vmsandbox.devices import NO_DEVICES, DeviceRequest, resolve_pools
from vmsandbox.errors import CannotFit
from vmsandbox.host import HostCpu, HostInventory, HugepagePool, PciFunction
from vmsandbox.placement import FreeState, HostPools, HugepageBudget, NumaPolicy, Placement, decide, host_pools
from vmsandbox.sizing import PodDemand, VmShape

MI, GI = 1 << 20, 1 << 30
HOSTS = ((64, 2), (256, 4), (1024, 8))
TARGET_DECISIONS_PER_S = 10_000


def synthetic_host(cpus: int, nodes: int) -> tuple[HostInventory, HostPools]:
    """``cpus`` threads, two per core, ``nodes`` sockets = NUMA nodes; siblings n and n + cpus/2."""
    cores = cpus // 2
    per_node = cores // nodes
    host_cpus = tuple(
        HostCpu(thread * cores + core, node=core // per_node, package=core // per_node, core=core % per_node)
        for thread in (0, 1)
        for core in range(cores)
    )
    pages = tuple(HugepagePool(n, 2 * MI, 512 * (cpus // nodes), 512 * (cpus // nodes)) for n in range(nodes)) + tuple(
        HugepagePool(n, GI, 2, 2) for n in range(nodes)
    )
    pci = []
    for n in range(nodes):
        for g in range(4):
            bus = 0x10 + n * 8 + g
            for fn in (0, 1):
                pci.append(
                    PciFunction(f"0000:{bus:02x}:00.{fn}", "10de", "2330" if fn == 0 else "22a3", n, bus, "vfio-pci")
                )
    inv = HostInventory(cpus=tuple(sorted(host_cpus)), hugepages=pages, pci=tuple(pci))
    first_core = [n * per_node for n in range(nodes)]  # core 0 of each node: housekeeping
    last_core = [n * per_node + per_node - 1 for n in range(nodes)]  # its last core: shared
    housekeeping = [c + t * cores for c in first_core for t in (0, 1)]
    shared = [c + t * cores for c in last_core for t in (0, 1)]
    budgets = {(p.node, p.page_size): HugepageBudget(p.node, p.page_size, p.total, p.free) for p in pages}
    pools = host_pools(
        inv,
        range(cpus),
        shared_cpus=shared,
        housekeeping_cpus=housekeeping,
        budgets=budgets,
        devices=resolve_pools({"gpu": ("10de:2330", "10de:22a3")}, inv),
    )
    return inv, pools


@dataclass(frozen=True)
class Pod:
    shape: VmShape
    policy: NumaPolicy
    devices: DeviceRequest


def pod_mix(rng: random.Random, count: int) -> list[Pod]:
    out = []
    for _ in range(count):
        vcpus = rng.choices((1, 2, 4, 8, 16, 32), weights=(35, 30, 20, 10, 4, 1))[0]
        memory = vcpus * rng.choice((1, 2, 3, 4)) * GI // 4 * 2  # 0.5-2 GiB per vCPU, whole GiB halves
        kind = rng.choices(("2Mi", "1Gi", "shared-2Mi", "shared-4Ki"), weights=(75, 5, 10, 10))[0]
        page = {"2Mi": 2 * MI, "1Gi": GI, "shared-2Mi": 2 * MI, "shared-4Ki": 4096}[kind]
        memory = max(memory, page)
        shape = VmShape(
            vcpus=vcpus,
            memory_bytes=-(-memory // page) * page,
            backing_page_size=page,
            guest_hugepages=(),
            cpu_policy="shared" if kind.startswith("shared") else "exclusive",
            demand=PodDemand(vcpus * 1000, memory),
        )
        policy: NumaPolicy = rng.choices(("single-numa-node", "best-effort", "restricted"), weights=(70, 20, 10))[0]
        devices = DeviceRequest(counts=(("gpu", 1),)) if rng.random() < 0.02 else NO_DEVICES
        out.append(Pod(shape, policy, devices))
    return out


def run_host(cpus: int, nodes: int, rounds: int, min_decisions: int, seed: int) -> dict[str, Any]:
    _, pools = synthetic_host(cpus, nodes)
    rng = random.Random(seed)
    mix = pod_mix(rng, 4096)
    placed_ns: list[int] = []
    refused_ns: list[int] = []
    keys_ns: list[int] = []
    fill_pods: list[int] = []
    rebuild_ms: list[float] = []
    held_keys = 0
    done_rounds = 0
    perf = time.perf_counter_ns
    while done_rounds < rounds or len(placed_ns) + len(refused_ns) < min_decisions:
        state = FreeState(pools)
        live: list[Placement] = []
        refused_in_a_row = 0
        i = rng.randrange(len(mix))
        while refused_in_a_row < 50:
            pod = mix[i % len(mix)]
            i += 1
            t0 = perf()
            try:
                p = decide(pod.shape, pools, state, policy=pod.policy, emulator="vcpus", devices=pod.devices)
                state.take(p)
            except CannotFit:
                refused_ns.append(perf() - t0)
                refused_in_a_row += 1
                continue
            placed_ns.append(perf() - t0)
            if p.exclusive or p.page_ranges or p.devices:  # pods holding nothing never fill the host
                refused_in_a_row = 0
            live.append(p)
        fill_pods.append(len(live))
        if done_rounds < 2:  # the ledger's view, measured (and checked) on the first full hosts only
            t0 = perf()
            keys = [k for p in live for k in p.claims]
            keys_ns.append((perf() - t0) // max(len(live), 1))
            held_keys = len(keys)
            t0 = perf()
            rebuilt = FreeState.from_taken(pools, keys)
            rebuild_ms.append((perf() - t0) / 1e6)
            assert rebuilt.snapshot() == state.snapshot()
        for p in live:
            state.release(p)
        if done_rounds < 2:
            assert state.snapshot() == FreeState(pools).snapshot()
        done_rounds += 1
    every = placed_ns + refused_ns
    mean_ns = statistics.fmean(every)
    return {
        "cpus": cpus,
        "nodes": nodes,
        "rounds": done_rounds,
        "pods_per_full_host": round(statistics.fmean(fill_pods), 1),
        "decisions": len(every),
        "placed": len(placed_ns),
        "refused": len(refused_ns),
        "decisions_per_s": round(1e9 / mean_ns),
        "us_per_decision": {
            "mean": round(mean_ns / 1000, 2),
            "p50": round(statistics.median(every) / 1000, 2),
            "p99": round(sorted(every)[int(len(every) * 0.99)] / 1000, 2),
            "placed_mean": round(statistics.fmean(placed_ns) / 1000, 2),
            "refused_mean": round(statistics.fmean(refused_ns) / 1000, 2) if refused_ns else None,
        },
        "claim_keys_us_per_pod": round(statistics.fmean(keys_ns) / 1000, 1),
        "keys_held_when_full": held_keys,
        "rebuild_ms_from_keys_when_full": round(statistics.median(rebuild_ms), 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="fills per host, at least (default 3)")
    parser.add_argument("--min-decisions", type=int, default=20_000, help="decisions per host, at least")
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()
    results = [run_host(c, n, args.rounds, args.min_decisions, args.seed) for c, n in HOSTS]
    small, large = results[0], results[-1]
    growth = large["us_per_decision"]["mean"] / small["us_per_decision"]["mean"]
    doc = {
        "benchmark": "placement decisions (vmsandbox.placement.decide + FreeState.take)",
        "python": sys.version.split()[0],
        "hosts": results,
        "growth": {
            "cpus": f"{small['cpus']} -> {large['cpus']} ({large['cpus'] // small['cpus']}x)",
            "mean_us_per_decision_ratio": round(growth, 2),
            "per_host_mean_us": [r["us_per_decision"]["mean"] for r in results],
        },
        "target": {
            "decisions_per_s_on_1024_cpus_8_nodes": TARGET_DECISIONS_PER_S,
            "measured": large["decisions_per_s"],
            "met": large["decisions_per_s"] >= TARGET_DECISIONS_PER_S,
        },
    }
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
