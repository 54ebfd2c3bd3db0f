"""The shim's own configuration: where it listens, what it owns, where it keeps state.

Read from a YAML file (``--config``); every key has a default that works on a single node.
``cpu_pool`` is the set of host CPUs the shim owns (kernel cpulist syntax, default: every online
CPU); ``hugepages`` caps how many pages of each size it may hand out (default: what the host
has reserved). Of ``cpu_pool``, ``shared_cpus`` is the pool shared pods float over (none: shared
pods are refused) and ``housekeeping_cpus`` where emulator threads may be pinned; exclusive pods
get only the rest. ``device_pools`` names the PCI functions that may be passed through (nothing
else ever is); ``cdi_spec_dirs`` are where CDI specs are read, later directories winning.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from vmsandbox.cdi import DEFAULT_SPEC_DIRS
from vmsandbox.devices import parse_pool_config
from vmsandbox.errors import InvalidArgument
from vmsandbox.host import format_cpulist, parse_cpulist
from vmsandbox.registries import Registries, parse_registries
from vmsandbox.resources import HUGEPAGE_SIZES


@dataclass(frozen=True)
class ShimConfig:
    socket_path: str = "/run/vmsandbox/vmsandbox.sock"
    socket_group: str = ""
    state_dir: str = "/var/lib/vmsandbox/state"
    console_dir: str = "/var/log/vmsandbox/console"
    libvirt_uri: str = "qemu:///system"
    cpu_pool: tuple[int, ...] | None = None
    hugepages: dict[int, int] | None = None  # page size in bytes -> pages the shim may use
    profile_files: tuple[str, ...] = ()
    default_handler: str = "vmsandbox"
    sys_root: str = "/sys"
    proc_root: str = "/proc"
    workers: int = 16
    metrics_address: str = ""  # host:port for Prometheus /metrics; empty = off
    log_format: str = "text"  # text or json
    shared_cpus: tuple[int, ...] = ()  # of cpu_pool: shared pods float over these (none: shared pods refused)
    housekeeping_cpus: tuple[int, ...] = ()  # of cpu_pool: emulator threads of `emulator: housekeeping` profiles
    device_pools: dict[str, tuple[str, ...]] = field(default_factory=dict)  # pool -> PCI addresses / vendor:device
    cdi_spec_dirs: tuple[str, ...] = DEFAULT_SPEC_DIRS
    registries: Registries = field(default_factory=Registries)
    registry_auth_file: str = ""
    image_store_dir: str = ""  # empty: <state_dir>/images
    image_max_bytes: int = 32 << 30  # uncompressed bytes one image may unpack to
    image_max_entries: int = 2_000_000  # tar entries one image may have, all layers together
    kubelet_pods_dir: str = "/var/lib/kubelet/pods"  # container mounts from here are shared into guests
    mount_allowlist: tuple[str, ...] = ()  # other host paths the admin lets containers mount
    extra: dict[str, Any] = field(default_factory=dict)

    def with_overrides(self, **kwargs: Any) -> ShimConfig:
        return replace(self, **{k: v for k, v in kwargs.items() if v is not None})


_KEYS = {
    "socket_path",
    "socket_group",
    "state_dir",
    "console_dir",
    "libvirt_uri",
    "cpu_pool",
    "hugepages",
    "profile_files",
    "default_handler",
    "sys_root",
    "proc_root",
    "workers",
    "metrics_address",
    "log_format",
    "shared_cpus",
    "housekeeping_cpus",
    "device_pools",
    "cdi_spec_dirs",
    "registries",
    "registry_auth_file",
    "image_store_dir",
    "image_max_bytes",
    "image_max_entries",
    "kubelet_pods_dir",
    "mount_allowlist",
}


def config_from_mapping(data: dict[str, Any], source: str) -> ShimConfig:
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        raise InvalidArgument(f"{source}: {unknown[0]}: unknown key (known: {', '.join(sorted(_KEYS))})")
    kwargs: dict[str, Any] = {}
    for key in (
        "socket_path",
        "socket_group",
        "state_dir",
        "console_dir",
        "libvirt_uri",
        "default_handler",
        "sys_root",
        "proc_root",
        "metrics_address",
        "log_format",
        "registry_auth_file",
        "image_store_dir",
        "kubelet_pods_dir",
    ):
        if key in data:
            if not isinstance(data[key], str):
                raise InvalidArgument(f"{source}: {key}: must be a string")
            kwargs[key] = data[key]
    if kwargs.get("log_format", "text") not in ("text", "json"):
        raise InvalidArgument(f"{source}: log_format: must be text or json, got {kwargs['log_format']!r}")
    for key in ("registry_auth_file", "image_store_dir", "kubelet_pods_dir"):
        if kwargs.get(key) and not kwargs[key].startswith("/"):
            raise InvalidArgument(f"{source}: {key}: must be an absolute path")
    if "mount_allowlist" in data:
        paths = data["mount_allowlist"]
        if not isinstance(paths, list) or not all(isinstance(p, str) and p.startswith("/") for p in paths):
            raise InvalidArgument(f"{source}: mount_allowlist: must be a list of absolute paths")
        kwargs["mount_allowlist"] = tuple(paths)
    kwargs["registries"] = parse_registries(data.get("registries"), f"{source}: registries")
    for key in ("image_max_bytes", "image_max_entries"):
        if key in data:
            if not isinstance(data[key], int) or isinstance(data[key], bool) or data[key] < 1:
                raise InvalidArgument(f"{source}: {key}: must be a positive integer")
            kwargs[key] = data[key]
    if "workers" in data:
        if not isinstance(data["workers"], int) or not 1 <= data["workers"] <= 256:
            raise InvalidArgument(f"{source}: workers: must be an integer between 1 and 256")
        kwargs["workers"] = data["workers"]
    if data.get("cpu_pool") not in (None, ""):
        try:
            kwargs["cpu_pool"] = parse_cpulist(str(data["cpu_pool"]))
        except ValueError as exc:
            raise InvalidArgument(f"{source}: cpu_pool: {exc}") from None
    for key in ("shared_cpus", "housekeeping_cpus"):
        if data.get(key) in (None, ""):
            continue
        try:
            kwargs[key] = parse_cpulist(str(data[key]))
        except ValueError as exc:
            raise InvalidArgument(f"{source}: {key}: {exc}") from None
        outside = set(kwargs[key]) - set(kwargs.get("cpu_pool", kwargs[key]))
        if outside:
            raise InvalidArgument(f"{source}: {key}: {format_cpulist(outside)} is not in cpu_pool")
    if data.get("device_pools") is not None:
        try:
            kwargs["device_pools"] = parse_pool_config(data["device_pools"])
        except ValueError as exc:
            raise InvalidArgument(f"{source}: device_pools: {exc}") from None
    if "cdi_spec_dirs" in data:
        dirs = data["cdi_spec_dirs"]
        if not isinstance(dirs, list) or not all(isinstance(d, str) and d.startswith("/") for d in dirs):
            raise InvalidArgument(f"{source}: cdi_spec_dirs: must be a list of absolute directory paths")
        kwargs["cdi_spec_dirs"] = tuple(dirs)
    if data.get("hugepages") is not None:
        pages = data["hugepages"]
        if not isinstance(pages, dict):
            raise InvalidArgument(f"{source}: hugepages: must map a page size (2Mi, 1Gi) to a page count")
        budget = {}
        for size, count in pages.items():
            if size not in HUGEPAGE_SIZES:
                raise InvalidArgument(f"{source}: hugepages.{size}: unknown page size (use 2Mi or 1Gi)")
            if not isinstance(count, int) or count < 0:
                raise InvalidArgument(f"{source}: hugepages.{size}: must be a page count >= 0")
            budget[HUGEPAGE_SIZES[size]] = count
        kwargs["hugepages"] = budget
    if "profile_files" in data:
        files = data["profile_files"]
        if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
            raise InvalidArgument(f"{source}: profile_files: must be a list of paths")
        base = Path(source).parent
        kwargs["profile_files"] = tuple(str(base / f) for f in files)
    return ShimConfig(**kwargs)


def load_config(path: str | None) -> ShimConfig:
    if not path:
        return ShimConfig()
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as exc:
        raise InvalidArgument(f"{path}: cannot read: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise InvalidArgument(f"{path}: invalid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidArgument(f"{path}: must be a mapping")
    return config_from_mapping(data, path)
