"""UpdatePodSandboxResources (``shim.rpc.update_pod_sandbox_resources``) through the real gRPC server
in process (``tests/cri_server.py``), on a seeded READY sandbox (256 MiB).

A fault injected after any of its steps puts back the resources the record held before; the same
update then goes through. One that does not fit the VM is refused and changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from shim import faults, rpc
from shim.rpc.update_pod_sandbox_resources import RPC
from tests.cri_server import SEED_SANDBOXES, Server, cri_server

SANDBOX = SEED_SANDBOXES[0]
MI = 1 << 20


@pytest.fixture
def server() -> Iterator[Server]:
    with cri_server() as s:
        yield s


def update(server: Server, memory_bytes: int) -> tuple[grpc.StatusCode, str]:
    request = pb.UpdatePodSandboxResourcesRequest(
        pod_sandbox_id=SANDBOX[:12],
        resources=pb.LinuxContainerResources(cpu_period=100_000, cpu_quota=50_000, memory_limit_in_bytes=memory_bytes),
    )
    code, details, _ = server.rpc("UpdatePodSandboxResources", request)
    return code, details


def recorded(server: Server) -> int:
    return server.sandboxes.records.get(SANDBOX).updated_resources.memory_limit_bytes


@pytest.mark.parametrize("point", rpc.rpc_points(RPC))
def test_a_fault_after_any_step_puts_the_resources_back(server: Server, point: str) -> None:
    assert update(server, 64 * MI) == (grpc.StatusCode.OK, "")
    with faults.raising(point):
        code, details = update(server, 128 * MI)
    assert code == grpc.StatusCode.UNAVAILABLE and f"fault injected at {point}" in details, details
    assert recorded(server) == 64 * MI
    assert server.sandboxes.records.get(SANDBOX).state == "SANDBOX_READY"  # the rest of the record as it was
    assert update(server, 128 * MI) == (grpc.StatusCode.OK, "")
    assert recorded(server) == 128 * MI


def test_an_update_beyond_the_vm_is_refused_and_changes_nothing(server: Server) -> None:
    assert update(server, 128 * MI) == (grpc.StatusCode.OK, "")
    code, details = update(server, 512 * MI)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "the pod's new resources" in details, details
    assert recorded(server) == 128 * MI


@pytest.mark.parametrize("given", ["", "x\x00", "ff"])
def test_the_id_is_checked_before_anything_is_read(server: Server, given: str) -> None:
    request = pb.UpdatePodSandboxResourcesRequest(pod_sandbox_id=given)
    code, details, _ = server.rpc("UpdatePodSandboxResources", request)
    assert code == (grpc.StatusCode.NOT_FOUND if given == "ff" else grpc.StatusCode.INVALID_ARGUMENT), details
    assert "pod_sandbox_id" in details or given == "ff"
