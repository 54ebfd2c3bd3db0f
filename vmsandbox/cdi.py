"""Container Device Interface (CDI) specs: parse them (pure) and load them from the spec directories.

A pod names CDI devices by their fully-qualified name, ``vendor.com/class=name``. A spec file
(JSON or YAML) declares devices of one kind::

    cdiVersion: 0.6.0
    kind: vendor.com/class
    devices:
      - name: gpu0
        containerEdits:
          deviceNodes:
            - path: /dev/vfio/12          # hostPath, when set, is the node on the host
    containerEdits:                       # applies to every device of the spec
      deviceNodes: [{path: /dev/vfio/vfio}]

A VM cannot receive a device node; the shim only uses the VFIO group nodes (``/dev/vfio/<N>``) of
a device to find the IOMMU group to pass through (``vmsandbox.devices``). Everything else in the
container edits (env, mounts, hooks) is for container runtimes and ignored here.

Directories are searched in order and a later directory wins for the same device (CDI's own rule:
``/etc/cdi`` then ``/var/run/cdi``, the dynamic one, with higher priority). Two specs of the same
directory defining one device are a conflict: the device is left out and the problem reported.
A spec that does not parse is skipped and reported; it never takes the other specs down.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

DEFAULT_SPEC_DIRS: tuple[str, ...] = ("/etc/cdi", "/var/run/cdi")
SPEC_SUFFIXES = (".json", ".yaml", ".yml")

_VENDOR = re.compile(r"[A-Za-z](?:[A-Za-z0-9_.-]*[A-Za-z0-9])?")
_CLASS = re.compile(r"[A-Za-z](?:[A-Za-z0-9_-]*[A-Za-z0-9])?")
_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9_.:-]*[A-Za-z0-9])?")


class CdiError(ValueError):
    """A spec or a device name is malformed."""


@dataclass(frozen=True)
class CdiDevice:
    """One device of a spec: its qualified name and the host device nodes it injects."""

    name: str  # vendor.com/class=name
    node_paths: tuple[str, ...]  # host paths (hostPath, else path), device's own edits then the spec's
    source: str  # the spec file


def parse_kind(kind: str) -> tuple[str, str]:
    """``vendor.com/class`` -> (vendor, class); CdiError when malformed."""
    vendor, slash, cls = kind.partition("/")
    if not slash or not _VENDOR.fullmatch(vendor) or not _CLASS.fullmatch(cls):
        raise CdiError(f"kind {kind!r} is not vendor.com/class")
    return vendor, cls


def parse_qualified_name(name: str) -> tuple[str, str, str]:
    """``vendor.com/class=name`` -> (vendor, class, name); CdiError when malformed."""
    kind, eq, device = name.partition("=")
    if not eq:
        raise CdiError(f"{name!r} is not a qualified CDI device name (vendor.com/class=name)")
    try:
        vendor, cls = parse_kind(kind)
    except CdiError:
        raise CdiError(f"{name!r} is not a qualified CDI device name (vendor.com/class=name)") from None
    if not _NAME.fullmatch(device):
        raise CdiError(f"{name!r}: device name {device!r} is not valid")
    return vendor, cls, device


def _node_paths(edits: Any, where: str) -> list[str]:
    if edits is None:
        return []
    if not isinstance(edits, Mapping):
        raise CdiError(f"{where}: containerEdits must be a mapping")
    nodes = edits.get("deviceNodes") or []
    if not isinstance(nodes, list):
        raise CdiError(f"{where}: containerEdits.deviceNodes must be a list")
    out = []
    for i, node in enumerate(nodes):
        if not isinstance(node, Mapping):
            raise CdiError(f"{where}: deviceNodes[{i}] must be a mapping")
        path = node.get("hostPath") or node.get("path")
        if not isinstance(path, str) or not path.startswith("/"):
            raise CdiError(f"{where}: deviceNodes[{i}] needs an absolute path")
        out.append(path)
    return out


def parse_spec(data: Any, source: str) -> tuple[CdiDevice, ...]:
    """The devices of one spec document; CdiError naming the source and the field when malformed."""
    if not isinstance(data, Mapping):
        raise CdiError(f"{source}: a CDI spec must be a mapping")
    version = data.get("cdiVersion")
    if not isinstance(version, str) or not version:
        raise CdiError(f"{source}: cdiVersion is missing")
    kind = data.get("kind")
    if not isinstance(kind, str):
        raise CdiError(f"{source}: kind is missing")
    try:
        parse_kind(kind)
    except CdiError as exc:
        raise CdiError(f"{source}: {exc}") from None
    devices = data.get("devices")
    if not isinstance(devices, list) or not devices:
        raise CdiError(f"{source}: devices must be a non-empty list")
    common = _node_paths(data.get("containerEdits"), f"{source}: containerEdits")
    out: list[CdiDevice] = []
    seen: set[str] = set()
    for i, dev in enumerate(devices):
        if not isinstance(dev, Mapping) or not isinstance(dev.get("name"), str):
            raise CdiError(f"{source}: devices[{i}] needs a name")
        name = dev["name"]
        if not _NAME.fullmatch(name):
            raise CdiError(f"{source}: devices[{i}]: device name {name!r} is not valid")
        if name in seen:
            raise CdiError(f"{source}: device {name!r} is defined twice")
        seen.add(name)
        own = _node_paths(dev.get("containerEdits"), f"{source}: devices[{i}] ({name})")
        paths = tuple(dict.fromkeys([*own, *common]))
        out.append(CdiDevice(name=f"{kind}={name}", node_paths=paths, source=source))
    return tuple(out)


@dataclass(frozen=True)
class CdiRegistry:
    """The devices every readable spec defines, by qualified name."""

    devices: Mapping[str, CdiDevice] = field(default_factory=dict)
    problems: tuple[str, ...] = ()
    dirs: tuple[str, ...] = DEFAULT_SPEC_DIRS

    def resolve(self, name: str) -> CdiDevice | None:
        return self.devices.get(name)


def build_registry(specs: Iterable[tuple[int, str, Any]], dirs: Sequence[str] = DEFAULT_SPEC_DIRS) -> CdiRegistry:
    """From (priority, source, parsed document) triples: higher priority wins; a tie is a conflict."""
    chosen: dict[str, tuple[int, CdiDevice]] = {}
    conflicts: dict[str, int] = {}
    problems: list[str] = []
    for priority, source, data in specs:
        try:
            devices = parse_spec(data, source)
        except CdiError as exc:
            problems.append(f"{exc} (spec skipped)")
            continue
        for dev in devices:
            held = chosen.get(dev.name)
            if conflicts.get(dev.name, -1) >= priority:
                continue
            if held is None or held[0] < priority:
                chosen[dev.name] = (priority, dev)
                conflicts.pop(dev.name, None)
            elif held[0] == priority:
                problems.append(f"CDI device {dev.name} is defined by both {held[1].source} and {source}; left out")
                conflicts[dev.name] = priority
                del chosen[dev.name]
    return CdiRegistry(
        devices={name: dev for name, (_, dev) in sorted(chosen.items())}, problems=tuple(problems), dirs=tuple(dirs)
    )
