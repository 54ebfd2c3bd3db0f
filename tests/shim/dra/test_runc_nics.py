"""shim.dra.runc_nics: an ordinary pod's claimed devices made, recorded, rolled back on a failure,
removed at stop and by the reconcile, and its claims' status written; VM pods left alone. With a
fake of the host's links, and (as root) once with real ones: a bridge, a namespace, a veth pair."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from shim.dra.runc_nics import HostLinks, RuncNics
from shim.dra.store import ClaimStore
from vmsandbox.adapters.netns import NetnsError
from vmsandbox.agent_protocol import NicReport
from vmsandbox.dra import ClaimedNic, NetworkAttachment, NetworkConfig, PreparedClaim, PreparedDevice, claimed_mac
from vmsandbox.dra_runc import RuncPod, host_link_name
from vmsandbox.errors import InvalidArgument, WrongState

SB = "b" * 64
LAN = NetworkAttachment("lan", "bridge", "br-lan", "192.168.50.0/24")
FAST = NetworkAttachment("fast", "macvlan", "eth1", "10.9.0.0/16")


def _claim(uid: str, pod_uid: str, *devices: tuple[str, str, tuple[str, ...]]) -> PreparedClaim:
    return PreparedClaim(
        uid,
        "default",
        f"claim-{uid}",
        (pod_uid,),
        tuple(
            PreparedDevice(f"r{i}", "n-networks", d, NetworkConfig(n, a), f"share-{i}")
            for i, (d, n, a) in enumerate(devices)
        ),
    )


class FakeLinks:
    """The host's links as a list of calls; ``fail`` names a call that raises."""

    def __init__(self, fail: str = "") -> None:
        self.calls: list[tuple[str, ...]] = []
        self.fail = fail
        self.host: set[str] = set()
        self.inside: dict[str, str] = {}  # name -> MAC
        self.peers: dict[str, str] = {}  # a veth's host end -> its peer in the namespace

    @contextlib.contextmanager
    def hold(self, path: str) -> Iterator[Path]:
        self.calls.append(("hold", path))
        yield Path("/proc/self/fd/9")

    def _maybe_fail(self, call: str, what: str) -> None:
        if self.fail == call:
            raise NetnsError(f"{call} failed ({what})")

    def add_veth(self, ns: Path, host: str, name: str, mac: str, bridge: str) -> None:
        self.calls.append(("veth", host, name, mac, bridge))
        self._maybe_fail("veth", name)
        self.host.add(host)
        self.inside[name] = mac
        self.peers[host] = name

    def add_macvlan(self, ns: Path, lower: str, mode: str, name: str, mac: str) -> None:
        self.calls.append(("macvlan", lower, mode, name, mac))
        self._maybe_fail("macvlan", name)
        self.inside[name] = mac

    def address(self, ns: Path, name: str, cidrs: tuple[str, ...]) -> None:
        self.calls.append(("address", name, *cidrs))
        self._maybe_fail("address", name)

    def read(self, ns: Path, name: str) -> str:
        addr = [{"family": "inet", "local": "192.168.50.7", "prefixlen": 24}]
        return json.dumps([{"ifname": name, "address": self.inside[name], "mtu": 1500, "addr_info": addr}])

    def delete_in(self, ns: Path, name: str) -> None:
        self.calls.append(("delete_in", name))
        self.inside.pop(name, None)

    def delete(self, host: str) -> None:
        self.calls.append(("delete", host))
        self.host.discard(host)
        self.inside.pop(self.peers.pop(host, ""), None)  # the peer goes with it

    def host_links(self) -> list[str]:
        return sorted(self.host | {"eth0", "lo"})


class Status:
    def __init__(self) -> None:
        self.written: list[tuple[list[str], list[ClaimedNic], list[NicReport], str]] = []
        self.done = threading.Event()

    def __call__(
        self, claims: Sequence[PreparedClaim], nics: Sequence[ClaimedNic], reported: Sequence[NicReport], where: str
    ) -> None:
        self.written.append(([c.uid for c in claims], list(nics), list(reported), where))
        self.done.set()


@pytest.fixture
def store(tmp_path: Path) -> ClaimStore:
    return ClaimStore(tmp_path / "claims")


def _nics(store: ClaimStore, tmp_path: Path, links: object, status: Status | None = None) -> RuncNics:
    return RuncNics(store, (LAN, FAST), frozenset({"vmsandbox"}), tmp_path / "runc", status, links)  # type: ignore[arg-type]


POD = RuncPod(SB, "pod-1", "default", "web", "", "/run/netns/cni-1")


def test_attach_makes_records_and_writes_status_then_detach_removes(store: ClaimStore, tmp_path: Path) -> None:
    store.put(_claim("u1", "pod-1", ("lan", "", ("192.168.50.7/24",))))
    store.put(_claim("u2", "pod-1", ("fast", "data", ("10.9.0.7/16",))))
    store.put(_claim("u3", "pod-2", ("lan", "", ("192.168.50.8/24",))))  # another pod's
    links, status = FakeLinks(), Status()
    nics = _nics(store, tmp_path, links, status)
    made = nics.attach(POD)
    host = host_link_name(SB, "u1", 0)
    assert [n.host_link for n in made] == [host, ""]
    assert links.calls == [
        ("hold", "/run/netns/cni-1"),
        ("veth", host, "net1", claimed_mac(SB, "u1", 0), "br-lan"),
        ("address", "net1", "192.168.50.7/24"),
        ("macvlan", "eth1", "bridge", "data", claimed_mac(SB, "u2", 1)),
        ("address", "data", "10.9.0.7/16"),
    ]
    record = json.loads((tmp_path / "runc" / f"{SB}.json").read_text())
    assert record == {"sandboxID": SB, "podUID": "pod-1", "hostLinks": [host]}
    assert (tmp_path / "runc" / f"{SB}.json").stat().st_mode & 0o777 == 0o600
    assert status.done.wait(5)
    ((uids, seen, reported, where),) = status.written
    assert uids == ["u1", "u2"] and where == "the pod's network namespace"
    assert [(n.name, n.mac) for n in seen] == [(r.name, r.mac) for r in reported]
    assert nics.detach(SB) is True
    assert links.calls[-1] == ("delete", host) and links.host == set()
    assert not (tmp_path / "runc" / f"{SB}.json").exists()
    assert nics.detach(SB) is False  # idempotent


@pytest.mark.parametrize(
    "pod",
    [
        RuncPod(SB, "pod-1", "default", "web", "vmsandbox", "/n"),  # a VM pod (shim mode): its domain's NICs
        RuncPod(SB, "pod-9", "default", "web", "", "/n"),  # no claims
        RuncPod(SB, "", "default", "web", "", "/n"),  # no uid
    ],
)
def test_pods_left_alone(store: ClaimStore, tmp_path: Path, pod: RuncPod) -> None:
    store.put(_claim("u1", "pod-1", ("lan", "", ("192.168.50.7/24",))))
    links = FakeLinks()
    assert _nics(store, tmp_path, links).attach(pod) == []
    assert links.calls == [] and list((tmp_path / "runc").iterdir()) == []


@pytest.mark.parametrize(
    ("claim", "netns", "error", "says"),
    [
        (_claim("u1", "pod-1", ("lan", "", ())), "/n", WrongState, "has no static addresses and none from host-local"),
        (
            _claim("u1", "pod-1", ("lan", "", ("192.168.50.7/24",))),
            "",
            InvalidArgument,
            "no network namespace of its own",
        ),
    ],
)
def test_refused_before_anything_is_made(
    store: ClaimStore, tmp_path: Path, claim: PreparedClaim, netns: str, error: type[Exception], says: str
) -> None:
    store.put(claim)
    links = FakeLinks()
    with pytest.raises(error, match=says):
        _nics(store, tmp_path, links).attach(RuncPod(SB, "pod-1", "default", "web", "", netns))
    assert links.calls == [] and list((tmp_path / "runc").iterdir()) == []


@pytest.mark.parametrize("fail", ["veth", "address", "macvlan"])
def test_a_failure_rolls_back_what_was_made(store: ClaimStore, tmp_path: Path, fail: str) -> None:
    store.put(_claim("u1", "pod-1", ("lan", "", ("192.168.50.7/24",)), ("fast", "", ("10.9.0.7/16",))))
    links = FakeLinks(fail)
    with pytest.raises(NetnsError, match=f"claim default/claim-u1 device .*: {fail} failed"):
        _nics(store, tmp_path, links).attach(POD)
    assert links.host == set() and links.inside == {}
    assert list((tmp_path / "runc").iterdir()) == []


def test_reconcile_removes_what_pods_gone_left_and_links_of_no_record(store: ClaimStore, tmp_path: Path) -> None:
    store.put(_claim("u1", "pod-1", ("lan", "", ("192.168.50.7/24",))))
    store.put(_claim("u2", "pod-2", ("lan", "", ("192.168.50.8/24",))))
    links = FakeLinks()
    nics = _nics(store, tmp_path, links)
    other = "c" * 64
    nics.attach(POD)
    nics.attach(RuncPod(other, "pod-2", "default", "db", "", "/n2"))
    links.host.add("vdr0123456789ab")  # a link of ours no record names
    (tmp_path / "runc" / ".x.tmp").write_text("{")  # a write cut short
    assert nics.reconcile({SB}) == 1
    assert links.host == {host_link_name(SB, "u1", 0)}
    assert [m.sandbox_id for m in nics.recorded()] == [SB]
    assert sorted(p.name for p in (tmp_path / "runc").iterdir()) == [f"{SB}.json"]


def test_an_unreadable_record_is_dropped(store: ClaimStore, tmp_path: Path) -> None:
    nics = _nics(store, tmp_path, FakeLinks())
    (tmp_path / "runc" / f"{SB}.json").write_text('{"sandboxID": "x"}')
    assert nics.recorded() == []
    assert list((tmp_path / "runc").iterdir()) == []


# -- with the host's own links (root) ------------------------------------------------------------
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="makes a bridge, a namespace and a veth pair")


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=False)


@needs_root
def test_real_veth_on_a_bridge_in_a_namespace(store: ClaimStore, tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:6]
    bridge, ns = f"vtbr{tag}", tmp_path / "ns"
    ns.touch()
    try:
        assert subprocess.run(["unshare", f"--net={ns}", "true"], check=False).returncode == 0
        assert _ip("link", "add", bridge, "type", "bridge").returncode == 0
        net = NetworkAttachment("lan", "bridge", bridge, "192.168.77.0/24")
        store.put(_claim("u1", "pod-1", ("lan", "", ("192.168.77.7/24",))))
        status = Status()
        nics = RuncNics(store, (net,), frozenset(), tmp_path / "runc", status, HostLinks())
        pod = RuncPod(SB, "pod-1", "default", "web", "", str(ns))
        (made,) = nics.attach(pod)
        shown = subprocess.run(["nsenter", f"--net={ns}", "ip", "addr", "show", "net1"], capture_output=True, text=True)
        assert "inet 192.168.77.7/24" in shown.stdout and made.nic.mac in shown.stdout, shown.stdout
        assert Path("/sys/class/net", made.host_link, "master").resolve().name == bridge
        assert status.done.wait(5)
        ((_, _, (reported,), _),) = status.written
        assert (reported.name, reported.mac, reported.addresses[0]) == ("net1", made.nic.mac, "192.168.77.7/24")
        with pytest.raises(NetnsError, match="net1"):  # the same pod again: net1 is taken; nothing more is left
            nics.attach(RuncPod("d" * 64, "pod-1", "default", "web", "", str(ns)))
        assert not Path("/sys/class/net", host_link_name("d" * 64, "u1", 0)).exists()
        assert nics.detach(SB)
        assert not Path("/sys/class/net", made.host_link).exists()
        gone = subprocess.run(["nsenter", f"--net={ns}", "ip", "-o", "link"], capture_output=True, text=True)
        assert "net1" not in gone.stdout
    finally:
        _ip("link", "del", bridge)
        subprocess.run(["umount", str(ns)], capture_output=True, check=False)


@needs_root
def test_real_macvlan_in_a_namespace(store: ClaimStore, tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:6]
    lower, ns = f"vtdm{tag}", tmp_path / "ns"
    ns.touch()
    try:
        assert subprocess.run(["unshare", f"--net={ns}", "true"], check=False).returncode == 0
        assert _ip("link", "add", lower, "type", "veth", "peer", "name", f"vtdp{tag}").returncode == 0  # no dummy
        net = NetworkAttachment("fast", "macvlan", lower, "10.9.0.0/16", mode="bridge")
        store.put(_claim("u1", "pod-1", ("fast", "data", ("10.9.0.7/16",))))
        nics = RuncNics(store, (net,), frozenset(), tmp_path / "runc", None, HostLinks())
        (made,) = nics.attach(RuncPod(SB, "pod-1", "default", "web", "", str(ns)))
        assert made.host_link == ""
        shown = subprocess.run(
            ["nsenter", f"--net={ns}", "ip", "-d", "addr", "show", "data"], capture_output=True, text=True
        )
        assert "inet 10.9.0.7/16" in shown.stdout and "macvlan mode bridge" in shown.stdout, shown.stdout
        assert nics.detach(SB)  # nothing on the host: the macvlan goes with the namespace
        assert [m for m in nics.recorded()] == []
    finally:
        _ip("link", "del", lower)
        subprocess.run(["umount", str(ns)], capture_output=True, check=False)
