"""A pod network in a namespace someone else made (shim/pod_networks.py with ``netns_path``), as
containerd's CRI plugin makes it when vmsandbox is its sandbox shim: real namespaces made here with
``ip netns add``, a veth pair with one end as their ``eth0``, no CNI and no guest. What matters: the
macvtap lands on that ``eth0`` and the guest's network is what ``eth0`` carries; detach, remove and
reconcile take the macvtap and the record only, never the namespace or its ``eth0``; anything but
a network namespace of its own is refused naming the path. One test boots a real guest in such a
namespace through the shim's own RunPodSandbox, in process (the CRI cannot give a namespace)."""

from __future__ import annotations

import json
import os
import secrets
import socket
import struct
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from shim import faults, server
from shim.config import ShimConfig
from shim.model import RemovePodSandbox, StopPodSandbox
from shim.pod_networks import PodNetworks
from shim.rpc.remove_pod_sandbox import remove_pod_sandbox
from shim.rpc.run_pod_sandbox import run_pod_sandbox
from shim.rpc.stop_pod_sandbox import stop_pod_sandbox
from shim.translate import inbound
from tests.cri_server import pods_for
from tests.shim_kit import LIBVIRT_URI, pod, q, require_host, state_dir, write_profiles
from vmsandbox.errors import InvalidArgument, VmSandboxError, WrongState
from vmsandbox.network import NamespaceOptions, Route
from vmsandbox.pod import PodMeta

pytestmark = [
    pytest.mark.integration,
    pytest.mark.exclusive,  # makes macvtaps on the host, which test_pod_network counts
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root"),
]

META = PodMeta(name="given", namespace="default", uid="uid-given")
POD = NamespaceOptions()
MAC = "0a:58:0a:e8:00:05"


def sh(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"{' '.join(argv)}: {done.stderr}"
    return done.stdout


@dataclass
class Netns:
    name: str
    host_end: str

    @property
    def path(self) -> str:
        return f"/run/netns/{self.name}"

    def ip(self, *argv: str) -> str:
        return sh("ip", "-n", self.name, *argv)

    def eth0(self) -> dict[str, object]:
        (link,) = json.loads(self.ip("-j", "addr", "show", "dev", "eth0"))
        return link  # type: ignore[no-any-return]


@contextmanager
def made_netns(*, eth0: bool = True) -> Iterator[Netns]:
    tag = secrets.token_hex(3)
    ns = Netns(f"vmsgn-{tag}", f"vmsgn{tag}")
    sh("ip", "netns", "add", ns.name)
    try:
        if eth0:
            sh("ip", "link", "add", ns.host_end, "type", "veth", "peer", "name", "eth0", "netns", ns.name)
            ns.ip("link", "set", "dev", "eth0", "address", MAC, "mtu", "1450", "up")
            sh("ip", "link", "set", "dev", ns.host_end, "up")
        yield ns
    finally:
        subprocess.run(["ip", "link", "del", "dev", ns.host_end], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", ns.name], capture_output=True, check=False)


@pytest.fixture
def netns() -> Iterator[Netns]:
    """A namespace with a veth end as its eth0, an IPv4 address and a default route, as CNI's
    bridge plugin leaves one."""
    with made_netns() as ns:
        ns.ip("addr", "add", "10.232.0.5/24", "dev", "eth0")
        ns.ip("route", "add", "default", "via", "10.232.0.1")
        yield ns


@pytest.fixture
def networks(tmp_path: Path) -> PodNetworks:
    # pod_network "cni" with no configuration at all: a given namespace needs none
    return PodNetworks(ShimConfig(state_dir=str(tmp_path), pod_network="cni", cni_conf_dir=str(tmp_path / "net.d")))


def sandbox_id() -> str:
    return secrets.token_hex(32)


def macvtap(sid: str) -> str:
    return f"vmt{sid[:12]}"


def host_link(name: str) -> dict[str, object] | None:
    done = subprocess.run(["ip", "-j", "-d", "link", "show", "dev", name], capture_output=True, text=True)
    return json.loads(done.stdout)[0] if done.returncode == 0 else None


def record(networks: PodNetworks, sid: str) -> dict[str, object] | None:
    path = networks.records / f"{sid}.json"
    return json.loads(path.read_text()) if path.exists() else None


def untouched(ns: Netns) -> None:
    """The namespace is still there, its eth0 with its MAC and address, and no macvtap in it."""
    assert Path(ns.path).exists()
    eth0 = ns.eth0()
    assert eth0["address"] == MAC
    assert "10.232.0.5" in [a["local"] for a in eth0["addr_info"]]  # type: ignore[attr-defined]
    links = [link["ifname"] for link in json.loads(ns.ip("-j", "link", "show"))]
    assert sorted(links) == ["eth0", "lo"]


def test_the_macvtap_goes_on_the_given_eth0_and_the_guest_gets_what_eth0_carries(
    networks: PodNetworks, netns: Netns
) -> None:
    sid = sandbox_id()
    attached = networks.attach(sid, META, POD, (), {}, given_netns=netns.path)
    try:
        nic = attached.network.nic
        assert nic is not None
        assert (nic.mac, nic.addresses, nic.routes, nic.mtu) == (
            MAC,
            ("10.232.0.5/24",),
            (Route("0.0.0.0/0", "10.232.0.1"),),
            1450,
        )
        assert attached.network.ips == ("10.232.0.5",)
        assert attached.interface is not None
        assert (attached.interface.kind, attached.interface.mac, attached.interface.target_dev) == (
            "ethernet",
            MAC,
            macvtap(sid),
        )
        link = host_link(macvtap(sid))
        assert link is not None, "the macvtap is in the shim's namespace, for libvirt"
        info = link["linkinfo"]
        assert info["info_kind"] == "macvtap" and info["info_data"]["mode"] == "passthru"  # type: ignore[index]
        assert link["address"] == MAC
        assert record(networks, sid) == {
            "owner": "caller",
            "netns": netns.path,
            "macvtap": macvtap(sid),
            "state": "attached",
        }
        assert networks.link_counters(sid)[0][0] == "eth0"
    finally:
        networks.detach(sid)
    assert host_link(macvtap(sid)) is None
    assert record(networks, sid)["state"] == "deleted"  # type: ignore[index]
    untouched(netns)
    networks.remove(sid)
    assert record(networks, sid) is None
    untouched(netns)
    networks.remove(sid)  # idempotent


def test_ipv6_only_with_several_addresses(networks: PodNetworks) -> None:
    with made_netns() as ns:
        ns.ip("-6", "addr", "add", "fd00:232::5/64", "dev", "eth0", "nodad")
        ns.ip("-6", "addr", "add", "fd00:233::5/64", "dev", "eth0", "nodad")
        ns.ip("-6", "route", "add", "default", "via", "fd00:232::1")
        sid = sandbox_id()
        attached = networks.attach(sid, META, POD, (), {}, given_netns=ns.path)
        try:
            # in the order ip lists them (the kernel puts the newest IPv6 address first)
            assert sorted(attached.network.ips) == ["fd00:232::5", "fd00:233::5"]
            assert attached.network.nic is not None
            assert attached.network.nic.routes == (Route("::/0", "fd00:232::1"),)
        finally:
            networks.remove(sid)
        assert host_link(macvtap(sid)) is None and Path(ns.path).exists()


def test_with_pod_network_none_a_given_namespace_is_still_the_pods(tmp_path: Path, netns: Netns) -> None:
    networks = PodNetworks(ShimConfig(state_dir=str(tmp_path), pod_network="none"))
    sid = sandbox_id()
    try:
        assert networks.attach(sid, META, POD, (), {}, given_netns=netns.path).network.ips == ("10.232.0.5",)
    finally:
        networks.remove(sid)


def test_a_failure_after_the_macvtap_is_undone_and_leaves_the_namespace(networks: PodNetworks, netns: Netns) -> None:
    sid = sandbox_id()
    with faults.raising("network:given-macvtap"), pytest.raises(VmSandboxError) as err:
        networks.attach(sid, META, POD, (), {}, given_netns=netns.path)
    assert str(err.value).startswith("pod network: ")
    assert host_link(macvtap(sid)) is None and record(networks, sid) is None
    untouched(netns)


def test_a_shim_that_died_attached_is_cleaned_up_by_reconcile(
    tmp_path: Path, networks: PodNetworks, netns: Netns
) -> None:
    sid = sandbox_id()
    networks.attach(sid, META, POD, (), {}, given_netns=netns.path)
    doc = record(networks, sid)
    assert doc is not None
    doc["state"] = "adding"  # as a shim killed between the macvtap and the record's update leaves it
    (networks.records / f"{sid}.json").write_text(json.dumps(doc))
    again = PodNetworks(ShimConfig(state_dir=str(tmp_path), pod_network="cni"))
    assert again.reconcile(set()) == [sid]
    assert host_link(macvtap(sid)) is None and record(again, sid) is None
    untouched(netns)


def test_a_live_sandbox_is_left_alone_by_reconcile(networks: PodNetworks, netns: Netns) -> None:
    sid = sandbox_id()
    networks.attach(sid, META, POD, (), {}, given_netns=netns.path)
    try:
        assert networks.reconcile({sid}) == []
        assert host_link(macvtap(sid)) is not None
    finally:
        networks.remove(sid)


# -- refusals ----------------------------------------------------------------------------------------
def _refused(networks: PodNetworks, path: str, error: type[VmSandboxError] = InvalidArgument) -> str:
    sid = sandbox_id()
    with pytest.raises(error) as err:
        networks.attach(sid, META, POD, (), {}, given_netns=path)
    assert record(networks, sid) is None and host_link(macvtap(sid)) is None
    return str(err.value)


def test_a_path_that_is_not_a_network_namespace_is_refused_naming_it(
    tmp_path: Path, networks: PodNetworks, netns: Netns
) -> None:
    regular = tmp_path / "regular"
    regular.write_text("")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    link = tmp_path / "link"
    link.symlink_to(netns.path)
    cases = {
        str(tmp_path / "absent"): "no such file",
        str(regular): "is not a network namespace: not a namespace file",
        str(tmp_path): "is not a network namespace: not a namespace file",
        str(fifo): "is not a network namespace: not a namespace file",  # never opened: it would block
        "/dev/null": "is not a network namespace: not a namespace file",
        str(link): "is a symbolic link",
        "/proc/self/ns/net": "is a symbolic link",
        "relative/netns": "is not absolute",
    }
    for path, says in cases.items():
        message = _refused(networks, path)
        assert path in message and says in message, (path, message)


def test_a_namespace_of_another_kind_is_refused(tmp_path: Path, networks: PodNetworks) -> None:
    uts = tmp_path / "uts"
    uts.touch()
    sh("unshare", f"--uts={uts}", "true")
    try:
        message = _refused(networks, str(uts))
        assert "is a uts namespace, not a network namespace" in message
    finally:
        sh("umount", str(uts))


def test_the_shims_own_network_namespace_is_refused(tmp_path: Path, networks: PodNetworks) -> None:
    own = tmp_path / "own"
    own.touch()
    sh("mount", "--bind", "/proc/self/ns/net", str(own))
    try:
        assert "is the shim's own" in _refused(networks, str(own))
    finally:
        sh("umount", str(own))


def test_a_host_network_pod_cannot_be_given_a_namespace(networks: PodNetworks, netns: Netns) -> None:
    sid = sandbox_id()
    with pytest.raises(InvalidArgument) as err:
        networks.attach(sid, META, NamespaceOptions(network="NODE"), (), {}, given_netns=netns.path)
    assert "host-network pod" in str(err.value) and record(networks, sid) is None


def test_a_namespace_without_eth0_or_without_an_address_is_refused(networks: PodNetworks) -> None:
    with made_netns(eth0=False) as empty:
        message = _refused(networks, empty.path, WrongState)
        assert empty.path in message and "there is no eth0 (its interfaces: lo)" in message
    with made_netns() as bare:  # eth0 up with its IPv6 link-local address only
        message = _refused(networks, bare.path, WrongState)
        assert bare.path in message and "eth0 has no global IPv4 or IPv6 address" in message
        assert [link["ifname"] for link in json.loads(bare.ip("-j", "link", "show"))] == ["lo", "eth0"]


# -- a real guest ------------------------------------------------------------------------------------
def _checksum(data: bytes) -> int:
    total = sum(int.from_bytes(data[i : i + 2], "big") for i in range(0, len(data) - 1, 2))
    total += data[-1] << 8 if len(data) % 2 else 0
    total = (total >> 16) + (total & 0xFFFF)
    return ~(total + (total >> 16)) & 0xFFFF


def echo_answered(address: str, attempts: int = 10) -> bool:
    """Whether ``address`` answers an ICMP echo (a raw socket: this host has no ping)."""
    ident = os.getpid() & 0xFFFF
    with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP) as s:
        s.settimeout(1.0)
        for seq in range(attempts):
            body = struct.pack("!BBHHH", 8, 0, 0, ident, seq) + b"vmsandbox"
            s.sendto(body[:2] + struct.pack("!H", _checksum(body)) + body[4:], (address, 0))
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                try:
                    packet, (source, _) = s.recvfrom(1500)
                except TimeoutError:
                    break
                icmp = packet[(packet[0] & 0x0F) * 4 :]
                if source == address and icmp[0] == 0 and struct.unpack("!H", icmp[4:6])[0] == ident:
                    return True
    return False


@pytest.mark.slow
def test_a_guest_booted_in_a_given_namespace_carries_eth0s_address_and_answers_on_it(
    tmp_path: Path, netns: Netns
) -> None:
    require_host()
    sh("ip", "addr", "add", "10.232.0.1/24", "dev", netns.host_end)  # the gateway, on the host's end
    profiles = tmp_path / "profiles.yaml"
    write_profiles(profiles)
    config = ShimConfig(
        socket_path=str(tmp_path / "cri.sock"),
        state_dir=str(state_dir(tmp_path)),
        console_dir=str(tmp_path / "console"),
        libvirt_uri=LIBVIRT_URI,
        profile_files=(str(profiles),),
        pod_network="none",  # the shim's own networks: none; the given namespace is the pod's all the same
    )
    running = server.start(config)
    try:
        pods = pods_for(running.sandboxes)
        request = inbound.run_pod_sandbox(
            pb.RunPodSandboxRequest(config=pod("given", containers=[("c", q({"cpu": "250m", "memory": "32Mi"}))]))
        )
        sid = run_pod_sandbox(pods, replace(request, given_netns=netns.path))
        try:
            sandbox = running.sandboxes.records.get(sid)
            assert sandbox.network is not None and sandbox.network.ips == ("10.232.0.5",)
            nics = [n for n in sandbox.guest["nics"] if n["mac"] == MAC]
            assert len(nics) == 1 and nics[0]["up"], sandbox.guest["nics"]
            assert nics[0]["addresses"][:1] == ["10.232.0.5/24"]
            # through the macvtap: the host's end of the veth reaches the guest
            assert echo_answered("10.232.0.5"), "the guest did not answer an ICMP echo through its macvtap"
        finally:
            stop_pod_sandbox(pods, StopPodSandbox(sid))
            remove_pod_sandbox(pods, RemovePodSandbox(sid))
        assert host_link(macvtap(sid)) is None and record(running.sandboxes.network, sid) is None
        untouched(netns)
    finally:
        running.stop(grace=0)


# -- the first tests of a given namespace (shim mode), as they were written --------------------------
SID = "a1" * 32
META_P = PodMeta(name="p", namespace="n", uid="u", attempt=0)


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def namespace() -> Iterator[Path]:
    name = f"vmst-{secrets.token_hex(4)}"
    peer = f"vp{secrets.token_hex(4)}"
    ip("netns", "add", name)
    try:
        ip("link", "add", peer, "type", "veth", "peer", "name", "eth0", "netns", name)
        ip("-n", name, "addr", "add", "10.230.0.5/24", "dev", "eth0")
        ip("-n", name, "link", "set", "eth0", "up")
        ip("-n", name, "route", "add", "default", "via", "10.230.0.1")
        yield Path("/run/netns") / name
    finally:
        subprocess.run(["ip", "link", "del", peer], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


def networks_at(tmp_path: Path) -> PodNetworks:
    return PodNetworks(ShimConfig(state_dir=str(tmp_path), pod_network="cni", cni_conf_dir=str(tmp_path / "none")))


def macvtaps() -> set[str]:
    return {p.name for p in Path("/sys/class/net").iterdir() if p.name == f"vmt{SID[:12]}"}


def test_the_guest_gets_the_given_namespaces_address_and_leaves_it_as_it_was(tmp_path: Path, namespace: Path) -> None:
    nets = networks_at(tmp_path)
    att = nets.attach(SID, META_P, NamespaceOptions(), (), {}, str(namespace))
    try:
        assert att.network.ips == ("10.230.0.5",)
        assert att.network.nic is not None
        assert att.network.nic.addresses == ("10.230.0.5/24",)
        assert att.network.nic.routes == (Route("0.0.0.0/0", "10.230.0.1"),)
        assert att.interface is not None and att.interface.target_dev == f"vmt{SID[:12]}"
        assert macvtaps() == {f"vmt{SID[:12]}"}
    finally:
        nets.detach(SID)
        nets.remove(SID)
    assert macvtaps() == set() and namespace.exists()
    out = subprocess.run(["ip", "-n", namespace.name, "-br", "addr", "show", "eth0"], capture_output=True, text=True)
    assert "10.230.0.5/24" in out.stdout  # containerd's CNI attachment is containerd's to delete
    assert not (tmp_path / "network" / f"{SID}.json").exists()


def test_not_a_namespace_is_refused(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.write_text("")
    with pytest.raises(InvalidArgument, match="not a network namespace"):
        networks_at(tmp_path).attach(SID, META_P, NamespaceOptions(), (), {}, str(plain))


def test_a_namespace_without_eth0_leaves_nothing(tmp_path: Path) -> None:
    name = f"vmst-{secrets.token_hex(4)}"
    ip("netns", "add", name)
    try:
        with pytest.raises(VmSandboxError, match="eth0"):
            networks_at(tmp_path).attach(SID, META_P, NamespaceOptions(), (), {}, f"/run/netns/{name}")
        assert macvtaps() == set() and not (tmp_path / "network" / f"{SID}.json").exists()
    finally:
        ip("netns", "del", name)
