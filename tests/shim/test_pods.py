"""``shim.pods``: list filters, and what it answers of sandboxes (the RPCs' steps and their
rollback: ``tests/shim/rpc/``).

The tests use the production owners over a real ledger and libvirt's test driver
(``tests/cri_server.py``), with the seeded READY sandboxes a successful boot would have left.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from shim.model import (
    CONTAINER_CREATED,
    CONTAINER_EXITED,
    SANDBOX_NOTREADY,
    SANDBOX_READY,
    ContainerFilter,
    ContainerRecord,
    PodMeta,
    RemovePodSandbox,
    SandboxFilter,
    SandboxRecord,
    StopPodSandbox,
)
from shim.pods import Pods
from shim.rpc.remove_pod_sandbox import remove_pod_sandbox
from shim.rpc.stop_pod_sandbox import stop_pod_sandbox
from shim.translate import inbound
from tests.cri_server import SEED_CONTAINER, SEED_SANDBOXES, Server, cri_server
from vmsandbox.errors import InvalidArgument

_POD = SandboxRecord(
    id="ab" * 32,
    meta=PodMeta("web", "default", "u"),
    state=SANDBOX_READY,
    created_ns=1,
    runtime_handler="vmsandbox",
    profile="vmsandbox",
    domain="vmsandbox-abab",
    labels={"app": "web"},
)
_NOTREADY = pb.PodSandboxStateValue(state=pb.SANDBOX_NOTREADY)
_EXITED = pb.ContainerStateValue(state=pb.CONTAINER_EXITED)
_CONTAINER = ContainerRecord(
    id="cd" * 32,
    sandbox_id=_POD.id,
    name="app",
    attempt=0,
    state=CONTAINER_CREATED,
    created_ns=1,
    labels={"tier": "front"},
)


@pytest.mark.parametrize(
    ("f", "matches"),
    [
        (SandboxFilter(), True),
        (SandboxFilter(id_prefix="abab"), True),
        (SandboxFilter(id_prefix="ac"), False),
        (SandboxFilter(state=SANDBOX_READY), True),
        (SandboxFilter(state=SANDBOX_NOTREADY), False),
        (SandboxFilter(state="undefined state 7"), False),
        (SandboxFilter(labels={"app": "web"}), True),
        (SandboxFilter(labels={"app": "web", "x": ""}), False),
        (SandboxFilter(labels={"app": "db"}), False),
    ],
)
def test_sandbox_filter(f: SandboxFilter, matches: bool) -> None:
    assert f.matches(_POD) is matches


@pytest.mark.parametrize(
    ("f", "identity", "state"),
    [
        (ContainerFilter(), True, True),
        (ContainerFilter(id_prefix="cdcd"), True, True),
        (ContainerFilter(id_prefix="dc"), False, True),
        (ContainerFilter(labels={"tier": "front"}), True, True),
        (ContainerFilter(labels={"tier": "back"}), False, True),
        (ContainerFilter(state=CONTAINER_CREATED), True, True),
        (ContainerFilter(state=CONTAINER_EXITED), True, False),
    ],
)
def test_container_filter(f: ContainerFilter, identity: bool, state: bool) -> None:
    assert (f.matches_identity(_CONTAINER), f.matches_state(_CONTAINER)) == (identity, state)


@pytest.mark.parametrize(
    ("request_filter", "expected"),
    [
        (pb.PodSandboxFilter(), SandboxFilter()),
        (pb.PodSandboxFilter(id="ab", label_selector={"a": "b"}), SandboxFilter("ab", None, {"a": "b"})),
        (pb.PodSandboxFilter(state=_NOTREADY), SandboxFilter("", SANDBOX_NOTREADY)),
        (pb.PodSandboxFilter(state=pb.PodSandboxStateValue(state=9)), SandboxFilter("", "undefined state 9")),  # type: ignore[arg-type]
        (pb.PodSandboxStatsFilter(id="ab"), SandboxFilter("ab")),
    ],
)  # fmt: skip
def test_sandbox_filter_from_the_wire(
    request_filter: pb.PodSandboxFilter | pb.PodSandboxStatsFilter, expected: SandboxFilter
) -> None:
    assert inbound.sandbox_filter(request_filter) == expected


@pytest.mark.parametrize(
    ("request_filter", "expected"),
    [
        (pb.ContainerFilter(pod_sandbox_id="ab"), ContainerFilter(sandbox_id="ab")),
        (pb.ContainerFilter(state=_EXITED), ContainerFilter(state=CONTAINER_EXITED)),
        (pb.ContainerStatsFilter(id="cd", label_selector={"a": "b"}), ContainerFilter("cd", "", None, {"a": "b"})),
    ],
)  # fmt: skip
def test_container_filter_from_the_wire(
    request_filter: pb.ContainerFilter | pb.ContainerStatsFilter, expected: ContainerFilter
) -> None:
    assert inbound.container_filter(request_filter) == expected


@pytest.fixture
def server() -> Iterator[Server]:
    with cri_server() as s:
        yield s


def test_teardown_of_unknown_ids_succeeds_and_bad_input_is_refused(server: Server) -> None:
    assert server.containers is not None
    pods = Pods(server.sandboxes, server.containers)
    stop_pod_sandbox(pods, StopPodSandbox("f" * 64))
    remove_pod_sandbox(pods, RemovePodSandbox("f" * 64))
    with pytest.raises(InvalidArgument):
        pods.exec_sync(SEED_CONTAINER, ["true"], -1)


def test_pods_whose_guests_give_no_valid_answer_are_listed_without_usage(server: Server) -> None:
    """One guest that does not answer (here: none of the seeded pods has one) must not fail the
    node's stats lists: the kubelet's eviction and summary API read them for every pod."""
    running = replace(
        ContainerRecord(
            id="ef" * 32, sandbox_id=SEED_SANDBOXES[1], name="web", attempt=0, state=CONTAINER_CREATED, created_ns=2
        ),
        state="CONTAINER_RUNNING",
        image_id="sha256:" + "0" * 64,
    )
    server.sandboxes.records.save_container(running)
    code, details, body = server.rpc("ListPodSandboxStats", pb.ListPodSandboxStatsRequest())
    assert code.name == "OK", details
    stats = pb.ListPodSandboxStatsResponse.FromString(body).stats
    assert {s.attributes.id for s in stats} == set(SEED_SANDBOXES)
    assert all(not s.linux.HasField("cpu") for s in stats)
    code, details, body = server.rpc("ListContainerStats", pb.ListContainerStatsRequest())
    assert code.name == "OK", details
    assert [s.attributes.id for s in pb.ListContainerStatsResponse.FromString(body).stats] == [running.id]
