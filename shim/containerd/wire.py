"""What shim mode's ttrpc services and its launcher share at the wire's edge: a method's handler
from a typed function, containerd's timestamps, and where each runtime handler is served."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from google.protobuf import any_pb2, timestamp_pb2
from google.protobuf.message import DecodeError, Message

from gen.containerd.cgroups.v2 import metrics_pb2
from vmsandbox import validation
from vmsandbox.agent_ops import CgroupStats
from vmsandbox.errors import InvalidArgument

Handler = Callable[[bytes], bytes]


def handler(request_type: type[Message], method: Callable[[Any], Message]) -> Handler:
    """The ttrpc handler of ``method``: its request decoded (INVALID_ARGUMENT when it is no
    ``request_type``), its reply encoded."""

    def handle(payload: bytes) -> bytes:
        request = request_type()
        try:
            request.ParseFromString(payload)
        except DecodeError as exc:
            raise InvalidArgument(f"{request_type.__name__}: {exc}") from None
        return method(request).SerializeToString()

    return handle


def timestamp(ns: int) -> timestamp_pb2.Timestamp:
    t = timestamp_pb2.Timestamp()
    t.FromNanoseconds(ns)
    return t


def handler_socket(shim_dir: str, runtime_handler: str) -> Path:
    """Where shim mode serves ``runtime_handler`` (the launcher answers containerd with it)."""
    validation.dns1123_label(runtime_handler, "runtime handler")
    return Path(shim_dir) / f"{runtime_handler}.sock"


def cgroup_metrics(sample: CgroupStats | None) -> any_pb2.Any:
    """A guest cgroup's usage as containerd reads a runtime's metrics (cgroup v2's ``Metrics``:
    containerd takes the working set as ``usage`` less ``inactive_file``); empty without a sample."""
    m = metrics_pb2.Metrics()
    if sample is not None:
        m.cpu.usage_usec = sample.cpu_usage_ns // 1000
        m.memory.usage = sample.memory_usage_bytes
        m.memory.inactive_file = max(0, sample.memory_usage_bytes - sample.memory_working_set_bytes)
        m.memory.anon = sample.memory_rss_bytes
        m.memory.pgfault = sample.page_faults
        m.memory.pgmajfault = sample.major_page_faults
        m.pids.current = sample.pids
        if sample.oom_kills is not None:
            m.memory_events.oom_kill = sample.oom_kills
    return any_pb2.Any(type_url=m.DESCRIPTOR.full_name, value=m.SerializeToString())
