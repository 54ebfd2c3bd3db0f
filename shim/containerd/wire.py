"""What shim mode's ttrpc services and its launcher share at the wire's edge: a method's handler
from a typed function, containerd's timestamps, and where each runtime handler is served."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from google.protobuf import timestamp_pb2
from google.protobuf.message import DecodeError, Message

from vmsandbox import validation
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
