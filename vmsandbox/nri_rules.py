"""NRI's rules as pure functions: configuration, plugin names, event masks, and what a plugin's
container adjustment does to a VM pod's container.

The NRI API is containerd/nri's; its protobufs stay at the edge (``shim.nri.codec`` turns
them into ``Adjustment``). Adjustments from several plugins are applied in plugin order; a
plugin may not change what an earlier one set (NRI's ownership rule), and the first such
conflict fails the CreateContainer naming both plugins. What a VM pod can take: annotations,
environment, the command line, rlimits, oom_score_adj, mounts (which then pass the shim's mount
allowlist and are shared into the guest like the kubelet's), and memory, CPU quota/period/shares
and hugepage limits, which then pass the same divergence admission as a CreateContainer
(``resource_divergence``). What it cannot: anything that names host objects the guest does not
have or that the VM fixed at boot (devices, CDI devices, cpusets and memory nodes, namespaces,
OCI hooks, cgroup paths, seccomp policies, sysctls, network devices, RDT, block-IO classes,
scheduling and memory policies, pids and unified cgroup settings): those refuse the container,
naming the plugin, rather than being dropped silently.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from vmsandbox import admission
from vmsandbox.errors import Diverged, InvalidArgument
from vmsandbox.resources import ContainerResources
from vmsandbox.sizing import LinuxResources
from vmsandbox.validation import quote

# containerd/nri pkg/api: DefaultPluginRegistrationTimeout, DefaultPluginRequestTimeout,
# DefaultSocketPath; pkg/adaptation: DefaultPluginPath, DefaultPluginConfigPath.
DEFAULT_REGISTRATION_TIMEOUT_S = 5.0
DEFAULT_REQUEST_TIMEOUT_S = 2.0
DEFAULT_SOCKET_PATH = "/var/run/nri/nri.sock"
DEFAULT_PLUGIN_PATH = "/opt/nri/plugins"
DEFAULT_PLUGIN_CONFIG_PATH = "/etc/nri/conf.d"
NRI_VERSION = "v0.12.2"  # the API version of proto/gen/nri/api.proto

# NRI's Event enum (api.proto)
RUN_POD_SANDBOX = 1
STOP_POD_SANDBOX = 2
REMOVE_POD_SANDBOX = 3
CREATE_CONTAINER = 4
POST_CREATE_CONTAINER = 5
START_CONTAINER = 6
POST_START_CONTAINER = 7
UPDATE_CONTAINER = 8
POST_UPDATE_CONTAINER = 9
STOP_CONTAINER = 10
REMOVE_CONTAINER = 11
UPDATE_POD_SANDBOX = 12
POST_UPDATE_POD_SANDBOX = 13
VALIDATE_CONTAINER_ADJUSTMENT = 14
EVENT_LAST = 15
VALID_EVENTS = (1 << (EVENT_LAST - 1)) - 1
MESSAGE_LIMIT = 512  # characters of a plugin's message we pass on


@dataclass(frozen=True)
class NriConfig:
    enable: bool = False
    socket_path: str = DEFAULT_SOCKET_PATH  # "": no socket, only plugins the shim starts
    plugin_path: str = DEFAULT_PLUGIN_PATH
    plugin_config_path: str = DEFAULT_PLUGIN_CONFIG_PATH
    registration_timeout_s: float = DEFAULT_REGISTRATION_TIMEOUT_S
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S


_CONFIG_KEYS = {f for f in NriConfig.__dataclass_fields__}


def parse_config(data: object, source: str) -> NriConfig:
    """The ``nri:`` section of the shim's configuration."""
    if data is None:
        return NriConfig()
    if not isinstance(data, dict):
        raise InvalidArgument(f"{source}: nri: must be a mapping")
    unknown = sorted(set(data) - _CONFIG_KEYS)
    if unknown:
        raise InvalidArgument(f"{source}: nri.{unknown[0]}: unknown key (known: {', '.join(sorted(_CONFIG_KEYS))})")
    kwargs: dict[str, Any] = {}
    if "enable" in data:
        if not isinstance(data["enable"], bool):
            raise InvalidArgument(f"{source}: nri.enable: must be true or false")
        kwargs["enable"] = data["enable"]
    for key in ("socket_path", "plugin_path", "plugin_config_path"):
        if key in data:
            value = data[key]
            if not isinstance(value, str) or (value and not value.startswith("/")):
                raise InvalidArgument(f"{source}: nri.{key}: must be an absolute path (or empty)")
            kwargs[key] = value
    for key in ("registration_timeout_s", "request_timeout_s"):
        if key in data:
            value = data[key]
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 300:
                raise InvalidArgument(f"{source}: nri.{key}: must be a number of seconds above 0, at most 300")
            kwargs[key] = float(value)
    return NriConfig(**kwargs)


def check_plugin_name(name: str) -> str:
    """NRI's rule (api.CheckPluginName): not empty, only [a-zA-Z0-9_.+-]."""
    if not name:
        raise InvalidArgument("invalid plugin name: name is empty")
    if len(name) > 128 or any(not (c.isascii() and (c.isalnum() or c in "-_.+")) for c in name):
        raise InvalidArgument(f"invalid plugin name {quote(name, 128)}: only [a-zA-Z0-9_.+-] are allowed")
    return name


def check_plugin_index(idx: str) -> str:
    """NRI's rule (api.CheckPluginIndex): exactly two digits."""
    if len(idx) != 2 or not all("0" <= c <= "9" for c in idx):
        raise InvalidArgument(f"invalid plugin index {quote(idx, 16)}: must be 2 digits")
    return idx


def split_plugin_file(filename: str) -> tuple[str, str] | None:
    """``10-logger`` -> ("10", "logger"); None for a file that is not named like a plugin."""
    idx, sep, base = filename.partition("-")
    if not sep:
        return None
    try:
        return check_plugin_index(idx), check_plugin_name(base)
    except InvalidArgument:
        return None


def event_mask(events: int) -> int:
    """A plugin's subscription: 0 means every event (as NRI reads it); unknown bits are refused."""
    if events == 0:
        return VALID_EVENTS
    if events & ~VALID_EVENTS:
        raise InvalidArgument(f"invalid plugin events: 0x{events & ~VALID_EVENTS:x}")
    return events


def subscribed(mask: int, event: int) -> bool:
    return bool(mask & (1 << (event - 1)))


def bounded(message: str) -> str:
    """A plugin's message as we pass it on: control characters escaped, at most MESSAGE_LIMIT."""
    return quote(message, MESSAGE_LIMIT)[1:-1]


# -- container adjustments ----------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """What the adjustable parts of a container are, and which plugin set each of them."""

    name: str
    annotations: Mapping[str, str] = field(default_factory=dict)
    env: tuple[tuple[str, str], ...] = ()
    args: tuple[str, ...] | None = None  # None: the container's own command line
    rlimits: tuple[tuple[str, int, int], ...] = ()  # (type, hard, soft)
    oom_score_adj: int | None = None
    mounts: tuple[tuple[str, str, bool], ...] = ()  # (container path, host path, read-only) added by plugins
    linux: LinuxResources = field(default_factory=LinuxResources)
    owners: Mapping[str, str] = field(default_factory=dict)  # "env:FOO", "memory", ... -> plugin
    resource_plugins: tuple[str, ...] = ()  # plugins that changed a resource, in order


def _refuse(plugin: str, container: str, what: str) -> InvalidArgument:
    return InvalidArgument(
        f'NRI plugin "{plugin}" adjusts {what} of container "{container}", which a VM pod cannot take: '
        "its devices, CPUs and memory nodes are fixed when the VM boots and host objects do not exist in the guest"
    )


def _claim(target: Target, owners: dict[str, str], key: str, plugin: str) -> None:
    other = owners.get(key)
    if other is not None and other != plugin:
        raise InvalidArgument(
            f'NRI plugins "{other}" and "{plugin}" both adjust {key} of container "{target.name}" '
            "(NRI allows one owner)"
        )
    owners[key] = plugin


_HUGEPAGE_SIZES = {"2MB": 2 << 20, "1GB": 1 << 30, "2Mi": 2 << 20, "1Gi": 1 << 30}

# NRI adjustment fields a VM pod cannot take (as ``shim.nri.codec`` names the ones set), and
# how the refusal describes them
UNSUPPORTED = {
    "CDI_devices": "CDI devices",
    "hooks": "OCI hooks",
    "linux.devices": "devices",
    "linux.cgroups_path": "the cgroup path",
    "linux.io_priority": "the I/O priority",
    "linux.seccomp_policy": "the seccomp policy",
    "linux.namespaces": "namespaces",
    "linux.sysctl": "sysctls",
    "linux.net_devices": "network devices",
    "linux.scheduler": "the scheduling policy",
    "linux.rdt": "RDT",
    "linux.memory_policy": "the memory policy",
    "linux.resources.cpu.cpus": "cpuset.cpus",
    "linux.resources.cpu.mems": "cpuset.mems",
    "linux.resources.cpu.realtime_runtime": "realtime CPU time",
    "linux.resources.cpu.realtime_period": "realtime CPU time",
    "linux.resources.blockio_class": "the block-I/O class",
    "linux.resources.rdt_class": "the RDT class",
    "linux.resources.unified": "unified cgroup settings",
    "linux.resources.pids": "the pids limit",
    "linux.resources.devices": "device cgroup rules",
    "linux.resources.memory.reservation": "memory.reservation",
    "linux.resources.memory.swap": "memory.swap",
    "linux.resources.memory.kernel": "memory.kernel",
    "linux.resources.memory.kernel_tcp": "memory.kernel_tcp",
    "linux.resources.memory.swappiness": "memory.swappiness",
    "linux.resources.memory.disable_oom_killer": "memory.disable_oom_killer",
    "linux.resources.memory.use_hierarchy": "memory.use_hierarchy",
}


@dataclass(frozen=True)
class AdjustMount:
    destination: str  # "-/path": remove what an earlier plugin added there
    source: str = ""
    type: str = ""
    options: tuple[str, ...] = ()


@dataclass(frozen=True)
class Adjustment:
    """One plugin's ContainerAdjustment (or a ContainerUpdate's resources), as the core reads it.

    Keys starting with "-" remove (NRI's MarkForRemoval); ``None`` leaves a value alone;
    ``unsupported`` names the fields set that a VM pod cannot take (keys of ``UNSUPPORTED``)."""

    annotations: tuple[tuple[str, str], ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    args: tuple[str, ...] = ()
    rlimits: tuple[tuple[str, int, int], ...] = ()  # (type, hard, soft)
    oom_score_adj: int | None = None
    mounts: tuple[AdjustMount, ...] = ()
    memory_limit: int | None = None
    cpu_quota: int | None = None
    cpu_period: int | None = None
    cpu_shares: int | None = None
    hugepage_limits: tuple[tuple[str, int], ...] = ()  # ("2MB", bytes)
    unsupported: tuple[str, ...] = ()


def apply_adjustment(target: Target, plugin: str, adj: Adjustment) -> Target:
    """``target`` as ``plugin``'s adjustment leaves it; InvalidArgument for what a VM pod cannot take."""
    refused = list(dict.fromkeys(UNSUPPORTED.get(f, f) for f in adj.unsupported))
    if refused:
        raise _refuse(plugin, target.name, ", ".join(refused))
    owners = dict(target.owners)
    annotations = dict(target.annotations)
    for key, value in sorted(adj.annotations):
        name = key[1:] if key.startswith("-") else key
        _claim(target, owners, f"annotation {name}", plugin)
        if key.startswith("-"):
            annotations.pop(name, None)
        else:
            annotations[key] = value
    env = list(target.env)
    for key, value in adj.env:
        name = key[1:] if key.startswith("-") else key
        if not name or "=" in name or "\0" in name or "\0" in value:
            raise InvalidArgument(f'NRI plugin "{plugin}": environment variable {quote(name, 64)} is not valid')
        _claim(target, owners, f"env {name}", plugin)
        env = [(k, v) for k, v in env if k != name]
        if not key.startswith("-"):
            env.append((name, value))
    args = target.args
    if adj.args:
        _claim(target, owners, "args", plugin)
        args = adj.args
    rlimits = list(target.rlimits)
    for kind, hard, soft in adj.rlimits:
        _claim(target, owners, f"rlimit {kind}", plugin)
        rlimits = [x for x in rlimits if x[0] != kind]
        rlimits.append((kind, hard, soft))
    oom = target.oom_score_adj
    if adj.oom_score_adj is not None:
        _claim(target, owners, "oom_score_adj", plugin)
        oom = adj.oom_score_adj
    mounts = list(target.mounts)
    for m in adj.mounts:
        dest = m.destination[1:] if m.destination.startswith("-") else m.destination
        _claim(target, owners, f"mount {dest}", plugin)
        mounts = [x for x in mounts if x[0] != dest]
        if m.destination.startswith("-"):
            continue
        if m.type not in ("", "bind", "rbind") or not m.source.startswith("/") or not dest.startswith("/"):
            raise InvalidArgument(
                f'NRI plugin "{plugin}": mount {quote(dest, 128)} of type {quote(m.type, 32)}: only bind mounts '
                "of absolute host paths reach a VM pod (shared into the guest)"
            )
        mounts.append((dest, m.source, "ro" in m.options))
    linux = _apply_resources(target, owners, plugin, adj)
    changed = linux != target.linux
    return replace(
        target,
        annotations=annotations,
        env=tuple(env),
        args=args,
        rlimits=tuple(rlimits),
        oom_score_adj=oom,
        mounts=tuple(mounts),
        linux=linux,
        owners=owners,
        resource_plugins=target.resource_plugins
        + ((plugin,) if changed and plugin not in target.resource_plugins else ()),
    )


def _apply_resources(target: Target, owners: dict[str, str], plugin: str, adj: Adjustment) -> LinuxResources:
    changes: dict[str, Any] = {}
    for value, key, name in (
        (adj.memory_limit, "memory_limit_bytes", "memory limit"),
        (adj.cpu_quota, "cpu_quota", "cpu quota"),
        (adj.cpu_period, "cpu_period", "cpu period"),
        (adj.cpu_shares, "cpu_shares", "cpu shares"),
    ):
        if value is not None:
            _claim(target, owners, name, plugin)
            changes[key] = max(value, 0) if key == "memory_limit_bytes" else value
    if adj.hugepage_limits:
        pages = dict(target.linux.hugepage_limits)
        for label, limit in adj.hugepage_limits:
            size = _HUGEPAGE_SIZES.get(label)
            if size is None:
                raise InvalidArgument(f'NRI plugin "{plugin}": hugepage size {quote(label, 16)} is unknown')
            _claim(target, owners, f"hugepage limit {label}", plugin)
            pages[size] = limit
        changes["hugepage_limits"] = tuple(sorted((s, v) for s, v in pages.items() if v))
    return replace(target.linux, **changes)


def resource_divergence(
    target: Target,
    before: LinuxResources,
    declared: ContainerResources | None,
    fits: Callable[[admission.Usage, str], None],
) -> None:
    """Raise Diverged, naming the plugins, when their resource adjustments leave what the pod
    declared for the container (declared pods) or what the VM holds (pods sized without one).

    The comparison is CreateContainer's own (``admission.linux_differences``, and ``fits``: the
    envelope rule ``lifecycle.check_fits_beside`` for this container, called with its usage after
    the plugins and who to name); only differences the plugins introduced count, so a container
    the kubelet sent within its declaration is refused for the plugins' change alone.
    """
    after = target.linux
    if after == before or not target.resource_plugins:
        return
    names = ", ".join(f'"{p}"' for p in target.resource_plugins)
    who = f"NRI plugin{'s' if len(target.resource_plugins) > 1 else ''} {names}"
    if declared is not None:
        was = set(admission.linux_differences(target.name, declared, before))
        new = [d for d in admission.linux_differences(target.name, declared, after) if d not in was]
        if new:
            raise Diverged(
                f"{who} adjusted resources that diverge from the pod's declaration (the VM was sized from it "
                "and cannot grow): " + "; ".join(new)
            )
        return
    fits(admission.Usage.of_linux(after), f'container "{target.name}" as {who} adjusted it')
