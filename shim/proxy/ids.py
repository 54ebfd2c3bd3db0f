"""Which sandbox and container ids the downstream runtime owns (the proxy's one piece of state).

Held in memory only: rebuilt at start-up by listing the downstream, learnt from the replies of
calls routed there (RunPodSandbox, CreateContainer) and forgotten on their removal. An id that
neither side knows makes the proxy list the downstream again, once for that call, so sandboxes
made while the proxy could not see the downstream (absent at start, a restart of either) are
found. vmsandbox's own ids are its ``Sandboxes``' business; this map never holds them.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from shim.cri.runtime.v1 import api_pb2 as pb
from shim.proxy.downstream import Downstream

log = logging.getLogger(__name__)

LIST_SANDBOXES = "/runtime.v1.RuntimeService/ListPodSandbox"
LIST_CONTAINERS = "/runtime.v1.RuntimeService/ListContainers"
RELIST_CAP_S = 10.0  # a relist is bounded on its own, whatever the caller's deadline


@dataclass(frozen=True)
class Listed:
    sandboxes: dict[str, str]  # sandbox id -> pod uid
    containers: dict[str, str]  # container id -> sandbox id


class DownstreamIds:
    def __init__(self, downstream: Downstream) -> None:
        self.downstream = downstream
        self._lock = threading.Lock()
        self._sandboxes: dict[str, str] = {}
        self._containers: dict[str, str] = {}

    def relist(self) -> Listed:
        """Replace the map with what the downstream lists now (``DownstreamUnavailable`` if it cannot)."""
        pods = pb.ListPodSandboxResponse.FromString(self.downstream.call(LIST_SANDBOXES, b"", cap_s=RELIST_CAP_S))
        ctrs = pb.ListContainersResponse.FromString(self.downstream.call(LIST_CONTAINERS, b"", cap_s=RELIST_CAP_S))
        listed = Listed(
            sandboxes={p.id: p.metadata.uid for p in pods.items},
            containers={c.id: c.pod_sandbox_id for c in ctrs.containers},
        )
        with self._lock:
            self._sandboxes = dict(listed.sandboxes)
            self._containers = dict(listed.containers)
        return listed

    def sandboxes_with_prefix(self, prefix: str) -> list[str]:
        with self._lock:
            if prefix in self._sandboxes:
                return [prefix]
            return [i for i in self._sandboxes if i.startswith(prefix)]

    def containers_with_prefix(self, prefix: str) -> list[str]:
        with self._lock:
            if prefix in self._containers:
                return [prefix]
            return [i for i in self._containers if i.startswith(prefix)]

    def has_uid(self, uid: str) -> bool:
        with self._lock:
            return uid in self._sandboxes.values()

    def learn_sandbox(self, sandbox_id: str, uid: str) -> None:
        with self._lock:
            self._sandboxes[sandbox_id] = uid

    def learn_container(self, container_id: str, sandbox_id: str) -> None:
        with self._lock:
            self._containers[container_id] = sandbox_id

    def forget_sandbox(self, prefix: str) -> None:
        with self._lock:
            for sid in [s for s in self._sandboxes if s.startswith(prefix)]:
                del self._sandboxes[sid]
                for cid in [c for c, s in self._containers.items() if s == sid]:
                    del self._containers[cid]

    def forget_container(self, prefix: str) -> None:
        with self._lock:
            for cid in [c for c in self._containers if c.startswith(prefix)]:
                del self._containers[cid]

    def counts(self) -> tuple[int, int]:
        with self._lock:
            return len(self._sandboxes), len(self._containers)
