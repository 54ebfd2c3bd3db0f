"""In-place resize into a profile's resize headroom, through the real socket with a real guest.

The ``headroom`` profile (``tests/shim_kit.py``) reserves one vCPU and 128 MiB beyond what a pod
asks: claimed on the host at RunPodSandbox, present but offline in the guest (its vCPU) or not
plugged (its RAM). A resize that fits the VM as booted changes nothing plugged; one that needs more
than it booted with brings the headroom online (the agent onlines the vCPU, libvirt plugs a DIMM), and
the container sees it (``nproc``, ``MemTotal``); a resize down keeps it; one beyond the headroom is
refused FAILED_PRECONDITION naming both, with nothing changed. No claim is taken or given back by
any resize, and a shim killed half-way through a plug loses none: the next resize finishes it.
"""

from __future__ import annotations

import json
import signal
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import libvirt
import pytest

from cli.inspect_state import claims
from gen.cri.runtime.v1 import api_pb2 as pb
from tests.shim_kit import HEADROOM_HANDLER, LIBVIRT_URI, Shim, busybox_registry, start_shim, stop_shim
from vmsandbox.domain_xml import read_dimm_kib

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

MI = 1 << 20


def _linux(quota: int, memory_mib: int) -> pb.LinuxContainerResources:
    return pb.LinuxContainerResources(cpu_period=100_000, cpu_quota=quota, memory_limit_in_bytes=memory_mib * MI)


def _info(shim: Shim, sandbox_id: str) -> dict[str, Any]:
    st = shim.runtime.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id, verbose=True), timeout=30)
    doc: dict[str, Any] = json.loads(st.info["info"])
    return doc


def _run(shim: Shim, cid: str, *argv: str) -> str:
    res = shim.runtime.ExecSync(pb.ExecSyncRequest(container_id=cid, cmd=list(argv), timeout=30), timeout=60)
    assert res.exit_code == 0, res
    return res.stdout.decode()


def _live_xml(sid: str) -> str:
    conn = libvirt.open(LIBVIRT_URI)
    try:
        return str(conn.lookupByName(f"vmsandbox-{sid[:32]}").XMLDesc(0))
    finally:
        conn.close()


def _present_vcpus(live: str) -> int:
    """The vCPUs QEMU has (each its thread, from its start): all of them, none left for libvirt to plug."""
    vcpu = ET.fromstring(live).find("vcpu")
    assert vcpu is not None and vcpu.get("current") in (None, vcpu.text), live
    return int(vcpu.text or "0")


def _guest(shim: Shim, cid: str) -> tuple[int, int]:
    """(nproc, MemTotal in KiB) as the container sees them."""
    nproc = int(_run(shim, cid, "busybox", "nproc"))
    meminfo = _run(shim, cid, "cat", "/proc/meminfo")
    total = next(int(line.split()[1]) for line in meminfo.splitlines() if line.startswith("MemTotal:"))
    return nproc, total


@pytest.fixture(scope="module")
def pod(shim: Shim) -> Iterator[tuple[str, str]]:
    if busybox_registry() is None:
        pytest.fail("the busybox registry needs docker-registry, skopeo and busybox (scripts/setup-host.sh)")
    config = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name="resized", namespace="resize", uid="uid-resized", attempt=0),
        linux=pb.LinuxPodSandboxConfig(resources=_linux(50_000, 64)),
    )
    sid = shim.runtime.RunPodSandbox(
        pb.RunPodSandboxRequest(config=config, runtime_handler=HEADROOM_HANDLER), timeout=300
    ).pod_sandbox_id
    try:
        cid = shim.runtime.CreateContainer(
            pb.CreateContainerRequest(
                pod_sandbox_id=sid,
                sandbox_config=config,
                config=pb.ContainerConfig(
                    metadata=pb.ContainerMetadata(name="app", attempt=0),
                    image=pb.ImageSpec(image="busybox"),
                    command=["sleep", "3600"],
                    linux=pb.LinuxContainerConfig(resources=_linux(50_000, 64)),
                ),
            ),
            timeout=120,
        ).container_id
        shim.runtime.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=120)
        yield sid, cid
    finally:
        shim.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=120)
        shim.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=120)


def test_the_headroom_is_claimed_at_boot_and_plugged_by_a_resize(shim: Shim, pod: tuple[str, str]) -> None:
    sid, cid = pod
    shape = _info(shim, sid)["shape"]
    assert shape["vcpus"] == 1 and shape["headroom"] == {"vcpus": 1, "memory_bytes": 128 * MI}, shape
    held = claims(shim.state_dir)
    mine = held[sid]
    # the host holds the boot RAM and the headroom, and one CPU more than the guest has online
    pages = sum(count for _, size, count in mine.pages if size == 2 * MI)
    assert pages * 2 * MI == shape["memory_bytes"] + 128 * MI, mine
    assert len(mine.cpus) == 2, mine
    nproc0, mem0 = _guest(shim, cid)
    assert nproc0 == 1
    # the headroom's vCPU is present from the start, offline in the guest
    assert _present_vcpus(_live_xml(sid)) == 2

    # within what the VM booted with: nothing is plugged
    shim.runtime.UpdatePodSandboxResources(
        pb.UpdatePodSandboxResourcesRequest(pod_sandbox_id=sid, resources=_linux(90_000, 64)), timeout=60
    )
    assert _guest(shim, cid) == (nproc0, mem0)

    # two CPUs and 160 MiB: one vCPU and one 128 MiB block of the headroom are plugged
    shim.runtime.UpdatePodSandboxResources(
        pb.UpdatePodSandboxResourcesRequest(pod_sandbox_id=sid, resources=_linux(200_000, 160)), timeout=120
    )
    shim.runtime.UpdateContainerResources(
        pb.UpdateContainerResourcesRequest(container_id=cid, linux=_linux(200_000, 160)), timeout=120
    )
    nproc1, mem1 = _guest(shim, cid)
    assert nproc1 == 2 and mem1 >= mem0 + 128 * 1024 * 63 // 64, (nproc1, mem1, mem0)
    cgroup = _run(shim, cid, "cat", "/sys/fs/cgroup/cpu.max", "/sys/fs/cgroup/memory.max").split()
    assert cgroup == ["200000", "100000", str(160 * MI)], cgroup
    assert _info(shim, sid)["growth"] == {"cpu_millis": 1500, "memory_bytes": 96 * MI}

    # down again: the container's limits shrink, what was plugged stays
    shim.runtime.UpdateContainerResources(
        pb.UpdateContainerResourcesRequest(container_id=cid, linux=_linux(50_000, 64)), timeout=60
    )
    shim.runtime.UpdatePodSandboxResources(
        pb.UpdatePodSandboxResourcesRequest(pod_sandbox_id=sid, resources=_linux(50_000, 64)), timeout=60
    )
    assert _guest(shim, cid) == (nproc1, mem1)

    # beyond the headroom: refused, naming what it would need and what the VM can give
    with pytest.raises(grpc.RpcError) as err:
        shim.runtime.UpdatePodSandboxResources(
            pb.UpdatePodSandboxResourcesRequest(pod_sandbox_id=sid, resources=_linux(300_000, 512)), timeout=60
        )
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value.details()
    details = str(err.value.details())
    assert "2 more vCPUs, the VM (1 vCPUs) can grow by 1" in details, details
    assert "resize_headroom" in details, details
    assert _guest(shim, cid) == (nproc1, mem1)
    # no resize took or gave back a claim
    assert claims(shim.state_dir)[sid] == mine


@pytest.mark.parametrize("point", ["hot-plug:after-vcpus", "hot-plug:after-dimm"])
def test_a_shim_killed_during_a_plug_loses_no_claim(tmp_path: Path, point: str) -> None:
    config = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name="plugged", namespace="resize", uid="uid-plugged", attempt=0),
        linux=pb.LinuxPodSandboxConfig(resources=_linux(50_000, 64)),
    )
    shim = start_shim(tmp_path, env={"VMSANDBOX_FAULT": point}, pull_busybox=False)
    sid = ""
    try:
        sid = shim.runtime.RunPodSandbox(
            pb.RunPodSandboxRequest(config=config, runtime_handler=HEADROOM_HANDLER), timeout=300
        ).pod_sandbox_id
        held = claims(shim.state_dir)[sid]
        with pytest.raises(grpc.RpcError) as err:
            shim.runtime.UpdatePodSandboxResources(
                pb.UpdatePodSandboxResourcesRequest(pod_sandbox_id=sid, resources=_linux(200_000, 160)), timeout=120
            )
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        assert shim.process.wait(timeout=60) == -signal.SIGKILL
        assert f"fault injection: SIGKILL at {point}" in shim.log_text()
        stop_shim(shim)
        shim = start_shim(tmp_path, pull_busybox=False)  # the same state, no fault
        # the sandbox is adopted with every claim it held, and the retried resize finishes the plug
        assert claims(shim.state_dir)[sid] == held
        shim.runtime.UpdatePodSandboxResources(
            pb.UpdatePodSandboxResourcesRequest(pod_sandbox_id=sid, resources=_linux(200_000, 160)), timeout=120
        )
        assert _info(shim, sid)["growth"] == {"cpu_millis": 1500, "memory_bytes": 96 * MI}
        live = _live_xml(sid)
        assert read_dimm_kib(live) == 128 * 1024, live  # one DIMM, not two
        # the headroom's vCPU was present from the start and is online now (the guest's report said so)
        assert _present_vcpus(live) == 2, live
        assert "(guest: 2 vCPUs," in shim.log_text()
        assert claims(shim.state_dir)[sid] == held
    finally:
        if sid and shim.process.poll() is None:
            shim.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=120)
            shim.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=120)
        stop_shim(shim)
