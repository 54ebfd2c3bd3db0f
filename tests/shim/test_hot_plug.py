"""shim.hot_plug against a fake guest and hypervisor: what is plugged is read from the running
guest (online vCPUs from its report, DIMMs from the live XML), vCPUs are brought online by the
agent's ``cpus_online`` (never through libvirt), a DIMM is plugged only for what is missing, a
retried grow after a crash at either fault point finishes the work without a second DIMM, and a
guest that does not show the headroom online, or lies about it, is handled."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from shim import faults
from shim.faults import InjectedFault
from shim.hot_plug import HotPlug
from shim.model import PodMeta, SandboxRecord
from vmsandbox.domain_xml import read_dimm_kib
from vmsandbox.errors import InfrastructureError
from vmsandbox.resize import Plugged
from vmsandbox.sizing import PodDemand, VmShape

MI = 1 << 20
SID = "ab" * 32
SHAPE = VmShape(1, 256 * MI, 2 * MI, (), "exclusive", PodDemand(500, 64 * MI), 2, 256 * MI)
RECORD = SandboxRecord(
    id=SID, meta=PodMeta("p", "ns", "uid"), state="ready", created_ns=1, runtime_handler="h", profile="h",
    domain="vmsandbox-" + SID[:32], shape=SHAPE,
)  # fmt: skip


@dataclass
class Guest:
    """The guest as agent and hypervisor see it: its online vCPUs, MemTotal and DIMMs."""

    vcpus: int = 1
    mem_total_kib: int = 200_000
    dimms: list[int] = field(default_factory=list)  # KiB each
    onlines: bool = True  # does cpus_online bring CPUs online
    lies: int = 0  # vCPUs the report claims beyond the truth
    asked: list[str] = field(default_factory=list)

    # -- the agent ------------------------------------------------------------------------------
    def client(self, sandbox_id: str) -> Guest:
        assert sandbox_id == SID
        return self

    def request(self, op: str, args: Any, timeout_s: float) -> dict[str, object]:
        assert op == "report"
        return {
            "agent": "vmsandbox-agent/9", "protocol": 9, "kernel": "6.1", "vcpus": self.vcpus + self.lies,
            "mem_total_kib": self.mem_total_kib, "hugepages": {}, "cmdline": "maxcpus=1", "boot_ms": 1,
        }  # fmt: skip

    def cpus_online(self, count: int, timeout_s: float = 30) -> int:
        self.asked.append(f"cpus_online {count}")
        if self.onlines:
            self.vcpus = max(self.vcpus, count)
        return self.vcpus

    # -- the hypervisor -------------------------------------------------------------------------
    def live_xml(self, name: str) -> str:
        assert name == RECORD.domain
        mems = "".join(
            f"<memory model='dimm'><target><size unit='KiB'>{k}</size></target></memory>" for k in self.dimms
        )
        return f"<domain><vcpu placement='static'>3</vcpu><devices>{mems}</devices></domain>"

    def attach_device(self, name: str, xml: str) -> None:
        kib = read_dimm_kib(f"<domain><devices>{xml}</devices></domain>")
        self.asked.append(f"dimm {kib}")
        self.dimms.append(kib)
        self.mem_total_kib += kib


def hot_plug(guest: Guest, timeout_s: float = 30) -> HotPlug:
    return HotPlug(guest, guest, timeout_s=timeout_s)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("want", "asked", "after"),
    [
        (Plugged(), [], Plugged()),
        (Plugged(vcpus=1), ["cpus_online 2"], Plugged(vcpus=1)),
        (Plugged(vcpus=2), ["cpus_online 3"], Plugged(vcpus=2)),
        (Plugged(memory_bytes=128 * MI), ["dimm 131072"], Plugged(memory_bytes=128 * MI)),
        (Plugged(1, 256 * MI), ["cpus_online 2", "dimm 262144"], Plugged(1, 256 * MI)),
    ],
)
def test_grow_brings_online_what_is_missing(want: Plugged, asked: list[str], after: Plugged) -> None:
    guest = Guest()
    hp = hot_plug(guest)
    assert hp.grow(RECORD, want) == after
    assert guest.asked == asked
    assert hp.plugged(RECORD) == after


class Unreachable(Guest):
    def request(self, op: str, args: Any, timeout_s: float) -> dict[str, object]:
        raise AssertionError(f"the guest was asked {op}")

    def live_xml(self, name: str) -> str:
        raise AssertionError("the live XML was read")


def test_a_growth_that_needs_nothing_asks_nothing_of_the_guest() -> None:
    """A resize the VM holds as booted (its growth within the boot's vCPUs and RAM) costs no round trip."""
    assert hot_plug(Unreachable()).grow(RECORD, Plugged()) == Plugged()


def test_grow_adds_only_what_the_guest_lacks() -> None:
    guest = Guest(vcpus=2, dimms=[128 * 1024])
    hp = hot_plug(guest)
    assert hp.plugged(RECORD) == Plugged(1, 128 * MI)
    assert hp.grow(RECORD, Plugged(1, 128 * MI)) == Plugged(1, 128 * MI)
    assert guest.asked == []  # covered: nothing asked
    assert hp.grow(RECORD, Plugged(2, 256 * MI)) == Plugged(2, 256 * MI)
    assert guest.asked == ["cpus_online 3", "dimm 131072"]


@pytest.mark.parametrize("point", ["hot-plug:after-vcpus", "hot-plug:after-dimm"])
def test_a_grow_retried_after_a_fault_finishes_it_without_a_second_dimm(point: str) -> None:
    guest = Guest()
    hp = hot_plug(guest)
    with faults.raising(point), pytest.raises(InjectedFault):
        hp.grow(RECORD, Plugged(1, 128 * MI))
    assert hp.grow(RECORD, Plugged(1, 128 * MI)) == Plugged(1, 128 * MI)
    assert guest.dimms == [128 * 1024], guest.asked
    assert guest.vcpus == 2


def test_a_guest_that_does_not_online_its_vcpus_fails_the_grow() -> None:
    guest = Guest(onlines=False)
    with pytest.raises(InfrastructureError, match=r"reports 1 vCPUs .* expected 2"):
        hot_plug(guest, timeout_s=0.3).grow(RECORD, Plugged(vcpus=1))


def test_a_guest_that_claims_more_vcpus_than_its_headroom_is_clamped() -> None:
    """It hurts only itself: it gets no CPU onlined, and the host's reservation is what it was."""
    guest = Guest(lies=50)
    hp = hot_plug(guest)
    assert hp.plugged(RECORD) == Plugged(vcpus=SHAPE.headroom_vcpus)
    assert hp.grow(RECORD, Plugged(vcpus=1)) == Plugged(vcpus=2)
    assert guest.asked == []
