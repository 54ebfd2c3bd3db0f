"""Every CRI RPC, fed arbitrary messages built from the message definitions, through the real gRPC server.

The server is the production one (``RuntimeServicer`` and ``ImageServicer`` over ``Sandboxes``) on a
unix socket, with a real ledger and libvirt's ``test:///default`` driver, sized from a fixture sysfs
tree. Requests are built by hypothesis from each method's input descriptor (the descriptors match
upstream cri-api field for field: tests/gen/test_proto_contract.py), with strings drawn from both
near-valid values (names, ids and id prefixes of live sandboxes, quantities) and hostile ones
(controls, NUL, U+FFFE, huge), enum numbers outside the enum, and unknown fields of every wire type
appended to the encoded request; some requests are then truncated or have a byte overwritten (bad
tags, lengths, non-UTF-8 strings). Sent as raw bytes, as a peer would.

After every request: the status is never INTERNAL or UNKNOWN, the server still answers, no row is
left half-made, and every claim and every libvirt domain belongs to a live sandbox.

``VMSANDBOX_FUZZ_EXAMPLES`` sets the examples per RPC (default 50: about 2,200 in all, ~10 s);
``VMSANDBOX_FUZZ_LONG=1`` adds the ``slow`` variant, ten times as many.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any, cast

import grpc
import pytest
from google.protobuf import descriptor as _descriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gen.cri.runtime.v1 import api_pb2 as pb
from tests.cri_server import SEED_CONTAINER, SEED_SANDBOXES, Server, assert_no_leak, cri_server, seed

libvirt = pytest.importorskip("libvirt")

EXAMPLES = int(os.environ.get("VMSANDBOX_FUZZ_EXAMPLES", "50"))
FD = _descriptor.FieldDescriptor


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with cri_server() as s:
        yield s


# -- requests from descriptors ---------------------------------------------------------------------
def _near_valid() -> st.SearchStrategy[str]:
    ids = [*SEED_SANDBOXES, SEED_CONTAINER]
    return st.one_of(
        st.sampled_from(ids),
        st.sampled_from(ids).flatmap(lambda i: st.integers(1, 64).map(lambda n: i[:n])),
        st.sampled_from(
            ["app", "web", "default", "kube-system", "vmsandbox", "2MB", "1GB", "0KB", "64Mi", "500m", "1"]
        ),
        st.sampled_from(["cpu", "memory", "hugepages-2Mi", "/dev/kvm", "/dev/vfio/3", "/dev/vfio/\u00b2"]),
        st.sampled_from(["app.log", "../x.log", "/var/log/pods/x", "0" * 64, "../../etc/x", "/tmp/x.log"]),
        st.from_regex(r"[a-z0-9]([-a-z0-9]{0,20}[a-z0-9])?", fullmatch=True),
    )


def _hostile() -> st.SearchStrategy[str]:
    return st.one_of(
        st.text(max_size=40),
        st.text(alphabet=st.sampled_from("\x00\n\r\t\x1b\x7f\x85\u2028\ufffe\uffff/.a-0_"), max_size=24),
        st.integers(1000, 70_000).map(lambda n: "x" * n),
        st.text(alphabet=st.characters(codec="utf-8", categories=["Nd", "No"]), min_size=1, max_size=6),
    )


STRINGS = st.one_of(_near_valid(), _hostile())
BYTES = st.one_of(st.binary(max_size=32), STRINGS.map(lambda s: s.encode("utf-8", "surrogatepass")))

_INT_RANGES = {
    FD.TYPE_INT32: (-(2**31), 2**31 - 1),
    FD.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FD.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FD.TYPE_INT64: (-(2**63), 2**63 - 1),
    FD.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FD.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FD.TYPE_UINT32: (0, 2**32 - 1),
    FD.TYPE_FIXED32: (0, 2**32 - 1),
    FD.TYPE_UINT64: (0, 2**64 - 1),
    FD.TYPE_FIXED64: (0, 2**64 - 1),
}


def _scalar(fd: Any) -> st.SearchStrategy[Any]:
    if fd.type == FD.TYPE_STRING:
        return STRINGS
    if fd.type == FD.TYPE_BYTES:
        return BYTES
    if fd.type == FD.TYPE_BOOL:
        return st.booleans()
    if fd.type in (FD.TYPE_DOUBLE, FD.TYPE_FLOAT):
        return st.floats(width=32 if fd.type == FD.TYPE_FLOAT else 64)
    if fd.type == FD.TYPE_ENUM:
        known = [v.number for v in fd.enum_type.values]
        return st.one_of(st.sampled_from(known), st.integers(-(2**31), 2**31 - 1))
    lo, hi = _INT_RANGES[fd.type]
    return st.one_of(st.integers(-1, 3).filter(lambda v: lo <= v <= hi), st.integers(lo, hi))


def _fill(data: st.DataObject, msg: Message, depth: int, sparse: int = 2) -> None:
    """Set a random subset of ``msg``'s fields (each with probability 1/``sparse``), recursively."""
    for fd in msg.DESCRIPTOR.fields:
        if data.draw(st.integers(0, sparse - 1)):
            continue
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            key_fd, value_fd = fd.message_type.fields_by_name["key"], fd.message_type.fields_by_name["value"]
            target = getattr(msg, fd.name)
            for _ in range(data.draw(st.integers(0, 3))):
                key = data.draw(_scalar(key_fd))
                if value_fd.message_type is not None:
                    if depth > 0:
                        _fill(data, target[key], depth - 1, sparse)
                    else:
                        target[key].SetInParent()
                else:
                    target[key] = data.draw(_scalar(value_fd))
        elif fd.message_type is not None:
            if depth <= 0:
                continue
            if fd.is_repeated:
                for _ in range(data.draw(st.integers(0, 2))):
                    _fill(data, getattr(msg, fd.name).add(), depth - 1, sparse)
            else:
                child = getattr(msg, fd.name)
                child.SetInParent()
                _fill(data, child, depth - 1, sparse)
        elif fd.is_repeated:
            getattr(msg, fd.name).extend(data.draw(st.lists(_scalar(fd), max_size=3)))
        else:
            setattr(msg, fd.name, data.draw(_scalar(fd)))


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


@st.composite
def _unknown_fields(draw: Callable[..., Any]) -> bytes:
    out = b""
    for _ in range(draw(st.integers(0, 3))):
        number = draw(st.integers(1000, 536_870_911))
        kind = draw(st.sampled_from([0, 1, 2, 5]))
        out += _varint(number << 3 | kind)
        if kind == 0:
            out += _varint(draw(st.integers(0, 2**64 - 1)))
        elif kind == 1:
            out += draw(st.binary(min_size=8, max_size=8))
        elif kind == 5:
            out += draw(st.binary(min_size=4, max_size=4))
        else:
            payload = draw(st.binary(max_size=16))
            out += _varint(len(payload)) + payload
    return out


def _valid_base(data: st.DataObject, msg: Message) -> None:
    """A request that would pass validation: what a kubelet sends, to be mutated from."""
    if isinstance(msg, pb.RunPodSandboxRequest):
        msg.config.metadata.name = "fuzz"
        msg.config.metadata.namespace = "default"
        msg.config.metadata.uid = "0d3c8f9e-uid"
        msg.config.log_directory = "/var/log/pods/default_fuzz_uid"
        msg.config.labels["app"] = "fuzz"
    elif isinstance(msg, pb.CreateContainerRequest):
        msg.config.metadata.name = data.draw(st.sampled_from(["app", "side", "init"]))
        msg.config.image.image = "busybox"
        msg.config.log_path = "app/0.log"
    names = {f.name for f in msg.DESCRIPTOR.fields}
    if "pod_sandbox_id" in names:
        sid = data.draw(st.sampled_from(SEED_SANDBOXES))
        cast(Any, msg).pod_sandbox_id = sid[: data.draw(st.integers(1, 64))]
    if "container_id" in names:
        cast(Any, msg).container_id = SEED_CONTAINER[: data.draw(st.integers(1, 64))]


def _request(data: st.DataObject, method: _descriptor.MethodDescriptor) -> bytes:
    cls = pb.__dict__.get(method.input_type.name)
    assert cls is not None, method.input_type.full_name
    msg = cls()
    if data.draw(st.booleans()):  # a kubelet-like request with a few fields changed
        _valid_base(data, msg)
        _fill(data, msg, depth=data.draw(st.integers(1, 5)), sparse=8)
    else:
        _fill(data, msg, depth=data.draw(st.integers(1, 5)))
    body = bytes(msg.SerializeToString()) + data.draw(_unknown_fields())
    damage = data.draw(st.integers(0, 9))
    if damage == 0 and body:  # a truncated request
        body = body[: data.draw(st.integers(0, len(body) - 1))]
    elif damage == 1 and body:  # a byte overwritten: a bad tag, length or UTF-8
        at = data.draw(st.integers(0, len(body) - 1))
        body = body[:at] + bytes([data.draw(st.integers(0, 255))]) + body[at + 1 :]
    return body


METHODS = [m for s in pb.DESCRIPTOR.services_by_name.values() for m in s.methods]


def _fuzz(server: Server, method: _descriptor.MethodDescriptor, examples: int) -> None:
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        server.call(method, _request(data, method))
        assert_no_leak(server.sandboxes)

    run()
    # still serving, and the seeded sandboxes that nothing removed still answer
    assert server.call(pb.DESCRIPTOR.services_by_name["RuntimeService"].methods_by_name["Version"], b"") == (
        grpc.StatusCode.OK
    )


@pytest.mark.parametrize("method", METHODS, ids=[m.name for m in METHODS])
def test_no_internal_for_any_request(server: Server, method: _descriptor.MethodDescriptor) -> None:
    seed(server.sandboxes)
    _fuzz(server, method, EXAMPLES)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("VMSANDBOX_FUZZ_LONG"), reason="set VMSANDBOX_FUZZ_LONG=1 for the long run")
@pytest.mark.parametrize("method", METHODS, ids=[m.name for m in METHODS])
def test_no_internal_for_any_request_long(server: Server, method: _descriptor.MethodDescriptor) -> None:
    seed(server.sandboxes)
    _fuzz(server, method, EXAMPLES * 10)


def test_every_rpc_is_fuzzed() -> None:
    served = {f"{s.name}/{m.name}" for s in pb.DESCRIPTOR.services_by_name.values() for m in s.methods}
    assert {f"{m.containing_service.name}/{m.name}" for m in METHODS} == served
    assert len(METHODS) * EXAMPLES >= 2000 or "VMSANDBOX_FUZZ_EXAMPLES" in os.environ


def test_a_kubelet_like_run_goes_deep_and_rolls_back(server: Server) -> None:
    """The base the fuzzer mutates passes validation, claims, defines and starts a domain on the test
    driver, then fails for want of a guest and rolls back: the fuzzer's requests reach the bottom."""
    msg = pb.RunPodSandboxRequest()
    msg.config.metadata.name = "deep"
    msg.config.metadata.namespace = "default"
    msg.config.metadata.uid = "uid-deep"
    code, details, _ = server.rpc("RunPodSandbox", msg)
    assert code == grpc.StatusCode.UNAVAILABLE, details
    assert "rolled back" in details
    assert_no_leak(server.sandboxes)
