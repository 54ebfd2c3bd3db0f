"""A RunPodSandbox that fails half-way says what its rollback really did: when libvirt cannot remove
the domain the unwinding stops there and the claims stay held (the guest may hold the pages), and
the error says so, until the reconcile removes the domain; otherwise nothing is left behind. The
pod's name is free again once nothing of its sandbox is left."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest

from shim.config import ShimConfig
from shim.model import PodMeta, RunPodSandbox, SandboxSpec
from shim.rpc.run_pod_sandbox import run_pod_sandbox
from shim.sandboxes import Sandboxes
from tests.cri_server import pods_for
from vmsandbox.adapters.hypervisor import Hypervisor
from vmsandbox.adapters.ledger import Ledger
from vmsandbox.adapters.sysfs import read_inventory
from vmsandbox.errors import AlreadyExists, InfrastructureError
from vmsandbox.profile import Profile

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "sysfs" / "one-node-2cpu"


class FailingHypervisor:
    """Defines, then fails to start; tear-down fails while ``libvirt_down`` is set."""

    def __init__(self) -> None:
        self.libvirt_down = False
        self.defined: list[str] = []

    def define(self, xml: str) -> None:
        self.defined.append(xml)

    def start(self, name: str) -> None:
        raise InfrastructureError(f"libvirt start {name}: Cannot recv data: Connection reset by peer")

    def version(self) -> str:
        return "9.0.0"

    def daemon_pid(self) -> int | None:
        return None  # no daemon: guests see this process's mounts

    def qemu_version(self) -> str:
        return "7.2.22"

    def list_domains(self, prefix: str) -> list[object]:
        return []

    def teardown(self, name: str) -> bool:
        if self.libvirt_down:
            raise InfrastructureError("cannot connect to libvirt at qemu:///system: Connection refused")
        return True


@pytest.fixture
def env(tmp_path: Path) -> Iterator[tuple[Sandboxes, FailingHypervisor, Ledger]]:
    image = tmp_path / "image"
    image.mkdir()
    for name in ("vmlinux", "initramfs.img"):
        (image / name).write_text("")
    ledger = Ledger(tmp_path / "state.db")
    hv = FailingHypervisor()
    sb = Sandboxes(
        ShimConfig(state_dir=str(tmp_path), console_dir="", pod_network="none"),
        ledger,
        cast(Hypervisor, hv),
        {
            "vmsandbox": Profile(
                name="vmsandbox",
                handler="vmsandbox",
                image_dir=str(image),
                accel="tcg",
                default_memory_bytes=32 << 20,  # 64 MiB with the overhead: fits the fixture's 60 free pages
                memory_overhead_bytes=32 << 20,
                memory_min_bytes=64 << 20,
            )
        },
        inventory=lambda: read_inventory(FIXTURE / "sys", FIXTURE / "proc"),
    )
    try:
        yield sb, hv, ledger
    finally:
        ledger.close()


REQUEST = RunPodSandbox(SandboxSpec(meta=PodMeta("web", "default", "uid-1")))


def run(sb: Sandboxes) -> None:
    run_pod_sandbox(pods_for(sb), REQUEST)


def test_rollback_that_worked_says_so_and_leaves_nothing(env: tuple[Sandboxes, FailingHypervisor, Ledger]) -> None:
    sb, _hv, ledger = env
    undone = "define, share, network, record, claim, reserve-name"
    with pytest.raises(InfrastructureError, match=rf"^pod default/web: .* \(rolled back: {undone} undone\)$"):
        run(sb)
    assert ledger.claim_owners() == set()
    assert ledger.sandboxes() == []


def test_rollback_that_could_not_remove_the_domain_keeps_claims_and_says_so(
    env: tuple[Sandboxes, FailingHypervisor, Ledger],
) -> None:
    sb, hv, ledger = env
    hv.libvirt_down = True
    with pytest.raises(InfrastructureError) as err:
        run(sb)
    assert "rollback incomplete: undoing define failed" in str(err.value)
    assert "its resources stay held until the shim's reconciliation removes it" in str(err.value)
    assert "released" not in str(err.value)
    assert len(ledger.claim_owners()) == 1  # held: the domain may still hold the pages
    with pytest.raises(AlreadyExists, match="already has sandbox"):
        run(sb)  # the half-made sandbox keeps the pod's name while it is there
    # the next reconcile, with libvirt back, finishes the job
    hv.libvirt_down = False
    cast(Hypervisor, hv).list_ours = lambda: []  # type: ignore[method-assign]
    sb.reconciler.reconcile()
    assert ledger.claim_owners() == set()
    assert ledger.sandboxes() == []
    assert not sb.dirs.root.exists() or list(sb.dirs.root.iterdir()) == []
    with pytest.raises(InfrastructureError, match="rolled back"):
        run(sb)  # the name is free again


def test_a_failed_run_frees_the_pod_name(env: tuple[Sandboxes, FailingHypervisor, Ledger]) -> None:
    sb, _hv, _ledger = env
    for _ in range(2):  # the second attempt is not refused as a duplicate of the first
        with pytest.raises(InfrastructureError, match="rolled back"):
            run(sb)
