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

from shim.proxy.downstream import Downstream, DownstreamUnavailable, Forwarded

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
