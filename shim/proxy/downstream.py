"""The connection to the downstream CRI runtime: calls forwarded as bytes, bounded in time and number.

A request is sent as the bytes the caller sent and the reply returned as the bytes the downstream
answered, so fields vmsandbox's protos do not know pass through intact. The caller's deadline
(capped at ``downstream_timeout_s``) and its invocation metadata go along. A downstream that cannot
be reached is ``DownstreamUnavailable`` (UNAVAILABLE, naming the endpoint); any status the
downstream itself answered is ``Forwarded`` and reaches the caller unchanged. At most half the
server's workers wait on the downstream at once, so a hung downstream cannot take the threads
VM pod calls need.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc

from vmsandbox import validation
from vmsandbox.errors import InfrastructureError

# reconnect quickly once the downstream is back (gRPC's default backoff grows to two minutes)
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_receive_message_length", 16 << 20),  # what the kubelet accepts from a runtime
    ("grpc.max_send_message_length", 16 << 20),
]
# metadata gRPC itself sets on every call, and what the front tells the shim; the rest of the
# caller's goes along
_OWN_KEYS = ("user-agent", "content-type", "te", "grpc-", ":", "vmsandbox-")


class DownstreamUnavailable(InfrastructureError):
    """The downstream runtime could not be reached, or did not answer in time (UNAVAILABLE)."""


class Forwarded(Exception):
    """A status the downstream answered, passed on to the caller as it is."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class Downstream:
    def __init__(self, endpoint: str, timeout_s: float, max_calls: int) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._channel = grpc.insecure_channel(endpoint, options=_CHANNEL_OPTIONS)
        self._calls: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_calls)
        self.max_calls = max_calls

    def close(self) -> None:
        self._channel.close()

    def _multicallable(self, path: str) -> Any:
        call = self._calls.get(path)
        if call is None:
            with self._lock:  # no (de)serializer: bytes in, bytes out
                call = self._calls.setdefault(path, self._channel.unary_unary(path, None, None))
        return call

    def call(
        self, path: str, request: bytes, context: grpc.ServicerContext | None = None, cap_s: float | None = None
    ) -> bytes:
        """The downstream's reply bytes to ``request`` at ``path`` (``/runtime.v1.RuntimeService/Version``)."""
        timeout = self.timeout_s if cap_s is None else min(self.timeout_s, cap_s)
        metadata: list[tuple[str, str | bytes]] = []
        if context is not None:
            remaining = context.time_remaining()
            if remaining is not None:
                timeout = min(timeout, max(remaining, 0.001))
            metadata = [(k, v) for k, v in context.invocation_metadata() or () if not k.startswith(_OWN_KEYS)]
        if not self._slots.acquire(blocking=False):
            raise DownstreamUnavailable(
                f"downstream CRI runtime {self.endpoint}: {self.max_calls} calls already waiting on it; try again"
            )
        started = time.monotonic()
        try:
            reply: bytes = self._multicallable(path)(request, timeout=timeout, metadata=metadata or None)
            return reply
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""
            if code == grpc.StatusCode.UNAVAILABLE:
                raise DownstreamUnavailable(
                    f"downstream CRI runtime {self.endpoint} is unavailable: {validation.bound(details, 512)}"
                ) from None
            ran_out = time.monotonic() - started >= timeout - 0.01  # else the downstream answered it (ExecSync)
            if code == grpc.StatusCode.DEADLINE_EXCEEDED and ran_out and (context is None or _own_cap(context)):
                raise DownstreamUnavailable(
                    f"downstream CRI runtime {self.endpoint} did not answer {path.rsplit('/', 1)[-1]} "
                    f"within {timeout:.1f} s"
                ) from None
            raise Forwarded(code, details) from None
        finally:
            self._slots.release()


def _own_cap(context: grpc.ServicerContext) -> bool:
    """Whether the time that ran out was ours (the caller's own deadline still had time left)."""
    remaining = context.time_remaining()
    return remaining is None or remaining > 0.05
