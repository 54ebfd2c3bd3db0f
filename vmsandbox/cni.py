"""CNI, the pure part: which network configuration applies, what each plugin is given, and what
its result means (the CNI specification's formats, versions 0.3.0 to 1.1.0).

``choose_network`` picks the first valid file of a configuration directory in lexical order (as
the kubelet's runtimes do); ``plugin_input`` builds one plugin's stdin (the network's name and
version, the previous result, the ``runtimeConfig`` of the capabilities the plugin declares);
``plugin_env`` the environment; ``pod_network`` turns the ADD result into the guest's NIC and the
pod's IPs. Nothing here runs a plugin or reads a file.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vmsandbox.errors import InfrastructureError
from vmsandbox.network import PodNetwork, PortMapping, Route, pod_network_of
from vmsandbox.quantity import parse_nonnegative_quantity

CONFIG_SUFFIXES = (".conf", ".conflist", ".json")
IFNAME = "eth0"
SUPPORTED_VERSIONS = ("0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0")
MAX_CONFIG_BYTES = 1 << 20
MAX_MESSAGE = 1024
_PLUGIN_TYPE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
INGRESS_ANNOTATION = "kubernetes.io/ingress-bandwidth"
EGRESS_ANNOTATION = "kubernetes.io/egress-bandwidth"
# Burst in bits when a rate is set: the largest the bandwidth plugin takes, so only the rate limits.
_BURST_BITS = 2**31 - 1


class CniError(InfrastructureError):
    """A plugin failed, or a configuration or result is not what the CNI specification says."""


@dataclass(frozen=True)
class NetworkConfig:
    """One network configuration list (a ``.conf`` file is a list of one plugin)."""

    name: str
    cni_version: str
    plugins: tuple[Mapping[str, Any], ...] = field(hash=False)
    source: str = ""  # the file it came from, for messages

    def to_doc(self) -> dict[str, Any]:
        return {"name": self.name, "cniVersion": self.cni_version, "plugins": [dict(p) for p in self.plugins]}


@dataclass(frozen=True)
class PodArgs:
    """Who the network is for: CNI_CONTAINERID, CNI_NETNS and the Kubernetes CNI_ARGS."""

    sandbox_id: str
    netns: str
    pod_namespace: str
    pod_name: str
    pod_uid: str


def parse_config(text: str, source: str) -> NetworkConfig:
    """A ``.conflist`` (or a single-plugin ``.conf``); CniError saying what is wrong."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CniError(f"{source}: not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise CniError(f"{source}: not a JSON object")
    if "plugins" in doc:
        plugins = doc["plugins"]
        if not isinstance(plugins, list) or not plugins:
            raise CniError(f"{source}: plugins must be a non-empty list")
    else:
        plugins = [{k: v for k, v in doc.items() if k not in ("name", "cniVersion")}]
    name, version = doc.get("name"), doc.get("cniVersion")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise CniError(f"{source}: name {str(name)[:64]!r} is missing or not a network name")
    if version not in SUPPORTED_VERSIONS:
        raise CniError(f"{source}: cniVersion {str(version)[:16]!r} is not one of {', '.join(SUPPORTED_VERSIONS)}")
    for i, plugin in enumerate(plugins):
        if not isinstance(plugin, dict):
            raise CniError(f"{source}: plugins[{i}] is not an object")
        kind = plugin.get("type")
        # the type names a file in the plugin directories: a plain name, never a path
        if not isinstance(kind, str) or not _PLUGIN_TYPE.fullmatch(kind) or kind in (".", ".."):
            raise CniError(f"{source}: plugins[{i}].type {str(kind)[:64]!r} is not a plugin name")
    return NetworkConfig(name=name, cni_version=version, plugins=tuple(plugins), source=source)


def choose_network(files: Iterable[tuple[str, str]]) -> tuple[NetworkConfig | None, list[str]]:
    """The first valid configuration among (file name, text) pairs in lexical order of name, and
    why each file before it was skipped."""
    skipped: list[str] = []
    for name, text in sorted(files):
        if not name.endswith(CONFIG_SUFFIXES):
            continue
        try:
            return parse_config(text, name), skipped
        except CniError as exc:
            skipped.append(str(exc))
    return None, skipped


def bandwidth(annotations: Mapping[str, str]) -> dict[str, int]:
    """The ``bandwidth`` capability from the pod's annotations (bits per second), as the kubelet
    spells them (``10M``); CniError for a value that is not a quantity."""
    out: dict[str, int] = {}
    for key, prefix in ((INGRESS_ANNOTATION, "ingress"), (EGRESS_ANNOTATION, "egress")):
        text = annotations.get(key)
        if text is None:
            continue
        try:
            rate = parse_nonnegative_quantity(text).value_int()
        except Exception:
            raise CniError(f"annotation {key}={text[:64]!r} is not a bandwidth such as 10M") from None
        if rate:
            out[f"{prefix}Rate"] = rate
            out[f"{prefix}Burst"] = _BURST_BITS
    return out


def runtime_config(ports: Sequence[PortMapping], annotations: Mapping[str, str]) -> dict[str, Any]:
    """Every capability value the pod has; each plugin gets those it declares."""
    caps: dict[str, Any] = {}
    mapped = [
        {"hostPort": p.host_port, "containerPort": p.container_port, "protocol": p.protocol, "hostIP": p.host_ip}
        for p in ports
        if p.host_port > 0  # a mapping without a host port publishes nothing
    ]
    if mapped:
        caps["portMappings"] = mapped
    bw = bandwidth(annotations)
    if bw:
        caps["bandwidth"] = bw
    return caps


def plugin_input(
    network: NetworkConfig, index: int, capabilities: Mapping[str, Any], prev_result: Mapping[str, Any] | None
) -> bytes:
    """The stdin of plugin ``index``: its own configuration plus the network's name and version,
    the previous result, and the runtime values of the capabilities it declares."""
    plugin = dict(network.plugins[index])
    conf: dict[str, Any] = {**plugin, "name": network.name, "cniVersion": network.cni_version}
    declared = plugin.get("capabilities")
    wanted = {k: v for k, v in capabilities.items() if isinstance(declared, dict) and declared.get(k) is True}
    if wanted:
        conf["runtimeConfig"] = {**(plugin.get("runtimeConfig") or {}), **wanted}
    if prev_result is not None:
        conf["prevResult"] = dict(prev_result)
    return json.dumps(conf).encode()


def plugin_env(command: str, args: PodArgs, bin_dirs: Sequence[str]) -> dict[str, str]:
    cni_args = ";".join(
        [
            "IgnoreUnknown=1",
            f"K8S_POD_NAMESPACE={args.pod_namespace}",
            f"K8S_POD_NAME={args.pod_name}",
            f"K8S_POD_INFRA_CONTAINER_ID={args.sandbox_id}",
            f"K8S_POD_UID={args.pod_uid}",
        ]
    )
    return {
        "CNI_COMMAND": command,
        "CNI_CONTAINERID": args.sandbox_id,
        "CNI_NETNS": args.netns,
        "CNI_IFNAME": IFNAME,
        "CNI_ARGS": cni_args,
        "CNI_PATH": ":".join(bin_dirs),
    }


def error_message(stdout: bytes, stderr: bytes, code: int) -> str:
    """A plugin's failure in a bounded line: its error JSON's msg and details, else its stderr."""
    try:
        doc = json.loads(stdout)
    except (json.JSONDecodeError, UnicodeDecodeError):
        doc = None
    if isinstance(doc, dict) and isinstance(doc.get("msg"), str):
        text = doc["msg"] + (f": {doc['details']}" if isinstance(doc.get("details"), str) and doc["details"] else "")
        text += f" (CNI error code {doc.get('code')})"
    else:
        text = (stderr or stdout).decode(errors="replace").strip() or f"exit status {code}"
    text = " ".join(text.split())
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 1] + "…"


def parse_result(stdout: bytes, plugin: str) -> dict[str, Any]:
    try:
        doc = json.loads(stdout)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CniError(f"plugin {plugin} printed a result that is not JSON: {stdout[:200]!r}") from None
    if not isinstance(doc, dict):
        raise CniError(f"plugin {plugin} printed a result that is not a JSON object")
    return doc


def _list(result: Mapping[str, Any], key: str) -> Any:
    """A list field of a result, absent or null meaning empty (other types are the caller's error)."""
    value = result.get(key)
    return [] if value is None else value


def pod_network(result: Mapping[str, Any], mac: str, mtu: int = 0) -> PodNetwork:
    """The guest NIC and pod IPs from the final ADD result: the IPs on the pod's ``eth0`` (or on no
    named interface), IPv4 first as the primary; ``mac`` and ``mtu`` are ``eth0``'s, read from the
    namespace."""
    interfaces = _list(result, "interfaces")
    if not isinstance(interfaces, list):
        raise CniError("CNI result: interfaces is not a list")
    eth0 = {
        i
        for i, itf in enumerate(interfaces)
        if isinstance(itf, dict) and itf.get("name") == IFNAME and itf.get("sandbox")
    }
    addresses: list[str] = []
    ips = _list(result, "ips")
    if not isinstance(ips, list):
        raise CniError("CNI result: ips is not a list")
    routes: list[Route] = []
    # each family's gateway (the first eth0 address of that family that names one): a route without
    # "gw" goes through it, as the plugins themselves configure such a route on eth0 (CNI's
    # ipam.ConfigureIface); left on-link, the guest would ARP for every address off its subnet
    gateways: dict[int, str] = {}
    for entry in ips:
        if not isinstance(entry, dict):
            raise CniError("CNI result: an ips entry is not an object")
        index = entry.get("interface")
        if index is not None and eth0 and index not in eth0:
            continue
        try:
            addresses.append(ipaddress.ip_interface(str(entry.get("address"))).with_prefixlen)
        except ValueError:
            raise CniError(f"CNI result: address {str(entry.get('address'))[:64]!r} is not a CIDR") from None
        if entry.get("gateway"):
            try:
                gateway = ipaddress.ip_address(str(entry["gateway"]))
            except ValueError:
                raise CniError(f"CNI result: gateway {str(entry['gateway'])[:64]!r} is not an address") from None
            gateways.setdefault(gateway.version, str(gateway))
    route_list = _list(result, "routes")
    if not isinstance(route_list, list):
        raise CniError("CNI result: routes is not a list")
    for entry in route_list:
        if not isinstance(entry, dict):
            raise CniError("CNI result: a routes entry is not an object")
        try:
            network = ipaddress.ip_network(str(entry.get("dst")), strict=False)
            gw = str(ipaddress.ip_address(entry["gw"])) if entry.get("gw") else gateways.get(network.version, "")
        except ValueError:
            raise CniError(f"CNI result: route {json.dumps(entry)[:128]} is not a route") from None
        routes.append(Route(network.with_prefixlen, gw))
    if not addresses:
        raise CniError("CNI result: the pod's eth0 got no IP address")
    return pod_network_of(mac, addresses, routes, mtu)
