"""Which sandbox and container ids the downstream runtime owns, and its last full lists (the proxy's state).

Held in memory only: rebuilt at start-up by listing the downstream, learnt from the replies of
calls routed there (RunPodSandbox, CreateContainer) and forgotten on their removal. An id that
neither side knows makes the proxy list the downstream again, once for that call, so sandboxes
made while the proxy could not see the downstream (absent at start, a restart of either) are
found. vmsandbox's own ids are its ``Records``' business; this map never holds them.

The last unfiltered ``ListPodSandbox`` and ``ListContainers`` replies of the downstream (from the
start-up listing, a relist, or a list the kubelet made through the proxy) are kept as the bytes
that came back, without parsing them; sandboxes and containers removed through the proxy since
are left out of them. They answer for the downstream's side of a merged list while it cannot
be reached (``last_listed``).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from gen.cri.runtime.v1 import api_pb2 as pb
from shim.proxy.downstream import Downstream
from vmsandbox import routing

log = logging.getLogger(__name__)

LIST_SANDBOXES = "/runtime.v1.RuntimeService/ListPodSandbox"
LIST_CONTAINERS = "/runtime.v1.RuntimeService/ListContainers"
RELIST_CAP_S = 10.0  # a relist is bounded on its own, whatever the caller's deadline
# the lists kept as last listed: the reply's message type and its repeated field
LISTS: dict[str, tuple[Any, str]] = {
    "ListPodSandbox": (pb.ListPodSandboxResponse, "items"),
    "ListContainers": (pb.ListContainersResponse, "containers"),
}


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
        self._listed: dict[str, bytes] = {}  # list method -> the downstream's last unfiltered reply
        # per list, the ids removed through the proxy since its reply was kept
        self._removed: dict[str, set[str]] = {name: set() for name in LISTS}

    def relist(self) -> Listed:
        """Replace the map with what the downstream lists now (``DownstreamUnavailable`` if it cannot)."""
        pods_reply = self.downstream.call(LIST_SANDBOXES, b"", cap_s=RELIST_CAP_S)
        ctrs_reply = self.downstream.call(LIST_CONTAINERS, b"", cap_s=RELIST_CAP_S)
        pods = pb.ListPodSandboxResponse.FromString(pods_reply)
        ctrs = pb.ListContainersResponse.FromString(ctrs_reply)
        listed = Listed(
            sandboxes={p.id: p.metadata.uid for p in pods.items},
            containers={c.id: c.pod_sandbox_id for c in ctrs.containers},
        )
        with self._lock:
            self._sandboxes = dict(listed.sandboxes)
            self._containers = dict(listed.containers)
            self._listed = {"ListPodSandbox": pods_reply, "ListContainers": ctrs_reply}
            self._removed = {name: set() for name in LISTS}
        return listed

    def saw_list(self, name: str, reply: bytes) -> None:
        """The downstream's reply to an unfiltered ``name`` (one of ``LISTS``), kept as it came."""
        with self._lock:
            self._listed[name] = reply
            self._removed[name] = set()

    def last_listed(self, name: str, f: routing.ListFilter) -> bytes | None:
        """The downstream's side of ``name`` as it last listed it, filtered by ``f``, without what was
        removed through the proxy since (None: it was never listed)."""
        with self._lock:
            reply = self._listed.get(name)
            removed = set(self._removed[name])
        if reply is None:
            return None
        cls, field = LISTS[name]
        kept = [
            item
            for item in getattr(cls.FromString(reply), field)
            if item.id not in removed
            and getattr(item, "pod_sandbox_id", "") not in removed  # a container of a removed sandbox
            and routing.list_matches(_listed_item(item), f)
        ]
        out = cls()
        getattr(out, field).extend(kept)  # each item as the downstream sent it, unknown fields included
        data: bytes = out.SerializeToString()
        return data

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
                self._mark_removed(sid)
                for cid in [c for c, s in self._containers.items() if s == sid]:
                    del self._containers[cid]
                    self._mark_removed(cid)

    def forget_container(self, prefix: str) -> None:
        with self._lock:
            for cid in [c for c in self._containers if c.startswith(prefix)]:
                del self._containers[cid]
                self._mark_removed(cid)

    def _mark_removed(self, item_id: str) -> None:  # with the lock held
        for removed in self._removed.values():
            removed.add(item_id)

    def counts(self) -> tuple[int, int]:
        with self._lock:
            return len(self._sandboxes), len(self._containers)


def _listed_item(item: Any) -> routing.ListedItem:
    """What a filter looks at of a ``PodSandbox`` or a ``Container``."""
    return routing.ListedItem(
        id=item.id,
        pod_sandbox_id=getattr(item, "pod_sandbox_id", ""),
        state=item.state,
        labels=tuple(item.labels.items()),
    )


def list_filter(f: Any) -> routing.ListFilter:
    """A ``PodSandboxFilter`` or ``ContainerFilter`` as ``routing.ListFilter``."""
    return routing.ListFilter(
        id=f.id,
        pod_sandbox_id=getattr(f, "pod_sandbox_id", ""),
        state=f.state.state if f.HasField("state") else None,
        labels=tuple(f.label_selector.items()),
    )
