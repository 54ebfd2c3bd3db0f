"""Errors to gRPC status codes, in one place; servicer methods never leak a traceback.

``rpc`` wraps a servicer method: a core error aborts with its code and message; anything else
is logged with its traceback and answered INTERNAL with a one-line cause.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from shim import logs, metrics
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
}


def code_for(exc: BaseException) -> grpc.StatusCode:
    if isinstance(exc, NotImplementedError):
        return grpc.StatusCode.UNIMPLEMENTED
    for cls in type(exc).__mro__:
        if cls in CODES:
            return CODES[cls]
    return grpc.StatusCode.INTERNAL


F = TypeVar("F", bound=Callable[..., Any])


def rpc(method: F) -> F:
    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        with logs.scope():  # lines logged during this call carry the pod the orchestrator binds
            try:
                return method(self, request, context)
            except (VmSandboxError, NotImplementedError) as exc:
                code = code_for(exc)
                log.info("%s -> %s: %s", method.__name__, code.name, exc)
                metrics.rejected(method.__name__, code.name)
                context.abort(code, str(exc) or method.__name__)
            except Exception as exc:
                log.exception("%s failed", method.__name__)
                metrics.rejected(method.__name__, grpc.StatusCode.INTERNAL.name)
                context.abort(
                    grpc.StatusCode.INTERNAL, f"{method.__name__}: internal error: {type(exc).__name__}: {exc}"
                )

    return wrapper  # type: ignore[return-value]
