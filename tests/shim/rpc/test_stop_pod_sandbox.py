"""StopPodSandbox (``shim.rpc.stop_pod_sandbox``) through the real gRPC server in process, on a pod
that RunPodSandbox made (``tests/cri_server.py``, its guest faked by ``booting``).

A stop has nothing to undo: each step only lets go. So a fault injected after any of its steps
leaves a sandbox that the same RPC, called again, finishes: StopPodSandbox is idempotent (unknown
ids and repeats succeed, and each step finds what is gone already and goes on), as the kubelet
relies on when it calls it until it succeeds. After the retry the pod is NOTREADY with its
containers EXITED and holds nothing: no domain, claim or node port; and RemovePodSandbox then
leaves nothing and frees its name.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from shim import faults, rpc
from shim.model import CONTAINER_CREATED, CONTAINER_EXITED, SANDBOX_NOTREADY, ContainerRecord
from shim.rpc.stop_pod_sandbox import RPC
from tests.cri_server import Server, assert_no_leak, booting, cri_server
from tests.ports import quiet_port
from tests.shim.rpc.test_run_pod_sandbox import (
    assert_left_nothing,
    host_network_pod,
    pods_of,
    remove,
    run,
)

pytest.importorskip("libvirt")


@pytest.fixture
def server() -> Iterator[Server]:
    with cri_server() as s, booting(s):
        yield s


def running_pod(server: Server, port: int) -> tuple[str, str]:
    """A READY host-network pod with a node port and a created container: (sandbox id, container id)."""
    sandbox_id = run(server, host_network_pod(port))
    container = ContainerRecord(
        id="5c" * 32, sandbox_id=sandbox_id, name="app", attempt=0, state=CONTAINER_CREATED, created_ns=1
    )
    server.sandboxes.records.save_container(container)
    return sandbox_id, container.id


def assert_stopped(server: Server, sandbox_id: str, container_id: str) -> None:
    sb = server.sandboxes
    assert sb.records.get(sandbox_id).state == SANDBOX_NOTREADY
    assert sb.records.container(container_id).state == CONTAINER_EXITED
    assert sandbox_id not in sb.ledger.claim_owners()
    assert sandbox_id not in {d.sandbox_id for d in sb.hypervisor.list_ours()}
    assert_no_leak(sb, pods_of(server))  # its node port closed, nothing in flight


@pytest.mark.parametrize("point", rpc.rpc_points(RPC))
def test_a_stop_that_failed_after_any_step_is_finished_by_the_next(server: Server, point: str) -> None:
    port = quiet_port()
    sandbox_id, container_id = running_pod(server, port)
    request = pb.StopPodSandboxRequest(pod_sandbox_id=sandbox_id)
    with faults.raising(point):
        code, details, _ = server.rpc("StopPodSandbox", request)
    assert code == grpc.StatusCode.UNAVAILABLE and f"fault injected at {point}" in details, details

    code, details, _ = server.rpc("StopPodSandbox", request)
    assert code == grpc.StatusCode.OK, details
    assert_stopped(server, sandbox_id, container_id)
    code, details, _ = server.rpc("StopPodSandbox", request)  # and once more: nothing changes
    assert code == grpc.StatusCode.OK, details
    assert_stopped(server, sandbox_id, container_id)

    remove(server, sandbox_id)
    assert_left_nothing(server, port)
    remove(server, run(server, host_network_pod(port)))  # the name is free
    assert_left_nothing(server, port)
