"""Typed errors of the core, one class per kind of failure.

The gRPC layer maps each kind to one status code in a single place (``shim/status.py``);
the core never imports grpc. Messages are written for a human: which container, which
resource, what was declared and what was asked.
"""

from __future__ import annotations


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


class CannotFit(VmSandboxError):
    """The host (or the VM) has too little of a resource (RESOURCE_EXHAUSTED)."""


class InfrastructureError(VmSandboxError):
    """The hypervisor, the guest or the host failed underneath us (UNAVAILABLE)."""


class InternalError(VmSandboxError):
    """An invariant of our own broke (INTERNAL)."""
