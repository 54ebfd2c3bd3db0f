"""The shim's own configuration: where it listens, what it owns, where it keeps state.

Read from a YAML file (``--config``); every key has a default that works on a single node.
``cpu_pool`` is the set of host CPUs the shim owns (kernel cpulist syntax, default: every online
CPU); ``hugepages`` caps how many pages of each size it may hand out (default: what the host
has reserved). Of ``cpu_pool``, ``shared_cpus`` is the pool shared pods float over (none: shared
pods are refused) and ``housekeeping_cpus`` where emulator threads may be pinned; exclusive pods
get only the rest. ``memory_reserved`` is the ordinary memory per NUMA node that guests not backed
by hugepages may not take (a quantity for every node, or a mapping from node number to quantity;
nodes not named keep the default 1Gi): the host's own processes and the kubelet's pods live there.
``packing`` chooses among the NUMA nodes a pod fits (``spread``, ``best-fit``, ``first-fit``).
``device_pools`` names the PCI functions that may be passed through (nothing
else ever is); ``cdi_spec_dirs`` are where CDI specs are read, later directories winning.
``qemu_uids`` (``FIRST-LAST``, default 2000000000-2000065535) is the range each sandbox's QEMU gets
its own uid and gid from.
``pod_network`` is ``cni`` (pods get a network from the CNI configuration in ``cni_conf_dir`` and
the plugins in ``cni_bin_dirs``; namespaces live in ``netns_dir``) or ``none`` (no NIC at all).
``dra`` configures the Dynamic Resource Allocation driver (``vmsandbox.dra.parse_dra_config``:
``kubeconfig``, ``driver_name``, ``kubelet_plugins_registry_dir``, ``kubelet_plugins_dir``,
``node_name``, ``networks``, ``pci_pools``: device pools whose IOMMU groups it publishes, checked
against ``device_pools``); it is off unless a kubeconfig is given.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from vmsandbox.cdi import DEFAULT_SPEC_DIRS
from vmsandbox.containerd_config import DEFAULT_SHIM_DIR
from vmsandbox.devices import parse_pool_config
from vmsandbox.dra import DraConfig, parse_dra_config
from vmsandbox.dra_pci import check_pci_pools
from vmsandbox.errors import InvalidArgument
from vmsandbox.host import format_cpulist, parse_cpulist
from vmsandbox.nri_rules import NriConfig
from vmsandbox.nri_rules import parse_config as parse_nri_config
from vmsandbox.placement import DEFAULT_PACKING, PACKINGS, Packing
from vmsandbox.qemu_user import DEFAULT_QEMU_UIDS, UidRange, parse_uid_range
from vmsandbox.quantity import parse_nonnegative_quantity
from vmsandbox.registries import Registries, parse_registries
from vmsandbox.resources import HUGEPAGE_SIZES

ANY_NODE = -1
DEFAULT_MEMORY_RESERVED = 1 << 30
DEFAULT_FRONT_BINARY = "/usr/local/libexec/vmsandbox/vmsandbox-front"  # where scripts/build-front.sh puts it


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
    cgroup_root: str = "/sys/fs/cgroup"  # the v1 hierarchies VM pods' QEMUs are moved into (cgroup_parent)
    workers: int = 16
    reconcile_interval_s: int = 30  # how often ledger and libvirt are compared while serving; 0 = start-up only
    metrics_address: str = ""  # host:port for Prometheus /metrics (":port" = 127.0.0.1); empty = off
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
    log_rate_bytes: int = 4 << 20  # bytes per second copied from each container's log to the kubelet's file
    log_burst_bytes: int = 16 << 20  # what one container's log may copy at once beyond that rate
    # node -> bytes of ordinary memory guests may not take; ANY_NODE: every node not named
    memory_reserved: dict[int, int] = field(default_factory=lambda: {ANY_NODE: DEFAULT_MEMORY_RESERVED})
    packing: Packing = DEFAULT_PACKING  # which NUMA node of those that fit (vmsandbox.placement)
    kubelet_pods_dir: str = "/var/lib/kubelet/pods"  # container mounts from here are shared into guests
    mount_allowlist: tuple[str, ...] = ()  # other host paths the admin lets containers mount
    seccomp_profile_root: str = "/var/lib/kubelet/seccomp"  # Localhost seccomp profiles are read from here only
    pod_network: str = "cni"  # cni: pods get a network through CNI; none: pods boot without a NIC
    cni_conf_dir: str = "/etc/cni/net.d"  # the first valid .conf/.conflist/.json here, in lexical order
    # where CNI plugins are looked up, in order: the usual place, then where Debian's package puts them
    cni_bin_dirs: tuple[str, ...] = ("/opt/cni/bin", "/usr/lib/cni")
    netns_dir: str = "/run/netns"  # where the pods' network namespaces are bind-mounted (``ip netns`` sees them)
    # each sandbox's QEMU runs as its own uid (and gid) from this range ("FIRST-LAST" in the file)
    qemu_uids: UidRange = DEFAULT_QEMU_UIDS
    streaming_address: str = "127.0.0.1:0"  # Exec/Attach/PortForward URLs; port 0: a free port chosen at start
    streaming_tls_cert: str = ""  # PEM certificate and key: the streaming server speaks HTTPS (both or neither)
    streaming_tls_key: str = ""
    streaming_idle_timeout_s: int = 4 * 3600  # a stream with no traffic either way for this long is closed
    streaming_token_ttl_s: int = 60  # how long an Exec/Attach/PortForward URL may wait for its client
    streaming_max_streams: int = 64  # live streaming connections, all pods together
    streaming_max_streams_per_pod: int = 16
    nri: NriConfig = field(default_factory=NriConfig)  # host NRI plugins (vmsandbox.nri_rules); off by default
    # a CRI runtime for every handler that is not a profile's (unix:///path); empty: every pod is a VM
    downstream_endpoint: str = ""
    downstream_timeout_s: float = 60.0  # the longest a forwarded call may take when its caller set no deadline
    # with a downstream: the program that reads the CRI socket first (front/); empty: the shim reads it
    front_binary: str = DEFAULT_FRONT_BINARY
    # the front's bounds for all its clients (its flags' defaults): client connections at once, and
    # MiB it holds for them (requests, replies collected whole, replies waiting for a client's window)
    front_max_conns: int = 256
    front_max_buffered_mib: int = 256
    front_window_timeout_s: float = 10.0  # a reply that waits this long for its client's window is reset
    front_idle_timeout_s: float = 300.0  # a client connection without a stream or a frame this long is closed
    # shim mode (docs/containerd-shim.md): the node's containerd, whose CRI plugin runs VM pods through
    # vmsandbox's runtime shim; its gRPC socket ("": shim mode off), its root (its content store) and
    # the namespace its CRI plugin uses; the ttrpc sockets the shim serves, one per runtime handler
    containerd_address: str = ""
    containerd_root: str = "/var/lib/containerd"
    containerd_namespace: str = "k8s.io"
    containerd_shim_dir: str = DEFAULT_SHIM_DIR
    # how often the disks of images containerd removed leave vmsandbox's store; 0 = never
    containerd_image_prune_s: int = 300
    # the DRA driver (docs/dra.md, vmsandbox.dra): off unless ``dra.kubeconfig`` is given
    dra: DraConfig = field(default_factory=DraConfig)
    extra: dict[str, Any] = field(default_factory=dict)

    def memory_reserved_on(self, node: int) -> int:
        return self.memory_reserved.get(node, self.memory_reserved.get(ANY_NODE, DEFAULT_MEMORY_RESERVED))

    def with_overrides(self, **kwargs: Any) -> ShimConfig:
        return replace(self, **{k: v for k, v in kwargs.items() if v is not None})


_KEYS = {
    "dra",
    "containerd_address",
    "containerd_image_prune_s",
    "containerd_root",
    "containerd_namespace",
    "containerd_shim_dir",
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
    "cgroup_root",
    "workers",
    "reconcile_interval_s",
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
    "log_rate_bytes",
    "log_burst_bytes",
    "memory_reserved",
    "packing",
    "kubelet_pods_dir",
    "mount_allowlist",
    "seccomp_profile_root",
    "pod_network",
    "cni_conf_dir",
    "cni_bin_dirs",
    "netns_dir",
    "qemu_uids",
    "streaming_address",
    "streaming_tls_cert",
    "streaming_tls_key",
    "streaming_idle_timeout_s",
    "streaming_token_ttl_s",
    "streaming_max_streams",
    "streaming_max_streams_per_pod",
    "nri",
    "downstream_endpoint",
    "downstream_timeout_s",
    "front_binary",
    "front_max_conns",
    "front_max_buffered_mib",
    "front_window_timeout_s",
    "front_idle_timeout_s",
}

_FRONT_COUNTS = {"front_max_conns": (1, 65536), "front_max_buffered_mib": (1, 65536)}
_FRONT_SECONDS = {"front_window_timeout_s": 3600, "front_idle_timeout_s": 86400}

_STREAMING_LIMITS = {
    "streaming_idle_timeout_s": (1, 7 * 86400),
    "streaming_token_ttl_s": (1, 3600),
    "streaming_max_streams": (1, 4096),
    "streaming_max_streams_per_pod": (1, 4096),
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
        "cgroup_root",
        "metrics_address",
        "log_format",
        "registry_auth_file",
        "image_store_dir",
        "kubelet_pods_dir",
        "seccomp_profile_root",
        "pod_network",
        "cni_conf_dir",
        "netns_dir",
        "streaming_address",
        "streaming_tls_cert",
        "streaming_tls_key",
        "front_binary",
        "containerd_address",
        "containerd_root",
        "containerd_namespace",
        "containerd_shim_dir",
    ):
        if key in data:
            if not isinstance(data[key], str):
                raise InvalidArgument(f"{source}: {key}: must be a string")
            kwargs[key] = data[key]
    if kwargs.get("log_format", "text") not in ("text", "json"):
        raise InvalidArgument(f"{source}: log_format: must be text or json, got {kwargs['log_format']!r}")
    for key in (
        "registry_auth_file",
        "image_store_dir",
        "kubelet_pods_dir",
        "seccomp_profile_root",
        "cni_conf_dir",
        "netns_dir",
        "front_binary",
        "containerd_address",
        "containerd_root",
        "containerd_shim_dir",
    ):
        if kwargs.get(key) and not kwargs[key].startswith("/"):
            raise InvalidArgument(f"{source}: {key}: must be an absolute path")
    if kwargs.get("pod_network", "cni") not in ("cni", "none"):
        raise InvalidArgument(f"{source}: pod_network: must be cni or none, got {kwargs['pod_network']!r}")
    for key in ("cni_conf_dir", "netns_dir"):
        if key in kwargs and not kwargs[key]:
            raise InvalidArgument(f"{source}: {key}: must be an absolute path")
    if "cni_bin_dirs" in data:
        dirs = data["cni_bin_dirs"]
        if not isinstance(dirs, list) or not dirs or not all(isinstance(d, str) and d.startswith("/") for d in dirs):
            raise InvalidArgument(f"{source}: cni_bin_dirs: must be a non-empty list of absolute directory paths")
        kwargs["cni_bin_dirs"] = tuple(dirs)
    if "mount_allowlist" in data:
        paths = data["mount_allowlist"]
        if not isinstance(paths, list) or not all(isinstance(p, str) and p.startswith("/") for p in paths):
            raise InvalidArgument(f"{source}: mount_allowlist: must be a list of absolute paths")
        kwargs["mount_allowlist"] = tuple(paths)
    kwargs["nri"] = parse_nri_config(data.get("nri"), source)
    kwargs["dra"] = parse_dra_config(data.get("dra"), source)
    kwargs["registries"] = parse_registries(data.get("registries"), f"{source}: registries")
    if "qemu_uids" in data:
        kwargs["qemu_uids"] = parse_uid_range(str(data["qemu_uids"]), f"{source}: qemu_uids")
    for key in ("image_max_bytes", "image_max_entries", "log_rate_bytes", "log_burst_bytes"):
        if key in data:
            if not isinstance(data[key], int) or isinstance(data[key], bool) or data[key] < 1:
                raise InvalidArgument(f"{source}: {key}: must be a positive integer")
            kwargs[key] = data[key]
    for key in ("reconcile_interval_s", "containerd_image_prune_s"):
        if key in data:
            value = data[key]
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 86400:
                raise InvalidArgument(f"{source}: {key}: must be a number of seconds from 0 to 86400")
            kwargs[key] = value
    for key, (low, high) in _STREAMING_LIMITS.items():
        if key in data:
            value = data[key]
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise InvalidArgument(f"{source}: {key}: must be an integer from {low} to {high}")
            kwargs[key] = value
    if bool(kwargs.get("streaming_tls_cert")) != bool(kwargs.get("streaming_tls_key")):
        raise InvalidArgument(f"{source}: streaming_tls_cert and streaming_tls_key: give both or neither")
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
    if "packing" in data:
        if data["packing"] not in PACKINGS:
            raise InvalidArgument(f"{source}: packing: must be one of {', '.join(PACKINGS)}, got {data['packing']!r}")
        kwargs["packing"] = data["packing"]
    if data.get("memory_reserved") is not None:
        kwargs["memory_reserved"] = _memory_reserved(data["memory_reserved"], source)
    if "downstream_endpoint" in data:
        endpoint = data["downstream_endpoint"]
        if not isinstance(endpoint, str) or (endpoint and not endpoint.startswith("unix:///")):
            raise InvalidArgument(f"{source}: downstream_endpoint: must be a unix socket, unix:///path, or empty")
        kwargs["downstream_endpoint"] = endpoint
    if "downstream_timeout_s" in data:
        value = data["downstream_timeout_s"]
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 3600:
            raise InvalidArgument(f"{source}: downstream_timeout_s: must be a number of seconds from 0 to 3600")
        kwargs["downstream_timeout_s"] = float(value)
    for key, (low, high) in _FRONT_COUNTS.items():
        if key in data:
            value = data[key]
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise InvalidArgument(f"{source}: {key}: must be an integer from {low} to {high}")
            kwargs[key] = value
    for key, most in _FRONT_SECONDS.items():
        if key in data:
            value = data[key]
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= most:
                raise InvalidArgument(f"{source}: {key}: must be a number of seconds from 0 to {most}")
            kwargs[key] = float(value)
    if "profile_files" in data:
        files = data["profile_files"]
        if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
            raise InvalidArgument(f"{source}: profile_files: must be a list of paths")
        base = Path(source).parent
        kwargs["profile_files"] = tuple(str(base / f) for f in files)
    check_pci_pools(kwargs["dra"].pci_pools, kwargs.get("device_pools", {}), source)
    return ShimConfig(**kwargs)


def _memory_reserved(value: object, source: str) -> dict[int, int]:
    """``2Gi`` (every node) or ``{0: 4Gi, 1: 2Gi}`` (nodes not named: the default) to node -> bytes."""

    def amount(text: object, where: str) -> int:
        if isinstance(text, bool) or not isinstance(text, str | int):
            raise InvalidArgument(f"{source}: {where}: must be a memory quantity such as 2Gi")
        try:
            return parse_nonnegative_quantity(str(text)).value_int()
        except InvalidArgument as exc:
            raise InvalidArgument(f"{source}: {where}: {exc}") from None

    if isinstance(value, dict):
        out = {ANY_NODE: DEFAULT_MEMORY_RESERVED}
        for node, text in value.items():
            if isinstance(node, bool) or not isinstance(node, int) or node < 0:
                raise InvalidArgument(f"{source}: memory_reserved: {node!r}: keys are NUMA node numbers (0, 1, ...)")
            out[node] = amount(text, f"memory_reserved.{node}")
        return out
    return {ANY_NODE: amount(value, "memory_reserved")}


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
