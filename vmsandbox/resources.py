"""The pod's resource declaration as the core sees it: frozen values, no protobuf.

A ``PodDeclaration`` is what KEP-4112 ``PodSandboxConfig.pod_resources`` carries (every init and
app container's requests, limits, mounts, devices and CDI devices). ``ContainerRequest`` is what a
later CreateContainer or UpdateContainerResources asks for, in the same terms, so that admission
compares like with like.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from vmsandbox.errors import InvalidArgument
from vmsandbox.quantity import Quantity, parse_nonnegative_quantity

CPU = "cpu"
MEMORY = "memory"
EPHEMERAL_STORAGE = "ephemeral-storage"
HUGEPAGES_PREFIX = "hugepages-"

#: Page sizes a ``hugepages-<size>`` resource may name, in bytes.
HUGEPAGE_SIZES: Mapping[str, int] = {"2Mi": 2 * 1024 * 1024, "1Gi": 1024 * 1024 * 1024}


@dataclass(frozen=True, eq=False)
class ResourceList:
    """An immutable ``name -> Quantity`` map, sorted by name (so equal lists compare equal)."""

    items: tuple[tuple[str, Quantity], ...] = ()

    def key(self) -> tuple[tuple[str, tuple[int, int]], ...]:
        """The canonical form: names with exact values in lowest terms; computed once per list.

        Equality and hashing use it, so comparing a request with a declaration is one tuple
        comparison of strings and ints (admission runs it on every CreateContainer).
        """
        cached: tuple[tuple[str, tuple[int, int]], ...] | None = self.__dict__.get("_key")
        if cached is None:
            cached = tuple((name, q.value.as_integer_ratio()) for name, q in self.items)
            self.__dict__["_key"] = cached
        return cached

    def exact_values(self) -> dict[str, tuple[int, int]]:
        """``key()`` as a dict, name -> exact value in lowest terms; computed once per list."""
        cached: dict[str, tuple[int, int]] | None = self.__dict__.get("_values")
        if cached is None:
            cached = self.__dict__["_values"] = dict(self.key())
        return cached

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ResourceList):
            return NotImplemented
        return self is other or self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key())

    @staticmethod
    def of(pairs: Mapping[str, Quantity] | Iterable[tuple[str, Quantity]]) -> ResourceList:
        seq = pairs.items() if isinstance(pairs, Mapping) else pairs
        return ResourceList(tuple(sorted(seq, key=lambda kv: kv[0])))

    @staticmethod
    def parse(raw: Mapping[str, str], *, where: str) -> ResourceList:
        """Parse ``{"cpu": "500m", ...}``; errors name ``where`` (e.g. 'container "app": limits')."""
        parsed: list[tuple[str, Quantity]] = []
        for name, text in raw.items():
            check_resource_name(name, where=where)
            try:
                parsed.append((name, parse_nonnegative_quantity(text)))
            except InvalidArgument as exc:
                raise InvalidArgument(f"{where}.{name}: {exc}") from None
        return ResourceList.of(parsed)

    def get(self, name: str) -> Quantity | None:
        for key, value in self.items:
            if key == name:
                return value
        return None

    def names(self) -> tuple[str, ...]:
        return tuple(k for k, _ in self.items)

    def __iter__(self) -> Iterator[tuple[str, Quantity]]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def as_strings(self) -> dict[str, str]:
        return {k: v.canonical() for k, v in self.items}


def check_resource_name(name: str, *, where: str) -> None:
    """Kubernetes resource names: non-empty, no spaces, at most one '/', qualified-name charset."""
    if not name or len(name) > 253 or any(c.isspace() for c in name) or name.count("/") > 1:
        raise InvalidArgument(f"{where}: invalid resource name {name!r}")
    allowed = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._/")
    if not set(name) <= allowed:
        raise InvalidArgument(f"{where}: invalid resource name {name!r}")
    if name.startswith(HUGEPAGES_PREFIX) and name[len(HUGEPAGES_PREFIX) :] not in HUGEPAGE_SIZES:
        sizes = ", ".join(HUGEPAGES_PREFIX + s for s in HUGEPAGE_SIZES)
        raise InvalidArgument(f"{where}: unsupported hugepage resource {name!r} (supported: {sizes})")


def page_size_label(page_size: int) -> str:
    """The size as a ``hugepages-<size>`` resource spells it: 2097152 -> '2Mi', 1073741824 -> '1Gi'."""
    return f"{page_size >> 30}Gi" if page_size >= 1 << 30 else f"{page_size >> 20}Mi"


def hugepage_resource(page_size: int) -> str:
    """2097152 -> 'hugepages-2Mi'."""
    return HUGEPAGES_PREFIX + page_size_label(page_size)


def hugepage_size(name: str) -> int | None:
    """Page size in bytes for a ``hugepages-<size>`` resource name, else None."""
    if name.startswith(HUGEPAGES_PREFIX):
        return HUGEPAGE_SIZES.get(name[len(HUGEPAGES_PREFIX) :])
    return None


def is_extended(name: str) -> bool:
    """Extended resources (``vendor.com/gpu``) are the ones Kubernetes does not define itself."""
    return name not in (CPU, MEMORY, EPHEMERAL_STORAGE) and hugepage_size(name) is None


@dataclass(frozen=True, order=True)
class Mount:
    container_path: str
    host_path: str = ""
    readonly: bool = False
    recursive_read_only: bool = False
    selinux_relabel: bool = False
    propagation: int = 0
    image: str = ""  # an image volume's image (then no host path), as the kubelet names it
    image_sub_path: str = ""

    def describe(self) -> str:
        mode = "ro" if self.readonly else "rw"
        if self.image:
            sub = f"/{self.image_sub_path}" if self.image_sub_path else ""
            return f"image {self.image}{sub}:{self.container_path}:{mode}"
        return f"{self.host_path or '?'}:{self.container_path}:{mode}"


@dataclass(frozen=True, order=True)
class Device:
    container_path: str
    host_path: str = ""
    permissions: str = ""

    def describe(self) -> str:
        return f"{self.host_path or '?'}:{self.container_path}:{self.permissions or '-'}"


@dataclass(frozen=True, order=True)
class CdiDevice:
    name: str

    def describe(self) -> str:
        return self.name


@dataclass(frozen=True)
class ContainerResources:
    """Requests, limits and attachments of one container, as declared or as requested."""

    requests: ResourceList = field(default_factory=ResourceList)
    limits: ResourceList = field(default_factory=ResourceList)
    mounts: frozenset[Mount] = frozenset()
    devices: frozenset[Device] = frozenset()
    cdi_devices: frozenset[CdiDevice] = frozenset()


@dataclass(frozen=True)
class ContainerDeclaration:
    name: str
    resources: ContainerResources = field(default_factory=ContainerResources)


@dataclass(frozen=True)
class PodDeclaration:
    """KEP-4112 ``PodResourceConfig``: the whole pod, declared once at RunPodSandbox."""

    init_containers: tuple[ContainerDeclaration, ...] = ()
    containers: tuple[ContainerDeclaration, ...] = ()

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for kind, group in (("init container", self.init_containers), ("container", self.containers)):
            for decl in group:
                if not decl.name:
                    raise InvalidArgument(f"pod_resources: a {kind} has an empty name")
                if decl.name in seen:
                    raise InvalidArgument(f"pod_resources: container name {decl.name!r} is declared twice")
                seen.add(decl.name)
        if not self.containers:
            raise InvalidArgument("pod_resources: declares no app container")
        # an index, not a field (eq, hash and repr ignore it): find() runs on every CreateContainer
        self.__dict__["_by_name"] = {d.name: d for d in self.init_containers + self.containers}

    def find(self, name: str) -> ContainerDeclaration | None:
        found: ContainerDeclaration | None = self.__dict__["_by_name"].get(name)
        return found

    def all_containers(self) -> tuple[ContainerDeclaration, ...]:
        return self.init_containers + self.containers
