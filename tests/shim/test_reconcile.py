"""Start-up reconciliation, one table row per state a crash can leave (real ledger, fake libvirt).

The same states are produced for real, by killing the shim at each fault point, in
tests/integration/test_crash_recovery.py; here each decision is checked in milliseconds,
together with ownership (domains of another state database are never touched)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import pytest

from shim.config import ShimConfig
from shim.model import (
    CONTAINER_CREATED,
    CONTAINER_EXITED,
    SANDBOX_NOTREADY,
    SANDBOX_READY,
    ContainerRecord,
    PodMeta,
    SandboxRecord,
)
from shim.sandboxes import Sandboxes
from vmsandbox.adapters.hypervisor import DomainInfo, Hypervisor
from vmsandbox.adapters.ledger import Ledger
from vmsandbox.adapters.sysfs import read_inventory
from vmsandbox.claims import Claim
from vmsandbox.domain import SandboxIdentity, domain_name
from vmsandbox.domain_xml import read_identity
from vmsandbox.errors import AlreadyExists, InfrastructureError
from vmsandbox.lifecycle import STATE_CREATING
from vmsandbox.profile import Profile
from vmsandbox.sizing import PodDemand, VmShape

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "sysfs" / "one-node-2cpu"
P2M = 2 << 20
LIMITS = {(0, P2M): 64}


@dataclass
class FakeDomain:
    sandbox_id: str
    active: bool
    owner: str


@dataclass
class FakeLibvirt:
    domains: dict[str, FakeDomain] = field(default_factory=dict)
    broken: set[str] = field(default_factory=set)  # names whose tear-down fails
    torn_down: list[str] = field(default_factory=list)

    def list_ours(self) -> list[DomainInfo]:
        return [DomainInfo(n, d.sandbox_id, d.active, "<domain/>", d.owner) for n, d in sorted(self.domains.items())]

    def daemon_pid(self) -> int | None:
        return None  # no daemon: guests see this process's mounts

    def list_domains(self, prefix: str) -> list[DomainInfo]:
        return [d for d in self.list_ours() if d.name.startswith(prefix)]

    def destroy(self, name: str) -> bool:
        dom = self.domains.get(name)
        was = bool(dom and dom.active)
        if dom:
            dom.active = False
        return was

    def teardown(self, name: str) -> bool:
        if name in self.broken:
            raise InfrastructureError(f"libvirt tear down {name}: boom")
        self.torn_down.append(name)
        return self.domains.pop(name, None) is not None


@pytest.fixture
def env(tmp_path: Path) -> Iterator[tuple[Sandboxes, FakeLibvirt, Path]]:
    ledger = Ledger(tmp_path / "state.db")
    fake = FakeLibvirt()
    console = tmp_path / "console"
    console.mkdir()
    sb = Sandboxes(
        ShimConfig(state_dir=str(tmp_path), console_dir=str(console), pod_network="none"),
        ledger,
        cast(Hypervisor, fake),
        {"vmsandbox": Profile(name="vmsandbox", handler="vmsandbox")},
        inventory=lambda: read_inventory(FIXTURE / "sys", FIXTURE / "proc"),
    )
    try:
        yield sb, fake, console
    finally:
        ledger.close()


def sid(n: int) -> str:
    return f"{n:04x}" + "c" * 60


def add(
    sb: Sandboxes,
    fake: FakeLibvirt,
    n: int,
    *,
    state: str | None,
    domain: bool | None,
    cpus: tuple[int, ...] = (),
    pages: int = 0,
    claim: bool = True,
    owner: str | None = None,
    containers: int = 0,
    console: Path | None = None,
) -> str:
    """A sandbox as a crash left it: row in ``state`` (None: no row), domain running/defined/absent."""
    s = sid(n)
    held = Claim.of(cpus, pages=[(0, P2M, pages)])
    if claim and not held.empty:
        sb.ledger.claim(s, held, page_limits=LIMITS, memory_limits={})
    if state is not None:
        record = SandboxRecord(
            id=s,
            meta=PodMeta(f"pod-{n}", "test", f"uid-{n}"),
            state=state,
            created_ns=n,
            runtime_handler="vmsandbox",
            profile="vmsandbox",
            domain=domain_name(s),
            shape=VmShape(len(cpus), 256 << 20, 2 << 20, (), "exclusive", PodDemand(1000 * len(cpus), 192 << 20)),
            cpus=tuple(cpus),
            hugepages=((0, 2 << 20, pages),) if pages else (),
        )
        sb.ledger.put_sandbox(s, state, n, record.to_doc())
        for i in range(containers):
            c = ContainerRecord(f"c{n}-{i}", s, f"app{i}", 0, CONTAINER_CREATED, n)
            sb.records.save_container(c)
    if domain is not None:
        fake.domains[domain_name(s)] = FakeDomain(s, domain, sb.ledger.instance_id if owner is None else owner)
    if console is not None:
        (console / f"{s}.log").write_text("boot\n")
    return s


def test_each_crash_state_is_resolved(
    env: tuple[Sandboxes, FakeLibvirt, Path], caplog: pytest.LogCaptureFixture
) -> None:
    sb, fake, console = env
    # what a shim killed after each of these steps leaves: RunPodSandbox:claim, :define, :guest-start,
    # then ready, then RemovePodSandbox:guest-destroy and :release
    claimed_only = add(sb, fake, 1, state=None, domain=None, cpus=(0,), pages=2)
    defined = add(sb, fake, 2, state=STATE_CREATING, domain=False, pages=3, console=console)
    started = add(sb, fake, 3, state=STATE_CREATING, domain=True, pages=3, console=console)
    ready = add(sb, fake, 4, state=SANDBOX_READY, domain=True, cpus=(1,), pages=4, containers=2, console=console)
    destroyed = add(sb, fake, 5, state=SANDBOX_READY, domain=False, pages=5, containers=1)
    released = add(sb, fake, 6, state=SANDBOX_READY, domain=None, claim=False, pages=1)
    half_stopped = add(sb, fake, 7, state=SANDBOX_NOTREADY, domain=False, pages=2)  # NOTREADY + domain
    no_row = add(sb, fake, 8, state=None, domain=True, claim=False, console=console)  # domain, no row
    forgotten_log = console / f"{sid(9)}.log"
    forgotten_log.write_text("old\n")
    not_ours_log = console / "notes.log"
    not_ours_log.write_text("keep\n")

    with caplog.at_level(logging.INFO, logger="shim.reconcile"):
        report = sb.reconciler.reconcile()

    assert report["adopted"] == [ready]
    assert sorted(report["removed_domains"]) == sorted(
        domain_name(s) for s in (defined, started, destroyed, half_stopped, no_row)
    )
    assert sorted(report["forgotten"]) == sorted([defined, started])
    assert sorted(report["stopped"]) == sorted([destroyed, released])
    assert sorted(report["released"]) == sorted([claimed_only, half_stopped])
    # libvirt now holds exactly the adopted guest; the ledger holds exactly its claims
    assert list(fake.domains) == [domain_name(ready)]
    assert sb.ledger.claim_owners() == {ready}
    assert sb.ledger.claims_of(ready) == Claim(cpus=(1,), pages=((0, P2M, 4),))
    assert sb.resources.owners() == {ready} and sb.resources.held(ready) == Claim(cpus=(1,), pages=((0, P2M, 4),))
    # the free state is what is left: CPU 0 and 60 - 4 of the fixture's free pages
    assert [(u.resource, u.capacity, u.held) for u in sb.resources.usage() if u.resource != "memory"] == [
        ("cpu", 2, 1),
        ("hugepages-2Mi", 60, 4),
        ("hugepages-1Gi", 0, 0),
    ]
    rows = {s: state for s, state, _, _ in sb.ledger.sandboxes()}
    assert rows == {
        ready: SANDBOX_READY,
        destroyed: SANDBOX_NOTREADY,
        released: SANDBOX_NOTREADY,
        half_stopped: SANDBOX_NOTREADY,
    }
    # the adopted sandbox keeps its containers as they were; a lost one's are marked exited
    assert [c.state for c in sb.records.containers(ready)] == [CONTAINER_CREATED, CONTAINER_CREATED]
    assert [(c.state, c.reason) for c in sb.records.containers(destroyed)] == [(CONTAINER_EXITED, "SandboxStopped")]
    # console logs: the adopted one stays, the forgotten ones go, files that are not ours stay
    assert sorted(p.name for p in console.iterdir()) == sorted([f"{ready}.log", "notes.log"])
    # every decision names the sandbox and its domain
    text = caplog.text
    for s in (claimed_only, defined, started, ready, destroyed, released, half_stopped, no_row):
        assert s[:12] in text and domain_name(s) in text, s
    assert "adopted sandbox " + ready[:12] in text
    # a second pass finds nothing to do
    again = sb.reconciler.reconcile()
    assert again["adopted"] == [ready]
    assert not any(again[k] for k in ("removed_domains", "forgotten", "stopped", "released", "failed"))


def test_domains_of_another_state_database_are_left_alone(env: tuple[Sandboxes, FakeLibvirt, Path]) -> None:
    sb, fake, _ = env
    other = add(sb, fake, 1, state=None, domain=True, claim=False, owner="f" * 32)
    legacy_unknown = add(sb, fake, 2, state=None, domain=True, claim=False, owner="")
    legacy_known = add(sb, fake, 3, state=SANDBOX_READY, domain=True, pages=1, owner="")  # defined before schema 2
    report = sb.reconciler.reconcile()
    assert sorted(report["foreign"]) == sorted([domain_name(other), domain_name(legacy_unknown)])
    assert report["adopted"] == [legacy_known]
    assert set(fake.domains) == {domain_name(s) for s in (other, legacy_unknown, legacy_known)}
    assert fake.torn_down == []


def test_inconsistent_ready_sandbox_is_torn_down(env: tuple[Sandboxes, FakeLibvirt, Path]) -> None:
    """Running and READY, but its CPU claim is missing: adopting it would let the CPU be handed out twice."""
    sb, fake, _ = env
    s = add(sb, fake, 1, state=SANDBOX_READY, domain=True, cpus=(0,), pages=2, claim=False)
    sb.ledger.claim(s, Claim(pages=((0, P2M, 2),)), page_limits=LIMITS, memory_limits={})
    report = sb.reconciler.reconcile()
    assert report["adopted"] == [] and report["stopped"] == [s]
    assert fake.domains == {}
    assert sb.ledger.held() == {} and sb.resources.owners() == frozenset()


def test_failed_tear_down_keeps_the_claims(env: tuple[Sandboxes, FakeLibvirt, Path]) -> None:
    sb, fake, _ = env
    s = add(sb, fake, 1, state=STATE_CREATING, domain=True, cpus=(0,), pages=2)
    fake.broken.add(domain_name(s))
    report = sb.reconciler.reconcile()
    assert report["failed"] == [domain_name(s)]
    assert sb.ledger.claims_of(s) != Claim()  # the guest may still hold the pages: nothing handed out twice
    assert sb.resources.held(s) == Claim(cpus=(0,), pages=((0, P2M, 2),))
    assert sb.ledger.get_sandbox(s) is not None
    fake.broken.clear()
    report = sb.reconciler.reconcile()  # the next start finishes the job
    assert report["forgotten"] == [s]
    assert sb.ledger.held() == {} and fake.domains == {} and sb.resources.owners() == frozenset()


def test_owner_round_trips_through_domain_xml() -> None:
    from vmsandbox.domain import build_domain
    from vmsandbox.domain_xml import render
    from vmsandbox.sizing import LinuxResources, demand_from_linux, shape_for

    profile = Profile(name="vmsandbox", handler="vmsandbox")
    ident = SandboxIdentity(sid(1), "web", "default", "uid", 0, "vmsandbox", owner="ab" * 16)
    domain = build_domain(
        identity=ident,
        uuid="00000000-0000-4000-8000-000000000000",
        shape=shape_for(demand_from_linux(LinuxResources(), {}, profile), profile),
        host_cpus=(0,),
        emulator_cpus=(0,),
        hugepage_nodes=(0,),
        accel="tcg",
        kernel="/k",
        initrd="/i",
        machine="q35",
        extra_cmdline="",
        shape_json="",
        console_log=None,
    )
    xml = render(domain)
    assert "<vmsandbox:owner>" + "ab" * 16 + "</vmsandbox:owner>" in xml
    assert read_identity(xml) == ident


def test_periodic_reconcile_cleans_orphans_and_leaves_busy_sandboxes_alone(
    env: tuple[Sandboxes, FakeLibvirt, Path],
) -> None:
    sb, fake, _console = env
    sb.reconciler.reconcile()  # start-up
    in_flight = add(sb, fake, 1, state=STATE_CREATING, domain=True, pages=2)  # a RunPodSandbox still running
    sb.locks.in_flight.add(in_flight)
    locked = add(sb, fake, 2, state=SANDBOX_READY, domain=False, pages=2)  # a StopPodSandbox half-way
    orphan = add(sb, fake, 3, state=None, domain=False, claim=False)  # a define whose row was lost
    leftover = add(sb, fake, 4, state=None, domain=None, cpus=(1,))  # claims of a RunPodSandbox that died
    sb.resources.resync()  # the claims above went straight to the ledger; the manager learns them
    with sb.locks.lock_for(locked):
        report = sb.reconciler.reconcile(periodic=True)
    assert report["removed_domains"] == [domain_name(orphan)]
    assert report["released"] == [leftover]
    assert sorted(fake.domains) == sorted([domain_name(in_flight), domain_name(locked)])
    assert sb.ledger.claim_owners() == {in_flight, locked}
    # once nothing works on them any more, the next round finishes the job
    sb.locks.in_flight.discard(in_flight)
    report = sb.reconciler.reconcile(periodic=True)
    assert report["forgotten"] == [in_flight] and report["stopped"] == [locked]
    assert fake.domains == {} and sb.ledger.claim_owners() == frozenset()


def test_periodic_reconcile_keeps_the_names_of_runs_in_flight(env: tuple[Sandboxes, FakeLibvirt, Path]) -> None:
    sb, _fake, _console = env
    meta = PodMeta("web", "default", "uid-1")
    sb.records.reserve_name(meta, sid(7))
    sb.locks.in_flight.add(sid(7))
    sb.reconciler.reconcile(periodic=True)
    with pytest.raises(AlreadyExists, match=sid(7)):
        sb.records.reserve_name(meta, sid(8))
