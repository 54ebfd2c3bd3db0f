"""The proxy's connection to the downstream runtime: what a caller sees of each way it can fail."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from shim.proxy.downstream import Downstream, DownstreamUnavailable, Forwarded
from shim.proxy.ids import DownstreamIds, list_filter

METHOD = "/runtime.v1.RuntimeService/ExecSync"


class Behaviour:
    def __init__(self) -> None:
        self.mode = "echo"
        self.release = threading.Event()


@pytest.fixture
def downstream(tmp_path: Path) -> Iterator[tuple[Downstream, Behaviour]]:
    behaviour = Behaviour()

    def handle(request: bytes, context: Any) -> bytes:
        if behaviour.mode == "deadline":  # the downstream's own answer, as containerd's ExecSync timeout
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "command timed out")
        if behaviour.mode == "hang":
            behaviour.release.wait(10)
        return request

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "runtime.v1.RuntimeService", {"ExecSync": grpc.unary_unary_rpc_method_handler(handle)}
            ),
        )
    )
    sock = tmp_path / "down.sock"
    server.add_insecure_port(f"unix:{sock}")
    server.start()
    d = Downstream(f"unix://{sock}", timeout_s=0.5, max_calls=2)
    try:
        yield d, behaviour
    finally:
        behaviour.release.set()
        d.close()
        server.stop(0)


def test_bytes_go_and_come_back_unchanged(downstream: tuple[Downstream, Behaviour]) -> None:
    d, _ = downstream
    assert d.call(METHOD, b"\x0a\x01x\xfa\x3e\x00") == b"\x0a\x01x\xfa\x3e\x00"


def test_a_deadline_the_downstream_answers_is_passed_on_as_it_is(downstream: tuple[Downstream, Behaviour]) -> None:
    d, behaviour = downstream
    behaviour.mode = "deadline"
    with pytest.raises(Forwarded) as err:
        d.call(METHOD, b"")
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and err.value.details == "command timed out"


def test_a_hung_downstream_is_unavailable_after_the_cap_naming_the_endpoint(
    downstream: tuple[Downstream, Behaviour],
) -> None:
    d, behaviour = downstream
    behaviour.mode = "hang"
    t0 = time.monotonic()
    with pytest.raises(DownstreamUnavailable) as err:
        d.call(METHOD, b"")
    assert time.monotonic() - t0 < 2
    assert d.endpoint in str(err.value) and "did not answer ExecSync" in str(err.value)


def test_calls_waiting_on_the_downstream_are_bounded(downstream: tuple[Downstream, Behaviour]) -> None:
    d, behaviour = downstream
    behaviour.mode = "hang"
    d.timeout_s = 5
    with futures.ThreadPoolExecutor(2) as pool:
        waiting = [pool.submit(d.call, METHOD, b"") for _ in range(2)]
        time.sleep(0.3)
        t0 = time.monotonic()
        with pytest.raises(DownstreamUnavailable) as err:
            d.call(METHOD, b"")  # the third is refused at once
        assert time.monotonic() - t0 < 0.5 and "2 calls already waiting" in str(err.value)
        behaviour.release.set()
        assert [w.result() for w in waiting] == [b"", b""]


def test_an_absent_downstream_is_unavailable_at_once(tmp_path: Path) -> None:
    d = Downstream(f"unix://{tmp_path / 'nothing.sock'}", timeout_s=30, max_calls=2)
    try:
        t0 = time.monotonic()
        with pytest.raises(DownstreamUnavailable) as err:
            d.call(METHOD, b"")
        assert time.monotonic() - t0 < 2 and str(tmp_path / "nothing.sock") in str(err.value)
    finally:
        d.close()


@pytest.mark.parametrize(
    ("data", "error"),
    [
        ({"downstream_endpoint": "unix:///run/c/containerd.sock"}, None),
        ({"downstream_endpoint": ""}, None),
        ({"downstream_endpoint": "tcp://127.0.0.1:1"}, "downstream_endpoint: must be a unix socket"),
        ({"downstream_endpoint": "/run/c.sock"}, "downstream_endpoint: must be a unix socket"),
        ({"downstream_timeout_s": 2.5}, None),
        ({"downstream_timeout_s": 0}, "downstream_timeout_s: must be a number of seconds"),
        ({"downstream_timeout_s": True}, "downstream_timeout_s: must be a number of seconds"),
    ],
)
def test_downstream_configuration(data: dict[str, object], error: str | None) -> None:
    from shim.config import config_from_mapping
    from vmsandbox.errors import InvalidArgument

    if error is None:
        config = config_from_mapping(data, "/etc/vmsandbox/config.yaml")
        assert config.downstream_endpoint == data.get("downstream_endpoint", "")
        return
    with pytest.raises(InvalidArgument, match=error):
        config_from_mapping(data, "/etc/vmsandbox/config.yaml")


# -- the downstream's last lists, for while it cannot be reached ---------------------------------

UNKNOWN = b"\xfa\x3e\x02hi"  # field 999: no CRI message has it
S1, S2 = "1" * 64, "2" * 64
C1, C2, C3 = "a" * 64, "b" * 64, "c" * 64


def _ids(tmp_path: Path) -> DownstreamIds:
    return DownstreamIds(Downstream(f"unix://{tmp_path / 'none.sock'}", timeout_s=0.5, max_calls=1))


def _with_unknown(message: Any) -> bytes:
    data: bytes = message.SerializeToString() + UNKNOWN
    return data


def _listed(tmp_path: Path) -> DownstreamIds:
    ids = _ids(tmp_path)
    pods = b"".join(
        b"\x0a" + bytes([len(item)]) + item
        for item in (
            _with_unknown(pb.PodSandbox(id=S1, state=pb.SANDBOX_READY, labels={"app": "web"})),
            _with_unknown(pb.PodSandbox(id=S2, state=pb.SANDBOX_NOTREADY)),
        )
    )
    ctrs = pb.ListContainersResponse(
        containers=[
            pb.Container(id=C1, pod_sandbox_id=S1, state=pb.CONTAINER_RUNNING),
            pb.Container(id=C2, pod_sandbox_id=S1, state=pb.CONTAINER_EXITED),
            pb.Container(id=C3, pod_sandbox_id=S2, state=pb.CONTAINER_RUNNING),
        ]
    ).SerializeToString()
    ids.saw_list("ListPodSandbox", pods)
    ids.saw_list("ListContainers", ctrs)
    for sid in (S1, S2):
        ids.learn_sandbox(sid, "")
    for cid, sid in ((C1, S1), (C2, S1), (C3, S2)):
        ids.learn_container(cid, sid)
    return ids


def _pods(data: bytes | None) -> list[str]:
    assert data is not None
    return [p.id for p in pb.ListPodSandboxResponse.FromString(data).items]


def _ctrs(data: bytes | None) -> list[str]:
    assert data is not None
    return [c.id for c in pb.ListContainersResponse.FromString(data).containers]


def test_never_listed_is_none(tmp_path: Path) -> None:
    assert _ids(tmp_path).last_listed("ListPodSandbox", list_filter(pb.PodSandboxFilter())) is None


def test_the_last_list_comes_back_as_the_downstream_sent_it_filtered_like_the_request(tmp_path: Path) -> None:
    ids = _listed(tmp_path)
    everything = ids.last_listed("ListPodSandbox", list_filter(pb.PodSandboxFilter()))
    assert _pods(everything) == [S1, S2]
    assert everything is not None and everything.count(UNKNOWN) == 2  # each item's unknown field kept
    ready = pb.PodSandboxFilter(state=pb.PodSandboxStateValue(state=pb.SANDBOX_READY))
    assert _pods(ids.last_listed("ListPodSandbox", list_filter(ready))) == [S1]
    assert _pods(ids.last_listed("ListPodSandbox", list_filter(pb.PodSandboxFilter(label_selector={"app": "x"})))) == []
    running = pb.ContainerFilter(state=pb.ContainerStateValue(state=pb.CONTAINER_RUNNING))
    assert _ctrs(ids.last_listed("ListContainers", list_filter(running))) == [C1, C3]
    assert _ctrs(ids.last_listed("ListContainers", list_filter(pb.ContainerFilter(pod_sandbox_id="1")))) == [C1, C2]


def test_what_was_removed_through_the_proxy_since_is_left_out_until_listed_again(tmp_path: Path) -> None:
    ids = _listed(tmp_path)
    ids.forget_container(C1)
    ids.forget_sandbox(S2)  # and its container C3
    assert _pods(ids.last_listed("ListPodSandbox", list_filter(pb.PodSandboxFilter()))) == [S1]
    assert _ctrs(ids.last_listed("ListContainers", list_filter(pb.ContainerFilter()))) == [C2]
    # a new list of the sandboxes says what is there now; the containers' list is still the old one
    ids.saw_list("ListPodSandbox", pb.ListPodSandboxResponse(items=[pb.PodSandbox(id=S2)]).SerializeToString())
    assert _pods(ids.last_listed("ListPodSandbox", list_filter(pb.PodSandboxFilter()))) == [S2]
    assert _ctrs(ids.last_listed("ListContainers", list_filter(pb.ContainerFilter()))) == [C2]
