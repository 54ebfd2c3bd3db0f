"""A pod's user namespace (KEP-127, ``hostUsers: false``): its uid and gid mappings (pure).

A kubelet that runs a pod with ``hostUsers: false`` sends ``NamespaceOption.userns_options`` in
mode POD with one uid and one gid mapping (container id 0, a host range of its own, 65536 ids
long by default) in the sandbox's config and in each container's, and the same mappings on each
of the container's ``Mount``s (idmapped mounts). In a VM pod the "host" ids are the guest's: the
guest agent's crun makes the container's user namespace with exactly these mappings, the
container's root file system is idmapped with them, and the guest's copies of the kubelet's
atomic-writer volumes carry their owners shifted through them (``vmsandbox.kubelet_volumes.shifted``), as an idmapped
bind of the kubelet's directory would show them.

``UserNamespace`` is checked here, once: mappings present, lengths positive, ranges inside the
32-bit id space, no two container ranges and no two host ranges overlapping (the kernel refuses
them), at most ``MAX_MAPPINGS`` of each.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from vmsandbox.errors import InvalidArgument

MAX_MAPPINGS = 32
"""uid (or gid) mappings one user namespace may have (the kubelet sends one; the kernel takes 340)."""
ID_LIMIT = 1 << 32
"""Ids are 32 bits: a range ends at most here (and the id 2^32-1 itself is no id)."""
OVERFLOW_ID = 65534
"""The id the kernel shows for an id the namespace does not map (``/proc/sys/kernel/overflowuid``)."""


@dataclass(frozen=True)
class IdMapping:
    """``length`` ids from ``container_id`` in the namespace are ``host_id`` on in the guest."""

    container_id: int
    host_id: int
    length: int

    def line(self) -> str:
        """As ``/proc/<pid>/uid_map`` shows it (without its padding)."""
        return f"{self.container_id} {self.host_id} {self.length}"


@dataclass(frozen=True)
class UserNamespace:
    """The mappings of a pod's user namespace (mode POD)."""

    uids: tuple[IdMapping, ...]
    gids: tuple[IdMapping, ...]

    def to_doc(self) -> dict[str, Any]:
        return {
            "uids": [[m.container_id, m.host_id, m.length] for m in self.uids],
            "gids": [[m.container_id, m.host_id, m.length] for m in self.gids],
        }

    @staticmethod
    def from_doc(doc: dict[str, Any]) -> UserNamespace:
        def ms(items: Iterable[Sequence[int]]) -> tuple[IdMapping, ...]:
            return tuple(IdMapping(int(c), int(h), int(n)) for c, h, n in items)

        return UserNamespace(ms(doc.get("uids", ())), ms(doc.get("gids", ())))

    def oci(self) -> dict[str, list[dict[str, int]]]:
        """``linux.uidMappings`` and ``linux.gidMappings`` of an OCI runtime spec."""

        def one(items: tuple[IdMapping, ...]) -> list[dict[str, int]]:
            return [{"containerID": m.container_id, "hostID": m.host_id, "size": m.length} for m in items]

        return {"uidMappings": one(self.uids), "gidMappings": one(self.gids)}

    def maps_uid(self, uid: int) -> bool:
        return _inside(self.uids, uid) is not None

    def maps_gid(self, gid: int) -> bool:
        return _inside(self.gids, gid) is not None

    def host_uid(self, uid: int) -> int:
        """The guest id a file owned by ``uid`` on the kubelet's side has in the container's
        view through an idmapped mount: ``uid`` taken as a container id; ``OVERFLOW_ID`` when
        the namespace does not map it."""
        return _shift(self.uids, uid)

    def host_gid(self, gid: int) -> int:
        return _shift(self.gids, gid)


def _inside(mappings: tuple[IdMapping, ...], ident: int) -> IdMapping | None:
    for m in mappings:
        if m.container_id <= ident < m.container_id + m.length:
            return m
    return None


def _shift(mappings: tuple[IdMapping, ...], ident: int) -> int:
    m = _inside(mappings, ident)
    return OVERFLOW_ID if m is None else m.host_id + (ident - m.container_id)


class _WireMapping(Protocol):
    host_id: int
    container_id: int
    length: int


def mappings(items: Sequence[_WireMapping], where: str) -> tuple[IdMapping, ...]:
    """Checked ``IDMapping``s (uint32 fields on the wire): at least one, at most ``MAX_MAPPINGS``,
    each of a positive length inside the id space, no container range and no host range
    overlapping another."""
    if not items:
        raise InvalidArgument(f"{where} is empty: a user namespace of the pod's own needs at least one mapping")
    if len(items) > MAX_MAPPINGS:
        raise InvalidArgument(f"{where} has {len(items)} mappings, more than {MAX_MAPPINGS}")
    out = []
    for i, m in enumerate(items):
        at = f"{where}[{i}]"
        if m.length <= 0:
            raise InvalidArgument(f"{at}.length is {m.length}: a mapping maps at least one id")
        for name, first in (("container_id", m.container_id), ("host_id", m.host_id)):
            if first < 0 or first + m.length >= ID_LIMIT:
                raise InvalidArgument(
                    f"{at}: {name} {first} + length {m.length} passes the last id {ID_LIMIT - 2} (ids are 32 bits)"
                )
        out.append(IdMapping(int(m.container_id), int(m.host_id), int(m.length)))
    for side in ("container_id", "host_id"):
        ranges = sorted((getattr(m, side), getattr(m, side) + m.length, i) for i, m in enumerate(out))
        for (_, end, a), (start, _, b) in itertools.pairwise(ranges):
            if start < end:
                raise InvalidArgument(f"{where}[{min(a, b)}] and [{max(a, b)}]: their {side} ranges overlap")
    return tuple(out)


def describe(ns: UserNamespace | None) -> str:
    """The namespace as a message names it: its uid and gid mappings, or the node's."""
    if ns is None:
        return "the node's user namespace (no userns_options in mode POD)"
    return (
        f"uids [{', '.join(m.line() for m in ns.uids)}], gids [{', '.join(m.line() for m in ns.gids)}]"
        " (container id, host id, length)"
    )


def check_same(pod: UserNamespace | None, container: UserNamespace | None, where: str) -> None:
    """A container runs in its pod's user namespace: the one its config names must be the one
    the pod's sandbox was made with, else INVALID_ARGUMENT naming both."""
    if pod != container:
        raise InvalidArgument(
            f"{where}: the container's user namespace ({describe(container)}) is not its pod's ({describe(pod)})"
        )
