"""A guest killed from outside makes its sandbox NOTREADY promptly (libvirt lifecycle events), its
containers EXITED with the cause, further containers refused; StopPodSandbox then releases what it
held. And a second RunPodSandbox for the same pod metadata is refused, naming the first sandbox."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import grpc
import libvirt
import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from tests.shim_kit import LIBVIRT_URI, Shim, container, hugepages_free, pod, q

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.exclusive]


def _qemu_pid(sandbox_id: str) -> int:
    conn = libvirt.open(LIBVIRT_URI)
    try:
        for dom in conn.listAllDomains(0):
            if dom.isActive() and sandbox_id[:32] in dom.name():
                return int(Path(f"/run/libvirt/qemu/{dom.name()}.pid").read_text())
    finally:
        conn.close()
    raise AssertionError(f"no running domain for sandbox {sandbox_id[:12]}")


def _state(shim: Shim, sandbox_id: str) -> int:
    req = pb.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id)
    return int(shim.runtime.PodSandboxStatus(req, timeout=30).status.state)


def test_killed_guest_turns_sandbox_notready_and_stop_releases_it(shim: Shim) -> None:
    free_before = hugepages_free()
    config = pod("doomed", containers=[("app", q({"cpu": "1", "memory": "64Mi"}))])
    sid = shim.runtime.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=300).pod_sandbox_id
    cid = shim.runtime.CreateContainer(
        pb.CreateContainerRequest(
            pod_sandbox_id=sid, config=container("app", q({"cpu": "1", "memory": "64Mi"})), sandbox_config=config
        ),
        timeout=30,
    ).container_id
    assert hugepages_free() < free_before

    os.kill(_qemu_pid(sid), signal.SIGKILL)
    deadline = time.monotonic() + 15
    while _state(shim, sid) != pb.SANDBOX_NOTREADY:
        assert time.monotonic() < deadline, "the sandbox stayed READY after its QEMU was killed"
        time.sleep(0.2)

    status = shim.runtime.ContainerStatus(pb.ContainerStatusRequest(container_id=cid), timeout=30).status
    assert status.state == pb.CONTAINER_EXITED
    assert status.reason == "SandboxDied"
    with pytest.raises(grpc.RpcError) as err:
        shim.runtime.CreateContainer(
            pb.CreateContainerRequest(
                pod_sandbox_id=sid,
                config=container("app", q({"cpu": "1", "memory": "64Mi"}), attempt=1),
                sandbox_config=config,
            ),
            timeout=30,
        )
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION

    shim.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=120)
    shim.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=120)
    assert hugepages_free() == free_before
    assert "is NOTREADY" in shim.log_text()


def test_second_sandbox_for_the_same_pod_is_refused_until_the_first_is_removed(shim: Shim) -> None:
    config = pod("twice")
    first = shim.runtime.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=300).pod_sandbox_id
    try:
        with pytest.raises(grpc.RpcError) as err:
            shim.runtime.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=300)
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert first in (err.value.details() or "")
        # still refused once stopped: the name is held until RemovePodSandbox, as containerd holds it
        shim.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=first), timeout=120)
        with pytest.raises(grpc.RpcError) as err:
            shim.runtime.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=300)
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    finally:
        shim.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=first), timeout=120)
        shim.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=first), timeout=120)
    again = shim.runtime.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=300).pod_sandbox_id
    assert again != first
    shim.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=again), timeout=120)
    shim.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=again), timeout=120)
