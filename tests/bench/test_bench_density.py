"""The density benchmark's own arithmetic: which of a QEMU's mappings is its guest RAM, the
``memory_reserved`` that leaves the asked capacity, which refusal ends the loop, and the checks of
its document that its shape cannot make."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import pytest

from bench import table
from bench.density import Pod, invariants, is_placement_refusal, memory_reserved_for, times
from vmsandbox.host import HostCpu, HostInventory, HugepagePool
from vmsandbox.qemu_memory import guest_ram_mapping_kib

RAM_KIB = 131072  # 128 MiB
HEAP = "55b2e4d6b000-55b2e66d0000 rw-p 00000000 00:00 0      [heap]\nRss: 25000 kB\nAnonymous: 25000 kB\n"
RAM = "7f0000000000-7f0008000000 rw-p 00000000 00:00 0\nRss: 40000 kB\nAnonymous: 40000 kB\n"  # 128 MiB
NAMED_RAM = "7f0000000000-7f0008000000 rw-p 00000000 00:00 0   [anon:pc.ram]\nRss: 512 kB\nAnonymous: 512 kB\n"
BIG = "7e0000000000-7e0010000000 rw-p 00000000 00:00 0\nRss: 70000 kB\nAnonymous: 70000 kB\n"  # 256 MiB
RESERVED = "7d0000000000-7d0010000000 ---p 00000000 00:00 0\nRss: 0 kB\nAnonymous: 0 kB\n"  # 256 MiB, no access
FILE = "7c0000000000-7c0010000000 rw-p 00000000 fe:00 15630499    /usr/share/qemu/big.rom\nRss: 9 kB\nAnonymous: 0 kB\n"
TCG = "7b0000000000-7b0001000000 rwxp 00000000 00:00 0\nRss: 16384 kB\nAnonymous: 16384 kB\n"  # 16 MiB


@pytest.mark.parametrize(
    ("smaps", "expected"),
    [
        (HEAP + RAM + TCG, {"Rss": 40000, "Anonymous": 40000}),
        (NAMED_RAM + HEAP, {"Rss": 512, "Anonymous": 512}),
        (RESERVED + FILE + RAM, {"Rss": 40000, "Anonymous": 40000}),  # no-access and file mappings are not RAM
        (BIG + RAM, {"Rss": 40000, "Anonymous": 40000}),  # the smallest that holds the RAM
        (BIG + HEAP, {"Rss": 70000, "Anonymous": 70000}),
        (HEAP + TCG + RESERVED + FILE, None),
        ("", None),
    ],
    ids=["anonymous", "named", "not-reserved-or-file", "smallest", "larger-only", "none", "empty"],
)
def test_guest_ram_is_the_smallest_writable_anonymous_mapping_that_holds_it(
    smaps: str, expected: dict[str, int] | None
) -> None:
    assert guest_ram_mapping_kib(smaps, RAM_KIB) == expected


GIB, MIB = 1 << 30, 1 << 20
CPUS = (HostCpu(0, 0, 0, 0), HostCpu(1, 0, 1, 1))


@pytest.mark.parametrize(
    ("memory", "hugepages", "capacity", "expected"),
    [
        (((0, 24 * GIB),), (), 2 * GIB, {0: 22 * GIB}),
        (((0, 24 * GIB),), (HugepagePool(0, 2 * MIB, 1024, 900),), 448 * MIB, {0: 22 * GIB - 448 * MIB}),
        (((0, 8 * GIB), (1, 8 * GIB)), (HugepagePool(1, 2 * MIB, 512, 512),), GIB, {0: 7 * GIB, 1: 8 * GIB}),
    ],
    ids=["one-node", "less-hugepages", "second-node-gets-none"],
)
def test_memory_reserved_leaves_the_capacity_on_the_first_node(
    memory: tuple[tuple[int, int], ...], hugepages: tuple[HugepagePool, ...], capacity: int, expected: dict[int, int]
) -> None:
    inventory = HostInventory(cpus=CPUS, hugepages=hugepages, memory=memory)
    assert memory_reserved_for(capacity, inventory) == expected


@pytest.mark.parametrize(
    "inventory",
    [
        HostInventory(cpus=CPUS, memory=((0, GIB),)),
        HostInventory(cpus=CPUS, hugepages=(HugepagePool(0, 2 * MIB, 1024, 0),), memory=((0, 3 * GIB),)),
        HostInventory(cpus=CPUS),
    ],
    ids=["too-small", "too-small-after-hugepages", "no-memory-figures"],
)
def test_a_capacity_the_host_cannot_give_stops_the_run(inventory: HostInventory) -> None:
    with pytest.raises(SystemExit):
        memory_reserved_for(2 * GIB, inventory)


class _Refused(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.mark.parametrize(
    ("code", "details", "ends_the_loop"),
    [
        (EXHAUSTED, "cannot place the VM: memory on node 0: need 128Mi, free 64Mi (short by 64Mi)", True),
        (EXHAUSTED, "cannot place the VM: cpu on node 0: need 2, free 0 (short by 2)", False),
        (EXHAUSTED, "the image store is full", False),
        (grpc.StatusCode.UNAVAILABLE, "cannot place the VM: memory on node 0: need 1", False),
    ],
    ids=["memory", "cpus", "other-exhaustion", "other-code"],
)
def test_only_placement_short_of_memory_ends_the_loop(code: grpc.StatusCode, details: str, ends_the_loop: bool) -> None:
    assert is_placement_refusal(_Refused(code, details)) is ends_the_loop


def _doc(fit: int = 2, vm_pods: int = 2, runc_pods: int = 2, free: float = 64.0, resident: float = 40.0) -> Any:
    return {
        "pods_fit": fit,
        "capacity": {"free_when_full_mib": free},
        "vm": {
            "pods": [{"guest_ram_resident_mib": resident, "guest_ram_reserved_mib": 128.0}] * vm_pods,
            "per_pod_mib": {"guest_ram_reserved": 128.0},
        },
        "runc": {"pods": [{}] * runc_pods},
    }


@pytest.mark.parametrize(
    ("doc", "problems"),
    [
        (_doc(), 0),
        (_doc(runc_pods=1), 1),
        (_doc(vm_pods=3), 1),
        (_doc(free=128.0), 1),
        (_doc(resident=129.0), 2),
    ],
    ids=["good", "fewer-runc", "more-vm", "room-for-one-more", "resident-above-reserved"],
)
def test_invariants(doc: Any, problems: int) -> None:
    assert len(invariants(doc)) == problems


def _pods(*totals: float) -> list[Pod]:
    return [Pod(f"s{i}", f"c{i}", t, 0.0, 0.0) for i, t in enumerate(totals)]


@pytest.mark.parametrize(
    ("totals", "last_first", "thirds"),
    [
        ((2.0,), 1.0, 1.0),
        ((2.0, 3.0, 4.0), 2.0, 2.0),  # a third of 3 pods is one pod
        ((2.0, 4.0, 3.0, 3.0, 9.0, 4.0), 2.0, 6.5 / 3.0),  # thirds of two: medians 3.0 and 6.5
    ],
    ids=["one", "three", "six"],
)
def test_start_times_last_against_first(totals: tuple[float, ...], last_first: float, thirds: float) -> None:
    got = times(_pods(*totals))
    assert got["ratio_last_first"] == round(last_first, 3)
    assert got["ratio_last_third_first_third"] == round(thirds, 3)


def test_the_readmes_row_of_a_density_document(tmp_path: Path) -> None:
    doc = {
        "pods_fit": 15,
        "capacity": {"capacity_mib": 1984.0},
        "vm": {"host_memory_per_pod_mib": 140.3, "start_s": {"first": 2.3, "last": 2.1, "ratio_last_first": 0.913}},
        "runc": {"host_memory_per_pod_mib": 4.5},
        "ratio_memory_vm_runc": 31.18,
    }
    (tmp_path / "density.json").write_text(json.dumps(doc))
    lines = [line for line in table.render(tmp_path).splitlines() if line.startswith("| `density`")]
    memory = "host memory per idle VM pod (15 fit in 1984 MiB) | 140 MiB | runc pod 4.5 MiB | 31.18 |  |  |"
    assert lines == [f"| `density` | {memory}"]
