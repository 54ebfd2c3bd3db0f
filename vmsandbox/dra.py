"""vmsandbox as a Dynamic Resource Allocation driver: its settings, the devices it publishes, and
what a prepared claim is (pure).

* ``DraConfig``: the driver's name, the kubelet's plugin directories, the API server credential
  and the node; the driver is off unless a kubeconfig is given.
* ``NetworkAttachment``: a secondary network the admin defines (a bridge or a macvlan on a host
  interface, addresses from CNI host-local on a subnet); each is one device of the node's
  ``networks`` pool, published as a ``resource.k8s.io/v1`` ResourceSlice (``network_slice``).
* ``prepared_claim``: a ResourceClaim as the API server returns it (JSON) checked against what the
  kubelet asked to prepare, reduced to what the VM will need: the pods it is reserved for, each
  device allocated to this driver on this node's network pool, and the opaque configuration that
  applies to it (``NetworkConfig``: the interface's name inside the pod and static addresses), or
  on its PCI pool (``is_pci``: a passthrough device, ``vmsandbox.dra_pci``; named by
  ``pci_device_name``, its status by ``pci_device_status``).
* ``claim_record`` / ``claim_from_record``: a prepared claim as the store keeps it.
* ``claimed_nics``: what a pod's prepared claims put in its VM at RunPodSandbox, one NIC per
  network device (a tap on the network's bridge, or a macvtap on its host interface, both made and
  removed by libvirt with the domain), each with a MAC of its own, the name and addresses the guest
  gives it; ``claimed_nic_args`` is how the guest's /init is told (its kernel command line).
* ``plan_claims``: what ``vmsandbox plan`` shows of a pod's ResourceClaims, from the claim and
  template manifests beside it: each request of a class of this driver, the networks that could
  serve it and the config it would get.

Every input is bounded and checked; a failure is ``InvalidArgument`` naming the field.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vmsandbox import validation
from vmsandbox.agent_protocol import NicReport
from vmsandbox.errors import InvalidArgument, Unsupported, WrongState
from vmsandbox.host import parse_pci_address

DEFAULT_DRIVER = "vmsandbox.dev"
NETWORK_POOL_SUFFIX = "networks"
PCI_POOL_SUFFIX = "pci"  # the node's passthrough devices (vmsandbox.dra_pci)
MAX_PCI_POOLS = 16
NETWORK_KINDS = ("bridge", "macvlan")
MACVLAN_MODES = ("bridge", "vepa", "private", "passthru")
MAX_NETWORKS = 64
MAX_RESULTS = 64  # devices of one claim (the API's own bound is 32 allocation results per claim)
MAX_CONFIGS = 64
MAX_ADDRESSES = 16
MAX_RESERVED = 256  # the API's own bound on status.reservedFor
_IFNAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,14}")  # Linux: at most 15 bytes, no '/' or space
_UID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@dataclass(frozen=True)
class NetworkAttachment:
    """One secondary network: ``kind`` bridge (``interface`` is a host bridge) or macvlan (on host
    interface ``interface``, in ``mode``), addresses from ``subnet`` by CNI host-local."""

    name: str
    kind: str
    interface: str
    subnet: str
    gateway: str = ""
    mode: str = "bridge"  # macvlan only
    range_start: str = ""  # host-local's range within the subnet (empty: its whole subnet)
    range_end: str = ""


@dataclass(frozen=True)
class DraConfig:
    driver_name: str = DEFAULT_DRIVER
    kubeconfig: str = ""  # the API server credential; empty: the driver is off
    plugins_registry_dir: str = "/var/lib/kubelet/plugins_registry"
    plugins_dir: str = "/var/lib/kubelet/plugins"
    node_name: str = ""  # empty: the host's name, lower case
    networks: tuple[NetworkAttachment, ...] = ()
    pci_pools: tuple[str, ...] = ()  # device_pools whose IOMMU groups are published (vmsandbox.dra_pci)
    nri_socket: str = ""  # containerd's NRI socket: ordinary pods' claimed devices (shim.dra.nri_plugin); "": none
    ipam_dir: str = ""  # host-local's dataDir for claimed NICs; empty: <state_dir>/dra/ipam

    @property
    def enabled(self) -> bool:
        return bool(self.kubeconfig)


@dataclass(frozen=True)
class NetworkConfig:
    """A claim's opaque parameters for a network device: the interface's name in the pod, and
    static addresses (CIDRs) instead of host-local's."""

    interface_name: str = ""
    addresses: tuple[str, ...] = ()


@dataclass(frozen=True)
class PreparedDevice:
    request: str
    pool: str
    device: str
    config: NetworkConfig = NetworkConfig()
    share_id: str = ""  # this claim's share of a device allocated more than once (a network: one per pod)
    allocated: tuple[str, ...] = ()  # CIDRs host-local gave a device without static addresses


IPAM_ADDING = "adding"  # the claim's host-local ADDs may have run (a crash here: DEL them, the claim is not prepared)
IPAM_ADDED = "added"  # every device without static addresses has its ``allocated`` addresses


@dataclass(frozen=True)
class PreparedClaim:
    uid: str
    namespace: str
    name: str
    pod_uids: tuple[str, ...]
    devices: tuple[PreparedDevice, ...]
    ipam: str = ""  # "": no device of it takes addresses from host-local; else IPAM_ADDING or IPAM_ADDED


MAX_CLAIMED_NICS = 8
MAX_CLAIMED_NIC_ARGS = 1024  # characters of the guest's kernel command line (2048 in all on x86)
_MAC = re.compile(r"[0-9a-f]{2}(:[0-9a-f]{2}){5}")


@dataclass(frozen=True)
class ClaimedNic:
    """A claimed network device as the pod's VM gets it: ``kind`` bridge (a tap on bridge
    ``host_interface``) or macvlan (a macvtap on ``host_interface`` in ``mode``); in the guest, the
    NIC with ``mac`` is renamed ``name`` and given ``addresses``."""

    claim: str  # namespace/name
    device: str  # the network's name
    kind: str
    host_interface: str
    mode: str
    mac: str
    name: str
    addresses: tuple[str, ...]


def claimed_mac(sandbox_id: str, claim_uid: str, index: int) -> str:
    """A locally administered unicast MAC for a sandbox's ``index``-th claimed device: from a hash,
    so pods on one secondary network do not share one."""
    digest = hashlib.sha256(f"{sandbox_id}/{claim_uid}/{index}".encode()).digest()
    return "02:" + ":".join(f"{b:02x}" for b in digest[:5])


def claimed_nics(
    pod: str,
    sandbox_id: str,
    claims: Sequence[PreparedClaim],
    networks: Sequence[NetworkAttachment],
    planned: bool = False,
) -> tuple[ClaimedNic, ...]:
    """The NICs a pod's prepared claims put in its VM, in the claims' order. A device that cannot
    be attached as claimed is refused by name: its network no longer configured or, without static
    addresses, none from host-local (its NodePrepareResources did not finish: WrongState), an
    address outside the network's subnet or two NICs with one name (InvalidArgument), too many.
    ``planned``: ``vmsandbox plan``'s, where host-local has not run (such a NIC has no addresses)."""
    by_name = {n.name: n for n in networks}
    devices = [(c, d) for c in claims for d in c.devices]
    if len(devices) > MAX_CLAIMED_NICS:
        raise Unsupported(f"pod {pod} claims {len(devices)} network devices; a VM takes at most {MAX_CLAIMED_NICS}")
    explicit = {d.config.interface_name for _, d in devices if d.config.interface_name}
    nics: list[ClaimedNic] = []
    used: set[str] = set()
    auto = 1
    for index, (claim, device) in enumerate(devices):
        what = f"claim {claim.namespace}/{claim.name} device {device.device} (request {device.request})"
        network = by_name.get(device.device)
        if network is None:
            raise WrongState(f"pod {pod}: {what}: network {device.device} is not configured on this node any more")
        addresses = device.config.addresses or device.allocated
        if not addresses and not planned:
            raise WrongState(
                f"pod {pod}: {what} has no static addresses and none from host-local on network {network.name}: "
                "its claim was not prepared to the end (NodePrepareResources runs again)"
            )
        subnet = ipaddress.ip_network(network.subnet)
        for address in addresses:
            try:
                inside = ipaddress.ip_interface(address).ip in subnet
            except ValueError:
                inside = False
            if not inside:
                raise InvalidArgument(
                    f"pod {pod}: {what}: address {validation.quote(address)} is not in {network.subnet}"
                )
        name = device.config.interface_name
        if not name:
            while f"net{auto}" in explicit or f"net{auto}" in used:
                auto += 1
            name = f"net{auto}"
        if name in used:
            raise InvalidArgument(f"pod {pod}: {what}: interface name {name} is given to two claimed devices")
        used.add(name)
        nics.append(
            ClaimedNic(
                claim=f"{claim.namespace}/{claim.name}",
                device=network.name,
                kind=network.kind,
                host_interface=network.interface,
                mode=network.mode,
                mac=claimed_mac(sandbox_id, claim.uid, index),
                name=name,
                addresses=addresses,
            )
        )
    claimed_nic_args(tuple(nics))  # refused here, before anything is held, when they do not fit
    return tuple(nics)


def claimed_nic_args(nics: tuple[ClaimedNic, ...]) -> tuple[str, ...]:
    """The guest kernel command line's parameters for claimed NICs, read by its /init
    (``images/guest/init``): ``vmsandbox.xnic=MAC,NAME,CIDR[,CIDR...]``, one per NIC. Each value is
    checked so none can split or extend the command line (InvalidArgument)."""
    args = []
    for nic in nics:
        if not _MAC.fullmatch(nic.mac) or not _IFNAME.fullmatch(nic.name) or nic.name in ("eth0", "lo"):
            raise InvalidArgument(
                f"claimed NIC {validation.quote(nic.name)} ({validation.quote(nic.mac)}): bad name or MAC"
            )
        try:
            cidrs = [ipaddress.ip_interface(a).with_prefixlen for a in nic.addresses]
        except ValueError as exc:
            raise InvalidArgument(f"claimed NIC {nic.name}: {exc}") from None
        args.append(f"vmsandbox.xnic={','.join([nic.mac, nic.name, *cidrs])}")
    if sum(len(a) + 1 for a in args) > MAX_CLAIMED_NIC_ARGS:
        raise Unsupported(
            f"the claimed NICs' names and addresses take more than {MAX_CLAIMED_NIC_ARGS} characters of the guest's "
            "kernel command line"
        )
    return tuple(args)


def claimed_nic_problems(nics: Sequence[ClaimedNic], reported: Sequence[NicReport]) -> list[str]:
    """What the guest's report (its NICs, by MAC) says is wrong with its claimed NICs: missing,
    misnamed, down, or without an address it was given. Empty: each is as claimed."""
    by_mac = {r.mac.lower(): r for r in reported}
    problems = []
    for nic in nics:
        got = by_mac.get(nic.mac)
        if got is None:
            problems.append(f"{nic.name} ({nic.mac}, claim {nic.claim}): not in the guest")
            continue
        if got.name != nic.name:
            problems.append(f"{nic.name} ({nic.mac}): named {validation.quote(got.name[:40])} in the guest")
        if not got.up:
            problems.append(f"{nic.name} ({nic.mac}): down in the guest")
        have = set()
        for a in got.addresses:
            with contextlib.suppress(ValueError):
                have.add(ipaddress.ip_interface(a))
        missing = [a for a in nic.addresses if ipaddress.ip_interface(a) not in have]
        if missing:
            problems.append(f"{nic.name} ({nic.mac}): without {', '.join(missing)} in the guest")
    return problems


# ---- settings ----------------------------------------------------------------------------------


def _string(data: Mapping[str, Any], key: str, where: str, default: str | None = None) -> str:
    value = data.get(key, default)
    if value is None:
        raise InvalidArgument(f"{where}.{key}: missing")
    if not isinstance(value, str):
        raise InvalidArgument(f"{where}.{key}: must be a string")
    return value


def parse_network(data: object, where: str) -> NetworkAttachment:
    if not isinstance(data, dict):
        raise InvalidArgument(f"{where}: must be a mapping (name, kind, interface, subnet)")
    unknown = sorted(set(data) - {"name", "kind", "interface", "subnet", "gateway", "mode", "range_start", "range_end"})
    if unknown:
        raise InvalidArgument(f"{where}.{unknown[0]}: unknown key")
    name = _string(data, "name", where)
    validation.dns1123_label(name, f"{where}.name")
    kind = _string(data, "kind", where)
    if kind not in NETWORK_KINDS:
        raise InvalidArgument(f"{where}.kind: must be one of {', '.join(NETWORK_KINDS)}")
    interface = _string(data, "interface", where)
    if not _IFNAME.fullmatch(interface):
        raise InvalidArgument(f"{where}.interface: {validation.quote(interface)} is not a host interface name")
    subnet = _string(data, "subnet", where)
    try:
        net = ipaddress.ip_network(subnet, strict=True)
    except ValueError:
        raise InvalidArgument(f"{where}.subnet: {validation.quote(subnet)} is not a network (CIDR)") from None
    gateway = _string(data, "gateway", where, "")
    if gateway:
        try:
            ok = ipaddress.ip_address(gateway) in net
        except ValueError:
            ok = False
        if not ok:
            raise InvalidArgument(f"{where}.gateway: {validation.quote(gateway)} is not an address of {subnet}")
    mode = _string(data, "mode", where, "bridge")
    if mode not in MACVLAN_MODES or (kind != "macvlan" and "mode" in data):
        raise InvalidArgument(f"{where}.mode: macvlan only, one of {', '.join(MACVLAN_MODES)}")
    ends = []
    for key in ("range_start", "range_end"):
        value = _string(data, key, where, "")
        try:
            ok = not value or ipaddress.ip_address(value) in net
        except ValueError:
            ok = False
        if not ok:
            raise InvalidArgument(f"{where}.{key}: {validation.quote(value)} is not an address of {subnet}")
        ends.append(value)
    if all(ends) and int(ipaddress.ip_address(ends[0])) > int(ipaddress.ip_address(ends[1])):
        raise InvalidArgument(f"{where}: range_start {ends[0]} is after range_end {ends[1]}")
    return NetworkAttachment(name, kind, interface, str(net), gateway, mode, ends[0], ends[1])


def parse_dra_config(data: object, source: str) -> DraConfig:
    """The ``dra`` mapping of the shim's configuration."""
    where = f"{source}: dra"
    if data is None:
        return DraConfig()
    if not isinstance(data, dict):
        raise InvalidArgument(f"{where}: must be a mapping")
    keys = {
        "driver_name",
        "kubeconfig",
        "kubelet_plugins_registry_dir",
        "kubelet_plugins_dir",
        "node_name",
        "networks",
        "pci_pools",
        "nri_socket",
        "ipam_dir",
    }
    unknown = sorted(set(data) - keys)
    if unknown:
        raise InvalidArgument(f"{where}.{unknown[0]}: unknown key (known: {', '.join(sorted(keys))})")
    driver = _string(data, "driver_name", where, DEFAULT_DRIVER)
    validation.dns1123_subdomain(driver, f"{where}.driver_name")
    paths = {}
    for key, default in (
        ("kubeconfig", ""),
        ("kubelet_plugins_registry_dir", DraConfig.plugins_registry_dir),
        ("kubelet_plugins_dir", DraConfig.plugins_dir),
        ("nri_socket", ""),
        ("ipam_dir", ""),
    ):
        value = _string(data, key, where, default)
        if value and not value.startswith("/"):
            raise InvalidArgument(f"{where}.{key}: must be an absolute path")
        paths[key] = value
    node = _string(data, "node_name", where, "")
    if node:
        validation.dns1123_subdomain(node, f"{where}.node_name")
    networks = data.get("networks")
    networks = [] if networks is None else networks
    if not isinstance(networks, list) or len(networks) > MAX_NETWORKS:
        raise InvalidArgument(f"{where}.networks: must be a list of at most {MAX_NETWORKS} networks")
    parsed = tuple(parse_network(n, f"{where}.networks[{i}]") for i, n in enumerate(networks))
    names = [n.name for n in parsed]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise InvalidArgument(f"{where}.networks: {dup[0]} is defined twice")
    pci_pools = data.get("pci_pools")
    pci_pools = [] if pci_pools is None else pci_pools
    if (
        not isinstance(pci_pools, list)
        or len(pci_pools) > MAX_PCI_POOLS
        or not all(isinstance(p, str) and p for p in pci_pools)
    ):
        raise InvalidArgument(f"{where}.pci_pools: must be a list of at most {MAX_PCI_POOLS} device_pools names")
    if len(set(pci_pools)) != len(pci_pools):
        raise InvalidArgument(f"{where}.pci_pools: a pool is named twice")
    return DraConfig(
        driver_name=driver,
        kubeconfig=paths["kubeconfig"],
        plugins_registry_dir=paths["kubelet_plugins_registry_dir"],
        plugins_dir=paths["kubelet_plugins_dir"],
        node_name=node,
        networks=parsed,
        pci_pools=tuple(pci_pools),
        nri_socket=paths["nri_socket"],
        ipam_dir=paths["ipam_dir"],
    )


# ---- ResourceSlices ----------------------------------------------------------------------------


def network_pool(node: str) -> str:
    return f"{node}-{NETWORK_POOL_SUFFIX}"


def pci_pool(node: str) -> str:
    return f"{node}-{PCI_POOL_SUFFIX}"


def is_pci(device: PreparedDevice) -> bool:
    """Whether a prepared device is a passthrough device (of a node's PCI pool), not a network."""
    return device.pool.endswith(f"-{PCI_POOL_SUFFIX}")


def slice_name(driver: str, node: str) -> str:
    """The object name of the node's network slice (a DNS subdomain: driver and node are)."""
    name = f"{node}-{driver}-{NETWORK_POOL_SUFFIX}"
    validation.dns1123_subdomain(name, "resourceslice name")
    return name


def network_device(driver: str, network: NetworkAttachment) -> dict[str, Any]:
    """One ResourceSlice device (resource.k8s.io/v1 ``Device``) for a network attachment."""
    domain = driver
    return {
        "name": network.name,
        # every pod on a network gets its own share (its own NIC): the scheduler may allocate the device
        # to many claims at once (DRAConsumableCapacity, on by default since 1.36), each with a shareID
        "allowMultipleAllocations": True,
        "attributes": {
            f"{domain}/type": {"string": "network"},
            f"{domain}/kind": {"string": network.kind},
            f"{domain}/interface": {"string": network.interface},
            f"{domain}/subnet": {"string": network.subnet},
        },
    }


def network_slice(driver: str, node: str, networks: tuple[NetworkAttachment, ...], generation: int) -> dict[str, Any]:
    """The node's network pool as one ResourceSlice (the whole pool: resourceSliceCount 1)."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": slice_name(driver, node), "labels": {"app.kubernetes.io/managed-by": driver}},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": network_pool(node), "generation": generation, "resourceSliceCount": 1},
            "devices": [network_device(driver, n) for n in networks],
        },
    }


def slice_differs(current: Mapping[str, Any], wanted: Mapping[str, Any]) -> bool:
    """Whether the slice the API server has is not the one we publish: its node, its pool, its devices'
    names and attributes (fields an API server without a feature gate drops are not compared)."""
    spec = current.get("spec")
    want = wanted["spec"]
    if not isinstance(spec, dict) or not isinstance(spec.get("devices"), list):
        return True

    def devices(items: list[Any]) -> list[Any]:
        return [(d.get("name"), d.get("attributes")) if isinstance(d, dict) else None for d in items]

    return (
        any(spec.get(k) != want[k] for k in ("driver", "nodeName"))
        or devices(spec["devices"]) != devices(want["devices"])
        or not isinstance(spec.get("pool"), dict)
        or spec["pool"].get("name") != want["pool"]["name"]
    )


# ---- claims ------------------------------------------------------------------------------------


def get_path(data: object, path: str) -> Any:
    """data[a][b]... for ``a.b``; None where a step is missing or not a mapping."""
    for key in path.split("."):
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


def check_claim_ref(namespace: str, name: str, uid: str) -> None:
    """What the kubelet passes for a claim."""
    validation.dns1123_label(namespace, "claim namespace")
    validation.dns1123_subdomain(name, "claim name")
    claim_uid(uid)


def claim_uid(uid: str) -> None:
    if not isinstance(uid, str) or not _UID.fullmatch(uid):
        raise InvalidArgument(f"claim uid: {validation.quote(str(uid))} is not a uid")


def parse_network_config(params: object, where: str) -> NetworkConfig:
    if params is None:
        return NetworkConfig()
    if not isinstance(params, dict):
        raise InvalidArgument(f"{where}: must be an object (interfaceName, addresses)")
    unknown = sorted(set(params) - {"apiVersion", "kind", "interfaceName", "addresses"})
    if unknown:
        raise InvalidArgument(f"{where}.{validation.quote(str(unknown[0]))}: unknown field")
    ifname = params.get("interfaceName", "")
    if not isinstance(ifname, str) or (ifname and (not _IFNAME.fullmatch(ifname) or ifname in ("lo", "eth0"))):
        raise InvalidArgument(f"{where}.interfaceName: {validation.quote(str(ifname))} is not an interface name")
    addresses = params.get("addresses", [])
    if not isinstance(addresses, list) or len(addresses) > MAX_ADDRESSES:
        raise InvalidArgument(f"{where}.addresses: must be a list of at most {MAX_ADDRESSES} CIDRs")
    out = []
    for i, text in enumerate(addresses):
        try:
            if not isinstance(text, str) or "/" not in text:
                raise ValueError
            out.append(str(ipaddress.ip_interface(text)))
        except ValueError:
            raise InvalidArgument(f"{where}.addresses[{i}]: {validation.quote(str(text))} is not a CIDR") from None
    return NetworkConfig(ifname, tuple(out))


def _applies(config_requests: object, request: str) -> bool:
    if config_requests is None or config_requests == []:
        return True  # no requests named: every request of the claim
    if not isinstance(config_requests, list):
        return False
    return any(isinstance(r, str) and (r == request or request.startswith(r + "/")) for r in config_requests)


def _device_config(configs: list[Any], driver: str, request: str, where: str) -> NetworkConfig:
    """The opaque configuration for one device: FromClass entries first, then FromClaim (the claim's
    win), each later entry overriding field by field (as the API documents its order)."""
    merged = NetworkConfig()
    for source in ("FromClass", "FromClaim"):
        for i, entry in enumerate(configs):
            if not isinstance(entry, dict) or entry.get("source") != source:
                continue
            opaque = entry.get("opaque")
            if not isinstance(opaque, dict) or opaque.get("driver") != driver:
                continue
            if not _applies(entry.get("requests"), request):
                continue
            got = parse_network_config(opaque.get("parameters"), f"{where}.config[{i}].opaque.parameters")
            merged = NetworkConfig(
                got.interface_name or merged.interface_name,
                got.addresses or merged.addresses,
            )
    return merged


def prepared_claim(
    claim: object,
    namespace: str,
    name: str,
    uid: str,
    driver: str,
    node: str,
    devices: frozenset[str],
    pci_devices: frozenset[str] = frozenset(),
) -> PreparedClaim:
    """A ResourceClaim read from the API server, as this node prepares it: the claim the kubelet
    named (same namespace, name and uid), allocated, reserved for at least one pod; of its
    allocation results those of ``driver``, each on this node's network pool and naming one of
    ``devices``, or on its PCI pool and naming one of ``pci_devices`` (a whole IOMMU group, never
    shared). The results of other drivers are theirs."""
    check_claim_ref(namespace, name, uid)
    where = f"resourceclaim {namespace}/{name}"
    meta = get_path(claim, "metadata")
    if not isinstance(meta, dict) or meta.get("namespace") != namespace or meta.get("name") != name:
        raise InvalidArgument(f"{where}: the API server answered another object")
    if meta.get("uid") != uid:
        raise InvalidArgument(f"{where}: its uid is not {validation.quote(uid)} (the claim was replaced)")
    allocation = get_path(claim, "status.allocation")
    if not isinstance(allocation, dict):
        raise InvalidArgument(f"{where}: not allocated")
    reserved = get_path(claim, "status.reservedFor") or []
    if not isinstance(reserved, list) or len(reserved) > MAX_RESERVED:
        raise InvalidArgument(f"{where}: status.reservedFor: must be a list")
    pods = []
    for i, ref in enumerate(reserved):
        if not isinstance(ref, dict):
            raise InvalidArgument(f"{where}: status.reservedFor[{i}]: must be an object")
        if ref.get("resource") != "pods" or ref.get("apiGroup", "") not in ("", None):
            continue
        pod_uid = ref.get("uid")
        if not isinstance(pod_uid, str):
            raise InvalidArgument(f"{where}: status.reservedFor[{i}].uid: missing")
        validation.uid(pod_uid, f"{where}: status.reservedFor[{i}].uid")
        if pod_uid not in pods:
            pods.append(pod_uid)
    if not pods:
        raise InvalidArgument(f"{where}: reserved for no pod")
    if len(pods) > 1:  # a device of this driver is a NIC of one VM
        raise InvalidArgument(f"{where}: reserved for {len(pods)} pods; a vmsandbox.dev claim serves one pod")
    results = get_path(allocation, "devices.results") or []
    configs = get_path(allocation, "devices.config") or []
    if not isinstance(results, list) or len(results) > MAX_RESULTS:
        raise InvalidArgument(f"{where}: status.allocation.devices.results: must be a list of at most {MAX_RESULTS}")
    if not isinstance(configs, list) or len(configs) > MAX_CONFIGS:
        raise InvalidArgument(f"{where}: status.allocation.devices.config: must be a list of at most {MAX_CONFIGS}")
    pool = network_pool(node)
    out = []
    for i, result in enumerate(results):
        at = f"{where}: status.allocation.devices.results[{i}]"
        if not isinstance(result, dict):
            raise InvalidArgument(f"{at}: must be an object")
        if result.get("driver") != driver:
            continue
        request, res_pool, device = (result.get(k) for k in ("request", "pool", "device"))
        if not all(isinstance(v, str) and v for v in (request, res_pool, device)):
            raise InvalidArgument(f"{at}: request, pool and device must be given")
        assert isinstance(request, str) and isinstance(res_pool, str) and isinstance(device, str)
        validation.text(request, f"{at}.request", 127)
        share = result.get("shareID", "")
        if res_pool == pci_pool(node):
            if device not in pci_devices:
                raise InvalidArgument(f"{at}: PCI device {validation.quote(device)} is not published by this node")
            if share:
                raise InvalidArgument(f"{at}: PCI device {device} has a shareID; a passthrough device is not shared")
            out.append(PreparedDevice(request, res_pool, device))
            continue
        if res_pool != pool:
            raise InvalidArgument(f"{at}: pool {validation.quote(res_pool)} is not this node's ({pool})")
        if device not in devices:
            raise InvalidArgument(f"{at}: device {validation.quote(device)} is not published by this node")
        if not isinstance(share, str):
            raise InvalidArgument(f"{at}.shareID: must be a string")
        if share:
            validation.uid(share, f"{at}.shareID")
        out.append(PreparedDevice(request, res_pool, device, _device_config(configs, driver, request, where), share))
    if not out:
        raise InvalidArgument(f"{where}: no device of driver {driver} is allocated")
    return PreparedClaim(uid, namespace, name, tuple(pods), tuple(out))


def claim_record(claim: PreparedClaim) -> dict[str, Any]:
    return {
        "uid": claim.uid,
        "namespace": claim.namespace,
        "name": claim.name,
        "podUIDs": list(claim.pod_uids),
        "devices": [
            {
                "request": d.request,
                "pool": d.pool,
                "device": d.device,
                "interfaceName": d.config.interface_name,
                "addresses": list(d.config.addresses),
                "shareID": d.share_id,
                **({"allocated": list(d.allocated)} if d.allocated else {}),
            }
            for d in claim.devices
        ],
        **({"ipam": claim.ipam} if claim.ipam else {}),
    }


def claim_from_record(data: object) -> PreparedClaim:
    """A stored prepared claim, checked as anything read back from disk is."""
    if not isinstance(data, dict):
        raise InvalidArgument("prepared claim: must be an object")
    uid, namespace, name = (data.get(k) for k in ("uid", "namespace", "name"))
    if not all(isinstance(v, str) for v in (uid, namespace, name)):
        raise InvalidArgument("prepared claim: uid, namespace and name must be strings")
    assert isinstance(uid, str) and isinstance(namespace, str) and isinstance(name, str)
    check_claim_ref(namespace, name, uid)
    pods = data.get("podUIDs")
    if not isinstance(pods, list) or not pods or len(pods) > MAX_RESERVED:
        raise InvalidArgument("prepared claim: podUIDs must be a non-empty list")
    for pod in pods:
        validation.uid(pod if isinstance(pod, str) else "", "prepared claim: podUIDs")
    devices = data.get("devices")
    if not isinstance(devices, list) or not devices or len(devices) > MAX_RESULTS:
        raise InvalidArgument("prepared claim: devices must be a non-empty list")
    out = []
    for i, d in enumerate(devices):
        where = f"prepared claim: devices[{i}]"
        if not isinstance(d, dict) or not all(
            isinstance(d.get(k), str) and d[k] for k in ("request", "pool", "device")
        ):
            raise InvalidArgument(f"{where}: request, pool and device must be given")
        config = parse_network_config(
            {"interfaceName": d.get("interfaceName", ""), "addresses": d.get("addresses", [])}, where
        )
        share = d.get("shareID", "")
        if not isinstance(share, str):
            raise InvalidArgument(f"{where}.shareID: must be a string")
        if share:
            validation.uid(share, f"{where}.shareID")
        allocated = parse_network_config({"addresses": d.get("allocated", [])}, f"{where}.allocated").addresses
        out.append(PreparedDevice(d["request"], d["pool"], d["device"], config, share, allocated))
    ipam = data.get("ipam", "")
    if ipam not in ("", IPAM_ADDING, IPAM_ADDED):
        raise InvalidArgument(f"prepared claim: ipam: {validation.quote(str(ipam))} is not a state")
    return PreparedClaim(uid, namespace, name, tuple(pods), tuple(out), ipam)


# ---- plan --------------------------------------------------------------------------------------

NETWORK_CLASS = "vmsandbox-network"  # deploy/dra/deviceclass.yaml
PCI_CLASS = "vmsandbox-pci"  # deploy/dra/deviceclass.yaml: the passthrough devices (vmsandbox.dra_pci)


@dataclass(frozen=True)
class PlannedRequest:
    claim: str  # the pod's name for the claim
    source: str  # "template NAME", "claim NAME", or "" when its manifest was not given
    request: str
    device_class: str
    networks: tuple[str, ...]  # of this node's, those that could serve it; () when not this driver's class
    config: NetworkConfig = NetworkConfig()
    pci: bool = False  # a request of this driver's passthrough class (served by vmsandbox.dra_pci.planned_groups)


MAX_STATUS_IPS = 16  # the API's bound on networkData.ips


def claim_status(
    claim: PreparedClaim,
    driver: str,
    nics: Sequence[ClaimedNic],
    reported: Sequence[NicReport],
    now: str,
    where: str = "the pod's VM",
) -> dict[str, Any]:
    """The server-side apply body of ``claim``'s ``status.devices[]`` once its pod's guest is up
    (KEP-4817): for each of its devices (``nics`` in the same order), driver, pool, device, share
    id, a ``Ready`` condition and ``networkData`` as the guest reports the NIC (its name, CIDRs and
    MAC); a NIC the guest does not report is ``Ready`` ``False``. A passthrough device (``nics``
    has none for it) is ``Ready`` with its PCI address in ``data`` (``pci_device_status``).
    ``now``: RFC 3339; ``where`` the NIC is (an ordinary pod's: its network namespace, read as the
    guest's report is)."""
    devices = []
    by_mac = {r.mac.lower(): r for r in reported}
    network_devices = [d for d in claim.devices if not is_pci(d)]
    if len(network_devices) != len(nics):
        raise ValueError(f"claim {claim.uid}: {len(network_devices)} network devices, {len(nics)} NICs")
    in_order = iter(nics)
    for device in claim.devices:
        if is_pci(device):
            devices.append(pci_device_status(device, driver, now))
            continue
        nic = next(in_order)
        got = by_mac.get(nic.mac)
        if got is None:
            entry = _device_entry(
                device, driver, False, "NotInGuest", f"the guest does not report the NIC {nic.mac}", now
            )
        else:
            entry = _device_entry(device, driver, True, "NicUp", f"{got.name[:64]} is up in {where}", now)
            ips = []
            for a in got.addresses:
                with contextlib.suppress(ValueError):
                    ips.append(ipaddress.ip_interface(a).with_prefixlen)
            entry["networkData"] = {
                "interfaceName": got.name[:256],
                "ips": ips[:MAX_STATUS_IPS],
                "hardwareAddress": nic.mac,
            }
        devices.append(entry)
    return _status_patch(claim, devices)


PCI_DEVICE_PREFIX = "pci-"  # a passthrough device's name: pci-0000-3b-00-0 for 0000:3b:00.0


def pci_device_name(address: str) -> str:
    """A passthrough device's name in the node's PCI pool (a DNS label): its IOMMU group's primary
    function's address, ``:`` and ``.`` as ``-``."""
    return PCI_DEVICE_PREFIX + address.replace(":", "-").replace(".", "-")


def pci_address_of(name: str) -> str:
    """The PCI address a device name of the PCI pool stands for (the inverse of ``pci_device_name``);
    InvalidArgument for any other name."""
    parts = name.removeprefix(PCI_DEVICE_PREFIX).split("-")
    if name.startswith(PCI_DEVICE_PREFIX) and len(parts) == 4:
        address = f"{parts[0]}:{parts[1]}:{parts[2]}.{parts[3]}"
        with contextlib.suppress(ValueError):
            if parse_pci_address(address) == address:
                return address
    raise InvalidArgument(f"{validation.quote(name)} is not a PCI device name (pci-dddd-bb-ss-f)")


def pci_device_status(device: PreparedDevice, driver: str, now: str) -> dict[str, Any]:
    """A passthrough device's ``status.devices[]`` entry once its pod's VM runs with it: ``Ready``
    (reason ``Attached``) and its PCI address in ``data``."""
    address = pci_address_of(device.device)
    entry = _device_entry(device, driver, True, "Attached", f"{address} is passed through to the pod's VM", now)
    entry["data"] = {"pciAddress": address}
    return entry


def planned_nics(
    pod: str, sandbox_id: str, requests: Sequence[PlannedRequest], networks: Sequence[NetworkAttachment]
) -> tuple[ClaimedNic, ...]:
    """The NICs ``vmsandbox plan`` shows in the domain for a pod's requests of this driver's class:
    one on each network a request is given (``vmsandbox.dra_select`` picks them as the scheduler
    would), as ``claimed_nics`` makes them at RunPodSandbox, and refused as it refuses them."""
    claims = [
        PreparedClaim(
            f"planned-{i}",
            pod.split("/")[0],
            r.claim,
            (),
            tuple(PreparedDevice(r.request, "", n, r.config) for n in r.networks),
        )
        for i, r in enumerate(requests)
        if r.networks
    ]
    return claimed_nics(pod, sandbox_id, claims, networks, planned=True)


def _class_is_ours(name: str, docs: list[Any], driver: str) -> bool:
    for doc in docs:
        if isinstance(doc, dict) and doc.get("kind") == "DeviceClass" and get_path(doc, "metadata.name") == name:
            selectors = get_path(doc, "spec.selectors") or []
            return isinstance(selectors, list) and any(
                f'device.driver == "{driver}"' in str(get_path(sel, "cel.expression") or "") for sel in selectors
            )
    return name in (NETWORK_CLASS, PCI_CLASS)


def _class_is_pci(name: str, docs: list[Any]) -> bool:
    """Whether a class of this driver selects its passthrough devices (``type == "pci"``)."""
    for doc in docs:
        if isinstance(doc, dict) and doc.get("kind") == "DeviceClass" and get_path(doc, "metadata.name") == name:
            selectors = get_path(doc, "spec.selectors") or []
            return isinstance(selectors, list) and any(
                re.search(r"""\.type\s*==\s*["']pci["']""", str(get_path(sel, "cel.expression") or ""))
                for sel in selectors
            )
    return name == PCI_CLASS


def plan_claims(
    claims: tuple[tuple[str, str, str], ...],
    docs: list[Any],
    namespace: str,
    driver: str,
    networks: tuple[NetworkAttachment, ...],
) -> tuple[PlannedRequest, ...]:
    """Each request of each of the pod's claims (``PodManifest.resource_claims``), as the claim or
    template manifests among ``docs`` declare it. Selectors are not evaluated here: every configured
    network is a candidate for a request of this driver's class (``vmsandbox.dra_select`` evaluates them)."""
    out = []
    for name, template, claim_name in claims:
        kind, wanted = ("ResourceClaimTemplate", template) if template else ("ResourceClaim", claim_name)
        doc = next(
            (
                d
                for d in docs
                if isinstance(d, dict)
                and d.get("kind") == kind
                and get_path(d, "metadata.name") == wanted
                and (get_path(d, "metadata.namespace") or "default") == namespace
            ),
            None,
        )
        if doc is None:
            out.append(PlannedRequest(name, "", "", "", ()))
            continue
        spec = get_path(doc, "spec.spec" if template else "spec")
        where = f"{kind} {wanted}"
        requests = get_path(spec, "devices.requests") or []
        configs = get_path(spec, "devices.config") or []
        if not isinstance(requests, list) or not isinstance(configs, list):
            raise InvalidArgument(f"{where}: spec.devices.requests and config must be lists")
        claim_configs = [dict(c, source="FromClaim") if isinstance(c, dict) else c for c in configs]
        for i, req in enumerate(requests):
            req_name = get_path(req, "name")
            if not isinstance(req_name, str) or not req_name:
                raise InvalidArgument(f"{where}: spec.devices.requests[{i}].name: missing")
            choices = get_path(req, "firstAvailable")
            subs = (
                [(f"{req_name}/{get_path(c, 'name')}", get_path(c, "deviceClassName")) for c in choices]
                if isinstance(choices, list)
                else [(req_name, get_path(req, "exactly.deviceClassName"))]
            )
            for request, device_class in subs:
                if not isinstance(device_class, str):
                    raise InvalidArgument(f"{where}: request {validation.quote(request)}: no deviceClassName")
                ours = _class_is_ours(device_class, docs, driver)
                pci = ours and _class_is_pci(device_class, docs)
                ours = ours and not pci
                out.append(
                    PlannedRequest(
                        name,
                        f"{'template' if template else 'claim'} {wanted}",
                        request,
                        device_class,
                        tuple(n.name for n in networks) if ours else (),
                        _device_config(claim_configs, driver, request, where) if ours else NetworkConfig(),
                        pci,
                    )
                )
    return tuple(out)


MAX_CONDITION_MESSAGE = 1024  # of the API's 32768


def claim_failure_status(claim: PreparedClaim, driver: str, reason: str, message: str, now: str) -> dict[str, Any]:
    """The server-side apply body of ``claim``'s ``status.devices[]`` when its devices could not be
    given to its pod (RunPodSandbox failed: refused, not attached, or a NIC not as claimed in the
    guest): each device's ``Ready`` condition ``False`` with ``reason`` (a CamelCase word) and
    ``message`` (bounded), and no ``networkData`` or ``data`` (this manager's earlier ones go:
    server-side apply drops the fields it no longer sends)."""
    if not re.fullmatch(r"[A-Z][A-Za-z0-9]{0,63}", reason):
        raise InvalidArgument(f"condition reason {validation.quote(reason)} is not a CamelCase word")
    text = " ".join(message.split())
    if len(text) > MAX_CONDITION_MESSAGE:
        text = text[: MAX_CONDITION_MESSAGE - 1] + "…"
    return _status_patch(claim, [_device_entry(d, driver, False, reason, text, now) for d in claim.devices])


def _device_entry(
    device: PreparedDevice, driver: str, ready: bool, reason: str, message: str, now: str
) -> dict[str, Any]:
    """One ``status.devices[]`` entry: the device (its share id when shared) and its ``Ready`` condition."""
    entry: dict[str, Any] = {"driver": driver, "pool": device.pool, "device": device.device}
    if device.share_id:
        entry["shareID"] = device.share_id
    entry["conditions"] = [
        {"type": "Ready", "status": "True" if ready else "False", "reason": reason, "lastTransitionTime": now,
         "message": message}
    ]  # fmt: skip
    return entry


def _status_patch(claim: PreparedClaim, devices: list[dict[str, Any]]) -> dict[str, Any]:
    """The server-side apply document of a claim's ``status.devices[]`` (its uid a precondition)."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": claim.name, "namespace": claim.namespace, "uid": claim.uid},
        "status": {"devices": devices},
    }
