"""Typed errors of the core, one class per kind of failure.

The gRPC layer maps each kind to one status code in a single place (``shim/status.py``);
the core never imports grpc. Messages are written for a human: which container, which
resource, what was declared and what was asked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class VmSandboxError(Exception):
    """Base of every error the core raises on purpose."""


class InvalidArgument(VmSandboxError):
    """The caller sent something malformed or meaningless (INVALID_ARGUMENT)."""


class NotFound(VmSandboxError):
    """The id names nothing we know (NOT_FOUND)."""


class AlreadyExists(VmSandboxError):
    """The object exists already and this is not a retry (ALREADY_EXISTS)."""


class Diverged(VmSandboxError):
    """The request does not match what the pod declared at RunPodSandbox (FAILED_PRECONDITION)."""


@dataclass(frozen=True)
class Shortfall:
    """One resource a placement could not get: what was needed where, and what was there."""

    resource: str  # "cpu", "hugepages-2Mi", "device pool gpu", "vCPUs"
    where: str  # "node 0", "nodes 0-1", "profile 'small'"
    need: str  # "288 pages"
    available: str  # "60"
    detail: str  # the sentence the error message carries

    def __str__(self) -> str:
        return self.detail


class CannotFit(VmSandboxError):
    """The host (or the VM) has too little of a resource (RESOURCE_EXHAUSTED).

    ``shortfalls`` names each short resource when the refusal comes from counting them, so tools
    can show "declared vs available" without parsing the message."""

    def __init__(self, message: str, shortfalls: Sequence[Shortfall] = ()) -> None:
        super().__init__(message)
        self.shortfalls = tuple(shortfalls)


class Unauthenticated(VmSandboxError):
    """A registry refused us for want of (valid) credentials (UNAUTHENTICATED)."""


class PermissionDenied(VmSandboxError):
    """The credentials were accepted but do not allow this, or configuration forbids it (PERMISSION_DENIED)."""


class Unsupported(VmSandboxError):
    """A CRI feature vmsandbox does not implement for VM pods (UNIMPLEMENTED): refused by name,
    never ignored."""


class WrongState(VmSandboxError):
    """The object is not in a state that allows the operation (a stopped container, FAILED_PRECONDITION)."""


class DeadlineExceeded(VmSandboxError):
    """The operation's own time limit ran out (an ExecSync command, DEADLINE_EXCEEDED)."""


class InfrastructureError(VmSandboxError):
    """The hypervisor, the guest or the host failed underneath us (UNAVAILABLE)."""


class InternalError(VmSandboxError):
    """An invariant of our own broke (INTERNAL)."""
