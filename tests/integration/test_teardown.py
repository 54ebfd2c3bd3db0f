"""``python -m cli.teardown`` (what ``scripts/cluster.sh down`` runs) against a real shim:
a downstream that died fails its own pods' removal, plainly, and never keeps the VM pods from
going; a shim that died leaves its VMs to the libvirt pass, which finds them by their metadata."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from tests.integration.downstream_kit import containerd
from tests.shim_kit import (
    REPO,
    Shim,
    busybox_registry,
    our_domains,
    pod,
    require_host,
    start_shim,
    stop_shim,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def teardown(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cli.teardown", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def vm_pod(shim: Shim, name: str) -> str:
    request = pb.RunPodSandboxRequest(config=pod(name), runtime_handler="vmsandbox")
    return str(shim.runtime.RunPodSandbox(request, timeout=180).pod_sandbox_id)


def test_a_dead_downstream_fails_its_pods_plainly_and_the_vm_pod_is_removed(tmp_path: Path) -> None:
    require_host()
    if busybox_registry() is None:
        pytest.skip("no local registry (docker-registry, skopeo, busybox-static)")
    (tmp_path / "shim").mkdir()
    (tmp_path / "net.d").mkdir()
    with containerd(tmp_path / "containerd", tmp_path / "net.d") as ctd:
        shim = start_shim(tmp_path / "shim", extra_config={"downstream_endpoint": ctd.endpoint}, pull_busybox=False)
        try:
            ordinary = pod("plain", containers=[])
            ordinary.linux.security_context.namespace_options.network = pb.NODE  # no CNI needed
            plain = shim.runtime.RunPodSandbox(pb.RunPodSandboxRequest(config=ordinary), timeout=120).pod_sandbox_id
            vm = vm_pod(shim, "vm")
            assert len(our_domains(shim)) == 1
            listed = shim.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items  # as a kubelet does
            assert {s.id for s in listed} == {plain, vm}
            ctd.kill()  # kill -9: the shim still lists its pods, as containerd last listed them

            done = teardown("sandboxes", str(shim.socket), "--state-dir", str(shim.state_dir))
            assert done.returncode == 1, done
            assert "Traceback" not in done.stderr, done.stderr
            problems = done.stderr.strip().splitlines()
            assert len(problems) == 1, problems
            assert plain[:13] in problems[0] and "UNAVAILABLE" in problems[0], problems
            assert f"removed VM sandbox {vm[:13]}" in done.stdout, done.stdout
            assert our_domains(shim) == []

            stop_shim(shim)
            left = teardown("domains", "--state-dir", str(shim.state_dir))
            assert (left.returncode, left.stdout, left.stderr) == (0, "", "")
        finally:
            stop_shim(shim)


def test_the_vms_of_a_dead_shim_are_removed_by_their_metadata(tmp_path: Path) -> None:
    require_host()
    shim = start_shim(tmp_path, pull_busybox=False)
    try:
        vm = vm_pod(shim, "vm")
        (domain,) = our_domains(shim)
    finally:
        stop_shim(shim, kill=True)

    through_shim = teardown("sandboxes", str(shim.socket), "--state-dir", str(shim.state_dir))
    assert through_shim.returncode == 1 and "Traceback" not in through_shim.stderr, through_shim
    assert vm[:13] in through_shim.stderr and "UNAVAILABLE" in through_shim.stderr
    assert our_domains(shim) == [domain]  # nobody answered: the VM runs on

    done = teardown("domains", "--state-dir", str(shim.state_dir))
    assert done.returncode == 0, done
    assert done.stdout.strip() == f"removed domain {domain} (state {shim.state_dir})"
    assert our_domains(shim) == []


def test_a_vm_whose_state_directory_is_gone_is_removed_as_an_orphan(tmp_path: Path) -> None:
    """What ``make stop-host`` runs: a domain whose metadata names a state directory without a state
    database has no shim left to own it, and goes; the guests of live states stay."""
    require_host()
    shim = start_shim(tmp_path, pull_busybox=False)
    try:
        vm_pod(shim, "vm")
        (domain,) = our_domains(shim)
    finally:
        stop_shim(shim, kill=True)
    real = shim.state_dir.resolve()
    aside = tmp_path / "aside"
    aside.mkdir()
    databases = [p for p in real.iterdir() if p.name.startswith("state.db")]
    for p in databases:
        p.rename(aside / p.name)  # the state is gone, as far as anyone can tell
    try:
        done = teardown("orphans")
        assert done.returncode == 0 and "Traceback" not in done.stderr, done
        assert f"removed domain {domain} (its state directory is gone)" in done.stdout.splitlines(), done.stdout
    finally:
        for p in databases:
            (aside / p.name).rename(p)
    after = start_shim(tmp_path, pull_busybox=False)  # its state back: it forgets the guest that went
    try:
        assert our_domains(after) == []
        for s in after.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items:
            after.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=s.id), timeout=120)
            after.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=s.id), timeout=120)
    finally:
        stop_shim(after)
