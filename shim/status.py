"""Errors to gRPC status codes, in one place; servicer methods never leak a traceback.

``rpc`` wraps a servicer method: a core error aborts with its code and message; anything else
is logged with its traceback and answered INTERNAL with a one-line cause. Every message a client
sees is escaped and bounded (``vmsandbox.validation.bound``): an echoed input can never make it
larger than the transport accepts.

``add_servicer`` registers a servicer with request decoding that cannot fail: bytes that are no
valid message (a truncated field, non-UTF-8 in a ``string``) reach the method as ``Undecodable``,
which ``rpc`` answers INVALID_ARGUMENT (gRPC's own decoding would answer INTERNAL).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from google.protobuf import descriptor as _descriptor
from google.protobuf import message_factory
from google.protobuf.message import DecodeError

from shim import logs, metrics
from vmsandbox import validation
from vmsandbox.errors import (
    AlreadyExists,
    CannotFit,
    DeadlineExceeded,
    Diverged,
    InfrastructureError,
    InternalError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unauthenticated,
    Unsupported,
    VmSandboxError,
    WrongState,
)

log = logging.getLogger(__name__)

CODES: dict[type[VmSandboxError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    Diverged: grpc.StatusCode.FAILED_PRECONDITION,
    CannotFit: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    InfrastructureError: grpc.StatusCode.UNAVAILABLE,
    InternalError: grpc.StatusCode.INTERNAL,
    WrongState: grpc.StatusCode.FAILED_PRECONDITION,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    Unsupported: grpc.StatusCode.UNIMPLEMENTED,
}


def code_for(exc: BaseException) -> grpc.StatusCode:
    if isinstance(exc, NotImplementedError):
        return grpc.StatusCode.UNIMPLEMENTED
    for cls in type(exc).__mro__:
        if cls in CODES:
            return CODES[cls]
    return grpc.StatusCode.INTERNAL


F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Undecodable:
    """Request bytes that do not decode as the method's message type."""

    type_name: str
    error: str

    def message(self) -> str:
        return f"the request is not a valid {self.type_name}: {self.error}"


def lenient(cls: Any) -> Callable[[bytes], Any]:
    def decode(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except (DecodeError, UnicodeDecodeError, ValueError) as exc:
            return Undecodable(cls.DESCRIPTOR.full_name, str(exc) or type(exc).__name__)

    return decode


def add_servicer(server: grpc.Server, service: _descriptor.ServiceDescriptor, servicer: Any) -> None:
    """Serve every method of ``service`` (unary or server-streaming) from ``servicer``'s same-named method."""
    handlers = {}
    for method in service.methods:
        request = message_factory.GetMessageClass(method.input_type)
        response = message_factory.GetMessageClass(method.output_type)
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=lenient(request),
            response_serializer=response.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


def rpc(method: F) -> F:
    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        with logs.scope():  # lines logged during this call carry the pod the orchestrator binds
            if isinstance(request, Undecodable):
                metrics.rejected(method.__name__, grpc.StatusCode.INVALID_ARGUMENT.name)
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, validation.bound(request.message()))
            try:
                return method(self, request, context)
            except (VmSandboxError, NotImplementedError) as exc:
                code = code_for(exc)
                message = validation.bound(str(exc) or method.__name__)
                log.info("%s -> %s: %s", method.__name__, code.name, message)
                metrics.rejected(method.__name__, code.name)
                context.abort(code, message)
            except Exception as exc:
                log.exception("%s failed", method.__name__)
                metrics.rejected(method.__name__, grpc.StatusCode.INTERNAL.name)
                context.abort(
                    grpc.StatusCode.INTERNAL,
                    validation.bound(f"{method.__name__}: internal error: {type(exc).__name__}: {exc}"),
                )

    return wrapper  # type: ignore[return-value]
