"""RemovePodSandbox (``shim.rpc.remove_pod_sandbox``) through the real gRPC server in process, on a
pod that RunPodSandbox made (``tests/cri_server.py``, its guest faked by ``booting``), running or
stopped first.

A removal has nothing to undo: each step only lets go. So a fault injected after any of its steps
(the stop's first) leaves a sandbox that the same RPC, called again, finishes: RemovePodSandbox is
idempotent (unknown ids and repeats succeed; the row goes last, so a retry still finds the
sandbox). After the retry nothing of the pod is left, no row, container row, claim, domain,
sandbox directory, console log or node port, and its name is free: the same pod runs again.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from shim import faults, rpc
from shim.rpc.remove_pod_sandbox import RPC
from tests.cri_server import Server, booting, cri_server
from tests.ports import quiet_port
from tests.shim.rpc.test_run_pod_sandbox import assert_left_nothing, host_network_pod, remove, run
from tests.shim.rpc.test_stop_pod_sandbox import running_pod

pytest.importorskip("libvirt")


@pytest.fixture
def server() -> Iterator[Server]:
    with cri_server() as s, booting(s):
        yield s


@pytest.mark.parametrize("stopped", [False, True], ids=["running", "stopped"])
@pytest.mark.parametrize("point", rpc.rpc_points(RPC))
def test_a_removal_that_failed_after_any_step_is_finished_by_the_next(
    server: Server, point: str, stopped: bool
) -> None:
    port = quiet_port()
    sandbox_id, container_id = running_pod(server, port)
    if stopped:
        code, details, _ = server.rpc("StopPodSandbox", pb.StopPodSandboxRequest(pod_sandbox_id=sandbox_id))
        assert code == grpc.StatusCode.OK, details
    console = Path(server.sandboxes.config.console_dir) / f"{sandbox_id}.log"
    console.write_text("the guest's console")  # QEMU's, which the test driver does not write
    request = pb.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id)
    with faults.raising(point):
        code, details, _ = server.rpc("RemovePodSandbox", request)
    assert code == grpc.StatusCode.UNAVAILABLE and f"fault injected at {point}" in details, details

    code, details, _ = server.rpc("RemovePodSandbox", request)
    assert code == grpc.StatusCode.OK, details
    sb = server.sandboxes
    assert sb.records.find(sandbox_id) is None
    assert sb.records.containers(sandbox_id) == [] and sb.ledger.containers(sandbox_id) == []
    assert container_id not in sb.records.container_ids_with_prefix(container_id[:8])
    assert not console.exists()
    assert not (sb.dirs.root / sandbox_id).exists()
    assert_left_nothing(server, port)
    code, details, _ = server.rpc("RemovePodSandbox", request)  # and once more: nothing to do
    assert code == grpc.StatusCode.OK, details

    remove(server, run(server, host_network_pod(port)))  # the name is free
    assert_left_nothing(server, port)
