"""What the sandbox start path must not cost: a RunPodSandbox through the real socket leaves
libvirt's QEMU capabilities cache untouched (no re-probe of QEMU on define, the ~10 s per pod a
/dev/kvm that libvirt-qemu cannot open causes), and the shim reports no host set-up problem."""

from __future__ import annotations

from pathlib import Path

import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from shim.pods import HOST_SETUP_CONDITION
from tests.shim_kit import Shim, pod, q

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# libvirt's QEMU driver (qemu:///system) keeps one file per QEMU binary here and rewrites it on
# every probe.
CAPS_CACHE = Path("/var/cache/libvirt/qemu/capabilities")


def cache_mtimes() -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in CAPS_CACHE.glob("*.xml")}


def test_run_pod_sandbox_does_not_reprobe_qemu(shim: Shim) -> None:
    before = cache_mtimes()
    assert before, f"no QEMU capabilities cache in {CAPS_CACHE}: is libvirtd the system daemon?"
    config = pod("caps", containers=[("app", q({"cpu": "1", "memory": "64Mi"}))])
    sid = shim.runtime.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=300).pod_sandbox_id
    try:
        after = cache_mtimes()
    finally:
        shim.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=120)
        shim.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=120)
    changed = sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))
    assert not changed, (
        f"libvirt probed QEMU again during RunPodSandbox (rewrote {changed} in {CAPS_CACHE}); "
        "see the shim's 'host set-up' warning and scripts/setup-host.sh step 2"
    )


def test_no_host_setup_warning(shim: Shim) -> None:
    status = shim.runtime.Status(pb.StatusRequest(), timeout=30).status
    bad = [c for c in status.conditions if c.type == HOST_SETUP_CONDITION]
    assert not bad, bad[0].message
    assert "host set-up:" not in shim.log_text()
