"""Which side serves a CRI call when vmsandbox sits in front of a downstream runtime (pure).

Two sides: ``LOCAL`` (vmsandbox's own VM pods) and ``DOWNSTREAM`` (the CRI runtime ordinary pods go
to, containerd say). A ``RunPodSandbox`` goes by its handler: the handlers of vmsandbox's profiles
stay local, every other one, the default ``""`` included, goes downstream. Every later call goes by
the id it names, matched as a unique prefix across both sides (``route_id``). Calls that concern
the node as a whole are merged or answered by one side (``METHODS``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from vmsandbox import image_ref, validation
from vmsandbox.errors import InvalidArgument


class Side(Enum):
    LOCAL = "vmsandbox"
    DOWNSTREAM = "downstream"


class Kind(Enum):
    """How a method is routed."""

    HANDLER = "handler"  # RunPodSandbox: by runtime_handler
    SANDBOX = "sandbox"  # by pod_sandbox_id (field 1)
    CONTAINER = "container"  # by container_id (field 1)
    CREATE = "create"  # CreateContainer: by pod_sandbox_id, learns the container id from the reply
    MERGE = "merge"  # both sides; replies concatenated (each side applies the filter)
    BOTH = "both"  # both sides must accept (UpdateRuntimeConfig)
    STATUS = "status"  # both sides, one condition set per side
    LOCAL = "local"  # vmsandbox answers alone (Version, streaming list RPCs)
    DOWNSTREAM = "downstream"  # the downstream answers alone (RuntimeConfig, the metric descriptors)
    IMAGE = "image"  # ImageService: see the image rule in shim/proxy/split_images.py


METHODS: dict[str, Kind] = {
    "Version": Kind.LOCAL,
    "RunPodSandbox": Kind.HANDLER,
    "StopPodSandbox": Kind.SANDBOX,
    "RemovePodSandbox": Kind.SANDBOX,
    "PodSandboxStatus": Kind.SANDBOX,
    "PodSandboxStats": Kind.SANDBOX,
    "PortForward": Kind.SANDBOX,
    "UpdatePodSandboxResources": Kind.SANDBOX,
    "CheckpointPod": Kind.SANDBOX,
    "CreateContainer": Kind.CREATE,
    "StartContainer": Kind.CONTAINER,
    "StopContainer": Kind.CONTAINER,
    "RemoveContainer": Kind.CONTAINER,
    "ContainerStatus": Kind.CONTAINER,
    "UpdateContainerResources": Kind.CONTAINER,
    "ReopenContainerLog": Kind.CONTAINER,
    "ExecSync": Kind.CONTAINER,
    "Exec": Kind.CONTAINER,
    "Attach": Kind.CONTAINER,
    "ContainerStats": Kind.CONTAINER,
    "CheckpointContainer": Kind.CONTAINER,
    "ListPodSandbox": Kind.MERGE,
    "ListContainers": Kind.MERGE,
    "ListContainerStats": Kind.MERGE,
    "ListPodSandboxStats": Kind.MERGE,
    "UpdateRuntimeConfig": Kind.BOTH,
    "Status": Kind.STATUS,
    "RuntimeConfig": Kind.DOWNSTREAM,
    # the node's descriptors are the downstream's (vmsandbox's are containerd 2.4's, and critest's
    # few more); every side reports its own pods' values
    "ListMetricDescriptors": Kind.DOWNSTREAM,
    "ListPodSandboxMetrics": Kind.MERGE,
    # server-streaming: vmsandbox serves none of them, and containerd 1.6 none either; one answer
    "GetContainerEvents": Kind.LOCAL,
    "StreamPodSandboxes": Kind.LOCAL,
    "StreamContainers": Kind.LOCAL,
    "StreamContainerStats": Kind.LOCAL,
    "StreamPodSandboxStats": Kind.LOCAL,
    "StreamPodSandboxMetrics": Kind.LOCAL,
    # a restore names its handler like RunPodSandbox
    "RestorePod": Kind.HANDLER,
}


def side_for_handler(handler: str, local_handlers: Iterable[str]) -> Side:
    """The handlers of vmsandbox's profiles stay local; every other one goes downstream."""
    return Side.LOCAL if handler in set(local_handlers) else Side.DOWNSTREAM


@dataclass(frozen=True)
class Routed:
    """An id prefix resolved: the side that owns it (``None``: neither side knows it)."""

    side: Side | None


def route_id(prefix: str, local: Iterable[str], downstream: Iterable[str], kind: str) -> Routed:
    """Which side owns the id ``prefix`` names, given the ids of each side that start with it.

    An exact id wins on its side. A prefix matching ids on both sides is INVALID_ARGUMENT naming
    one of each; several matches on one side only go to that side, which answers as it would
    directly (containerd and vmsandbox both refuse an ambiguous prefix there)."""
    here = sorted({i for i in local if i.startswith(prefix)})
    there = sorted({i for i in downstream if i.startswith(prefix)})
    if prefix in here and prefix not in there:
        return Routed(Side.LOCAL)
    if prefix in there and prefix not in here:
        return Routed(Side.DOWNSTREAM)
    if here and there:
        raise InvalidArgument(
            f"{kind} id prefix {validation.quote(prefix)} is ambiguous: it matches {here[0][:16]} "
            f"(vmsandbox) and {there[0][:16]} (downstream); give more of the id"
        )
    if here:
        return Routed(Side.LOCAL)
    if there:
        return Routed(Side.DOWNSTREAM)
    return Routed(None)


def filter_side(prefix: str, local: Iterable[str], downstream: Iterable[str]) -> Side | None:
    """For a list filter naming an id (prefix): the one side that can have matches, or None for both.

    A filter that matches on neither side or on both asks both (each side filters by itself)."""
    if not prefix:
        return None
    here = any(i.startswith(prefix) for i in local)
    there = any(i.startswith(prefix) for i in downstream)
    if here and not there:
        return Side.LOCAL
    if there and not here:
        return Side.DOWNSTREAM
    return None


@dataclass(frozen=True)
class ListFilter:
    """What a list request asks for, as CRI filters say it (empty: anything)."""

    id: str = ""  # an id prefix
    pod_sandbox_id: str = ""  # a sandbox id prefix (containers only)
    state: int | None = None  # the CRI state enum's number, None: any state
    labels: tuple[tuple[str, str], ...] = ()  # every one of these labels, with this value


@dataclass(frozen=True)
class ListedItem:
    """What a filter looks at of one listed sandbox or container."""

    id: str
    pod_sandbox_id: str  # a container's sandbox; "" for a sandbox
    state: int
    labels: tuple[tuple[str, str], ...]


def list_matches(item: ListedItem, f: ListFilter) -> bool:
    """Whether ``item`` is one ``f`` asks for, as a CRI runtime filters its own list: ids by prefix,
    the state exactly, every label of the selector present with its value."""
    if f.id and not item.id.startswith(f.id):
        return False
    if f.pod_sandbox_id and not item.pod_sandbox_id.startswith(f.pod_sandbox_id):
        return False
    if f.state is not None and item.state != f.state:
        return False
    labels = dict(item.labels)
    return all(labels.get(k) == v for k, v in f.labels)


@dataclass(frozen=True)
class ImageEntry:
    """What the image merge needs of one side's image: its id, names and size."""

    id: str
    repo_tags: tuple[str, ...]
    repo_digests: tuple[str, ...]
    size: int


def merge_images(first: Iterable[ImageEntry], second: Iterable[ImageEntry]) -> list[tuple[int, int | None]]:
    """One entry per image id over two stores, in the order first seen.

    Both stores name an image by its config digest, so an image in both is one image to the
    kubelet's garbage collector. Returns pairs (index into ``first`` or -1, index into ``second``
    or None): the caller keeps the first side's message (its unknown fields intact) and adds the
    second side's names."""
    out: list[tuple[int, int | None]] = []
    seen: dict[str, int] = {}
    for i, e in enumerate(first):
        if e.id in seen:
            continue
        seen[e.id] = len(out)
        out.append((i, None))
    for j, e in enumerate(second):
        if e.id in seen:
            k = seen[e.id]
            if out[k][1] is None:
                out[k] = (out[k][0], j)
            continue
        seen[e.id] = len(out)
        out.append((-1, j))
    return out


def union(a: Iterable[str], b: Iterable[str]) -> list[str]:
    """``a`` then what ``b`` adds, without repeats, order kept."""
    out = list(dict.fromkeys(a))
    out.extend(x for x in dict.fromkeys(b) if x not in out)
    return out


def repository(name: str) -> str:
    """The repository an image name is in: ``reg:5000/a/b:1`` and ``reg:5000/a/b@sha256:..`` -> ``reg:5000/a/b``."""
    name = name.split("@", 1)[0]
    slash, colon = name.rfind("/"), name.rfind(":")
    return name[:colon] if colon > slash else name


def _tagged(name: str) -> str:
    """``name`` normalised as ``domain/path:tag`` (no tag: ``latest``); empty for an id, a digest
    reference or what does not parse."""
    try:
        ref = image_ref.parse_reference(name)
    except InvalidArgument:
        return ""
    return "" if ref.digest else ref.tagged


def copy_source(repo_digests: Iterable[str], repo_tags: Iterable[str], named: str = "") -> str | None:
    """The name to pull an image held by one store into the other: a repo digest names exactly
    that manifest, so it is preferred to a tag, which may have moved since. But when the container
    names the image by one of its tags (``named``: crictl, critest; the kubelet names the image id),
    that tag: pulled by its digest, the other store would not know the image by the name the
    container then asks for."""
    tags = tuple(repo_tags)
    wanted = _tagged(named)
    if wanted and wanted in {_tagged(t) for t in tags}:
        return wanted
    for name in (*repo_digests, *tags):
        if name:
            return name
    return None
