"""shim.pod_growth: a growth is recorded only once the guest holds what it needs (the headroom
``vmsandbox.resize.needed`` names, asked of ``shim.hot_plug``), an unchanged growth asks nothing,
a failed plug records nothing, and a pod removed meanwhile is NOT_FOUND."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest

from shim import pod_growth
from shim.model import PodMeta, SandboxRecord
from vmsandbox.errors import InfrastructureError, NotFound
from vmsandbox.resize import Growth, Plugged
from vmsandbox.sizing import PodDemand, VmShape

MI = 1 << 20
SID = "cd" * 32
SHAPE = VmShape(1, 256 * MI, 2 * MI, (), "exclusive", PodDemand(500, 64 * MI), 1, 128 * MI)
RECORD = SandboxRecord(
    id=SID, meta=PodMeta("p", "ns", "uid"), state="ready", created_ns=1, runtime_handler="h", profile="h",
    domain="vmsandbox-" + SID[:32], shape=SHAPE,
)  # fmt: skip


class Records:
    def __init__(self, record: SandboxRecord | None) -> None:
        self.record = record

    def find(self, sandbox_id: str) -> SandboxRecord | None:
        return self.record if self.record is not None and self.record.id == sandbox_id else None

    def put_sandbox(self, record: SandboxRecord) -> None:
        self.record = record


class Locks:
    def __init__(self) -> None:
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def lock_for(self, sandbox_id: str) -> Iterator[None]:
        with self._lock:
            yield


class HotPlug:
    def __init__(self, fails: bool = False) -> None:
        self.asked: list[Plugged] = []
        self.fails = fails

    def grow(self, record: SandboxRecord, want: Plugged) -> Plugged:
        self.asked.append(want)
        if self.fails:
            raise InfrastructureError("the guest did not bring the resize's headroom online")
        return want


def sandboxes(record: SandboxRecord | None) -> Any:
    return SimpleNamespace(records=Records(record), locks=Locks())


@pytest.mark.parametrize(
    ("growth", "asked"),
    [
        (Growth(cpu_millis=1500, memory_bytes=96 * MI), [Plugged(1, 128 * MI)]),
        (Growth(cpu_millis=400), [Plugged()]),  # fits the boot's vCPU: nothing to bring online
        (Growth(memory_bytes=1), [Plugged(memory_bytes=128 * MI)]),  # whole hot-plug blocks
    ],
)
def test_a_growth_is_recorded_once_the_guest_holds_it(growth: Growth, asked: list[Plugged]) -> None:
    sb, hp = sandboxes(RECORD), HotPlug()
    updated = pod_growth.grow(sb, hp, RECORD, growth)  # type: ignore[arg-type]
    assert hp.asked == asked
    assert updated.growth == growth == sb.records.record.growth


def test_an_unchanged_growth_asks_nothing() -> None:
    record = replace(RECORD, growth=Growth(cpu_millis=1500))
    sb, hp = sandboxes(record), HotPlug()
    assert pod_growth.grow(sb, hp, record, Growth(cpu_millis=1500)) is record  # type: ignore[arg-type]
    assert hp.asked == []


def test_a_failed_plug_records_nothing() -> None:
    sb, hp = sandboxes(RECORD), HotPlug(fails=True)
    with pytest.raises(InfrastructureError):
        pod_growth.grow(sb, hp, RECORD, Growth(cpu_millis=1500))  # type: ignore[arg-type]
    assert sb.records.record.growth == Growth()


def test_a_pod_removed_meanwhile_is_not_found() -> None:
    sb = sandboxes(None)
    with pytest.raises(NotFound, match="was removed"):
        pod_growth.grow(sb, HotPlug(), RECORD, Growth(cpu_millis=1500))  # type: ignore[arg-type]
