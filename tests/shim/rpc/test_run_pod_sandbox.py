"""RunPodSandbox (``shim.rpc.run_pod_sandbox``) through the real gRPC server in process
(``tests/cri_server.py``, its guests faked by ``booting``, so that every step is reached).

A fault injected after any of its steps unwinds exactly the steps done, newest first, and says so:
no row, claim, domain, sandbox directory, pod network, node port or loopback forward (of a namespace
the request gave) is left, and the pod's name is free again, so the same pod then runs. A node port
another process holds and an NRI plugin's refusal unwind the same way. (A domain libvirt cannot
remove: ``tests/shim/test_rollback.py``; the pod network's CNI and a real guest:
``tests/integration/test_rpc_rollback.py``.)
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import any_pb2

from gen.containerd.runtime.sandbox.v1 import sandbox_pb2
from gen.cri.runtime.v1 import api_pb2 as pb
from shim import faults, rpc
from shim.containerd.sandbox_service import SandboxService
from shim.nri.hooks import NriHooks
from shim.pod_networks import Attachment
from shim.pods import Pods
from shim.rpc.run_pod_sandbox import RPC, run_pod_sandbox
from shim.translate import inbound
from tests import fake_guest as fg
from tests.cri_server import SEED_SANDBOXES, Server, assert_no_leak, booting, cri_server
from tests.ports import quiet_port
from vmsandbox.adapters.host_cgroup import HostCgroups
from vmsandbox.adapters.hypervisor import Hypervisor
from vmsandbox.domain import domain_name
from vmsandbox.dra import NetworkAttachment, NetworkConfig, PreparedClaim, PreparedDevice, claimed_mac
from vmsandbox.errors import CannotFit, VmSandboxError, WrongState

pytest.importorskip("libvirt")

POINTS = rpc.rpc_points(RPC)
# the steps that push an undo, in order: a fault after a step unwinds those up to it
UNDONE = (
    "reserve-name",
    "claim",
    "record",
    "network",
    "share",
    "define",
    "cgroup",
    "node-ports",
    "nri-started",
)


# the pod's cgroup; its QEMU is a made-up pid whose cgroups a fake /proc names, moved in a fake tree
CGROUP_PARENT = "/kubepods/burstable/podu-1"
QEMU_PID = 4242
QEMU_WAS = {"cpu": "/machine/q", "cpuacct": "/machine/q", "memory": "/machine/q", "pids": "/"}


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    with cri_server() as s, booting(s):
        root = tmp_path / "cgroup"
        for controller, path in QEMU_WAS.items():
            for d in (root / controller / path.lstrip("/"), root / controller / CGROUP_PARENT.lstrip("/")):
                d.mkdir(parents=True, exist_ok=True)
                (d / "cgroup.procs").write_text("")
        (tmp_path / "proc" / str(QEMU_PID)).mkdir(parents=True)
        (tmp_path / "proc" / str(QEMU_PID) / "cgroup").write_text(
            "".join(f"{i}:{c}:{p}\n" for i, (c, p) in enumerate(QEMU_WAS.items(), 1))
        )
        boot = s.sandboxes.boot
        boot.cgroups = HostCgroups(str(root), str(tmp_path / "proc"))
        hv = s.sandboxes.hypervisor

        def start(name: str, paused: bool = False) -> None:
            # libvirt's test driver cannot start a domain paused: started, then paused at once
            Hypervisor.start(hv, name)
            if paused:
                hv._call("suspend", lambda conn: conn.lookupByName(name).suspend())

        hv.emulator_pid = lambda _name: QEMU_PID  # type: ignore[method-assign, assignment]
        hv.start = start  # type: ignore[method-assign]
        try:
            yield s
        finally:
            del hv.emulator_pid, hv.start


def in_cgroup(server: Server, path: str) -> set[str]:
    """The controllers whose ``path`` holds the pod's QEMU."""
    root = server.sandboxes.boot.cgroups.root
    procs = {c: root / c / path.lstrip("/") / "cgroup.procs" for c in QEMU_WAS}
    return {c for c, f in procs.items() if f.is_file() and f.read_text() == str(QEMU_PID)}


def pods_of(server: Server) -> Pods:
    assert server.pods is not None
    return server.pods


def host_network_pod(port: int, cgroup_parent: str = "") -> pb.RunPodSandboxRequest:
    """A host-network pod with a node port on 127.0.0.1 (and a cgroup of its own on the host when
    ``cgroup_parent``: the ``server`` fixture's), so that every step has something to do."""
    return pb.RunPodSandboxRequest(
        config=pb.PodSandboxConfig(
            metadata=pb.PodSandboxMetadata(name="web", namespace="default", uid="u-1"),
            log_directory="/var/log/pods/default_web_u-1",
            port_mappings=[pb.PortMapping(container_port=port, host_port=port, host_ip="127.0.0.1")],
            linux=pb.LinuxPodSandboxConfig(
                cgroup_parent=cgroup_parent,
                security_context=pb.LinuxSandboxSecurityContext(namespace_options=pb.NamespaceOption(network=pb.NODE)),
            ),
        ),
        runtime_handler="vmsandbox",
    )


def run(server: Server, request: pb.RunPodSandboxRequest) -> str:
    code, details, body = server.rpc("RunPodSandbox", request)
    assert code == grpc.StatusCode.OK, details
    return str(pb.RunPodSandboxResponse.FromString(body).pod_sandbox_id)


def assert_left_nothing(server: Server, port: int) -> None:
    """Only the seeded sandboxes are recorded, nothing else is held, and nothing listens on the
    node port (a relayed connection's TIME_WAIT may stay, as for any server: so SO_REUSEADDR)."""
    assert_no_leak(server.sandboxes, pods_of(server))
    assert sorted(sid for sid, *_ in server.sandboxes.ledger.sandboxes()) == sorted(SEED_SANDBOXES)
    with socket.socket() as again:
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", port))
        again.listen()


def remove(server: Server, sandbox_id: str) -> None:
    for name, req in (
        ("StopPodSandbox", pb.StopPodSandboxRequest(pod_sandbox_id=sandbox_id)),
        ("RemovePodSandbox", pb.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id)),
    ):
        code, details, _ = server.rpc(name, req)
        assert code == grpc.StatusCode.OK, details


def test_every_step_is_declared_in_order() -> None:
    assert (
        [p.split(":", 1)[1] for p in POINTS]
        == [
            "plan",
            "claimed-nics",  # nothing held: libvirt makes (and removes) the claimed NICs with the domain
            "claimed-devices",  # nothing held: the claimed IOMMU groups are held by the claim step
            *UNDONE[:7],
            "guest-start",
            "ready",
            "loopback-forward",  # a namespace the shim made: nothing to forward (shim mode's own tests)
            *UNDONE[7:],
        ]
    )


@pytest.mark.parametrize("point", POINTS)
def test_a_fault_after_any_step_leaves_nothing_behind(server: Server, point: str) -> None:
    port = quiet_port()
    request = host_network_pod(port, CGROUP_PARENT)
    with faults.raising(point):
        code, details, _ = server.rpc("RunPodSandbox", request)
    assert code == grpc.StatusCode.UNAVAILABLE, details
    assert f"fault injected at {point}" in details
    step = point.split(":", 1)[1]
    steps = [p.split(":", 1)[1] for p in POINTS]
    undone = [s for s in UNDONE if steps.index(s) <= steps.index(step)]
    if undone:
        assert details.startswith("pod default/web: ")
        assert f"(rolled back: {', '.join(reversed(undone))} undone)" in details
    assert_left_nothing(server, port)
    if "cgroup" in undone:  # its QEMU was put back where libvirt had it (written last: plain files here)
        assert in_cgroup(server, "/machine/q") == {"cpu", "cpuacct", "memory"}
        assert in_cgroup(server, "/") == {"pids"}
    else:
        assert in_cgroup(server, CGROUP_PARENT) == set()

    # the name is free again: the same pod runs, and goes as it came
    sandbox_id = run(server, request)
    code, details, body = server.rpc("PodSandboxStatus", pb.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id))
    assert code == grpc.StatusCode.OK and pb.PodSandboxStatusResponse.FromString(body).status.state == pb.SANDBOX_READY
    assert in_cgroup(server, CGROUP_PARENT) == set(QEMU_WAS)  # its QEMU is in the pod's cgroup
    assert server.sandboxes.records.get(sandbox_id).cgroup_parent == CGROUP_PARENT
    socket.create_connection(("127.0.0.1", port), timeout=5).close()  # its node port listens
    remove(server, sandbox_id)
    assert_left_nothing(server, port)


def test_a_taken_node_port_tears_the_new_pod_down(server: Server) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", quiet_port()))
        taken.listen()
        port = taken.getsockname()[1]
        code, details, _ = server.rpc("RunPodSandbox", host_network_pod(port))
        assert code == grpc.StatusCode.ALREADY_EXISTS and "is taken" in details, details
        assert "rolled back: " in details
    assert_left_nothing(server, port)


def test_a_plugin_refusal_tears_the_new_pod_down_and_closes_its_node_ports(server: Server) -> None:
    class Refusing(NriHooks):
        def sandbox_started(self, sandbox_id: str) -> None:
            raise VmSandboxError("plugin says no")

    pods = pods_of(server)
    assert server.containers is not None
    pods.nri = Refusing(None, server.sandboxes, server.containers)
    port = quiet_port()
    code, details, _ = server.rpc("RunPodSandbox", host_network_pod(port))
    assert code != grpc.StatusCode.OK and "plugin says no" in details, details
    assert "rolled back: node-ports, " in details  # the plugins refused: they are told nothing more
    assert_left_nothing(server, port)


def test_a_second_run_of_a_running_pod_is_refused_and_changes_nothing(server: Server) -> None:
    port = quiet_port()
    sandbox_id = run(server, host_network_pod(port))
    code, details, _ = server.rpc("RunPodSandbox", host_network_pod(port))
    assert code == grpc.StatusCode.ALREADY_EXISTS and f"already has sandbox {sandbox_id}" in details, details
    assert server.sandboxes.records.get(sandbox_id).state == pb.PodSandboxState.Name(pb.SANDBOX_READY)
    socket.create_connection(("127.0.0.1", port), timeout=5).close()
    remove(server, sandbox_id)
    assert_left_nothing(server, port)


def test_a_pod_that_does_not_fit_is_refused_as_such_naming_it_and_what_was_undone(server: Server) -> None:
    request = host_network_pod(quiet_port())
    request.config.linux.resources.cpu_quota, request.config.linux.resources.cpu_period = 900_000, 100_000
    with pytest.raises(CannotFit) as err:
        run_pod_sandbox(pods_of(server), inbound.run_pod_sandbox(request))
    assert str(err.value).startswith("pod default/web: cannot place the VM: ")
    assert str(err.value).endswith(" (rolled back: reserve-name undone)")
    assert err.value.shortfalls, "the refusal still names each short resource"
    assert_left_nothing(server, request.config.port_mappings[0].host_port)


LAN = NetworkAttachment("lan", "bridge", "br-lan", "192.168.50.0/24")


def lan_claim(*addresses: str) -> PreparedClaim:
    config = NetworkConfig("net1", addresses)
    return PreparedClaim(
        "c-uid", "default", "web-net", ("u-1",), (PreparedDevice("net", "n1-networks", "lan", config),)
    )


NICS: list[dict[str, object]] = []  # what the ``claimed`` fixture's guest reports of its NICs


@pytest.fixture
def claimed(server: Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    """The server as a DRA driver with network ``lan``, claim default/web-net prepared for pod u-1;
    its guests report the NICs ``reporting_nics`` lists."""

    def report(msg: dict[str, object]) -> bytes:
        return fg.ok(msg["id"], {**fg.report_body(), "nics": list(NICS)})

    NICS.clear()
    guest = fg.FakeGuest(
        server.root / "claimed.sock", lambda _n, peer: peer.serve(fg.agent(answers={"report": report}))
    )
    monkeypatch.setattr(server.sandboxes.hypervisor, "channel_path", lambda _domain, _channel: str(guest.path))
    monkeypatch.setattr(
        pods_of(server), "prepared_claims", lambda uid: (lan_claim("192.168.50.7/24"),) if uid == "u-1" else ()
    )
    sb = server.sandboxes
    monkeypatch.setattr(sb, "config", replace(sb.config, dra=replace(sb.config.dra, networks=(LAN,))))
    try:
        yield server
    finally:
        guest.close()


CLAIMED_SID = "5a" * 32


def reporting_nics(*nics: dict[str, object]) -> None:
    """The ``claimed`` fixture's guest reports ``nics`` (as the agent does: name, MAC, CIDRs, up)."""
    NICS[:] = nics


def run_claimed(server: Server, port: int) -> str:
    """Run the pod as sandbox ``CLAIMED_SID`` (so its claimed NIC's MAC is known); its id."""
    return run_pod_sandbox(
        pods_of(server), replace(inbound.run_pod_sandbox(host_network_pod(port)), sandbox_id=CLAIMED_SID)
    )


def test_a_pod_with_a_prepared_network_claim_gets_its_nic_named_and_addressed_in_the_guest(claimed: Server) -> None:
    port = quiet_port()
    mac = claimed_mac(CLAIMED_SID, "c-uid", 0)
    reporting_nics({"name": "net1", "mac": mac, "addresses": ["192.168.50.7/24", "fe80::1/64"], "up": True})
    written: list[tuple[Any, ...]] = []
    pods_of(claimed).claim_status = lambda *args: written.append(args)
    sandbox_id = run_claimed(claimed, port)
    ((claims, nics, reported),) = written  # the claim's status, once the guest is up, as it reports its NIC
    assert [c.uid for c in claims] == ["c-uid"] and [n.mac for n in nics] == [mac]
    assert [(r.name, r.mac) for r in reported] == [("net1", mac)]
    xml = claimed.sandboxes.hypervisor.live_xml(domain_name(sandbox_id))
    assert f"vmsandbox.xnic={mac},net1,192.168.50.7/24" in xml
    assert re.search(rf"<interface type='bridge'>\s*<mac address='{mac}'/>\s*<source bridge='br-lan'/>", xml), xml
    assert xml.count("<interface ") == 1  # the claimed one only: these pods have no network (pod_network: none)
    remove(claimed, sandbox_id)
    assert_left_nothing(claimed, port)  # the domain, with it libvirt's tap, is gone


@pytest.mark.parametrize(
    ("nic", "says"),
    [
        (None, "net1 (MAC, claim default/web-net): not in the guest"),
        ({"name": "eth1", "addresses": ["192.168.50.7/24"], "up": True}, 'net1 (MAC): named "eth1" in the guest'),
        ({"name": "net1", "addresses": ["192.168.50.7/24"], "up": False}, "net1 (MAC): down in the guest"),
        ({"name": "net1", "addresses": [], "up": True}, "net1 (MAC): without 192.168.50.7/24 in the guest"),
    ],
)
def test_a_guest_whose_claimed_nic_is_not_as_claimed_is_torn_down(
    claimed: Server, nic: dict[str, object] | None, says: str
) -> None:
    port = quiet_port()
    mac = claimed_mac(CLAIMED_SID, "c-uid", 0)
    reporting_nics(*([{**nic, "mac": mac}] if nic else []))
    failed: list[tuple[Any, ...]] = []
    pods_of(claimed).claim_failure = lambda *args: failed.append(args)
    with pytest.raises(VmSandboxError) as err:
        run_claimed(claimed, port)
    assert "the guest's claimed NICs are not as claimed: " + says.replace("MAC", mac) in str(err.value)
    assert "rolled back: " in str(err.value)
    assert_left_nothing(claimed, port)
    ((claims, reason, message),) = failed  # the claim's devices Ready False, saying why
    assert [c.uid for c in claims] == ["c-uid"] and reason == "NotAsClaimed"
    assert message.startswith("RunPodSandbox failed: ") and says.replace("MAC", mac) in message


@pytest.mark.parametrize("point", POINTS)
def test_a_fault_after_any_step_of_a_pod_with_a_claimed_nic_leaves_nothing_behind(claimed: Server, point: str) -> None:
    port = quiet_port()
    reporting_nics(
        {"name": "net1", "mac": claimed_mac(CLAIMED_SID, "c-uid", 0), "addresses": ["192.168.50.7/24"], "up": True}
    )
    with faults.raising(point), pytest.raises(faults.InjectedFault) as err:
        run_claimed(claimed, port)
    assert f"fault injected at {point}" in str(err.value)
    assert_left_nothing(claimed, port)
    remove(claimed, run_claimed(claimed, port))  # then it runs, and goes as it came
    assert_left_nothing(claimed, port)


@pytest.mark.parametrize(
    ("addresses", "code", "says"),
    [
        ((), grpc.StatusCode.FAILED_PRECONDITION, "device lan (request net) has no static addresses and none from"),
        (("10.1.0.7/24",), grpc.StatusCode.INVALID_ARGUMENT, '"10.1.0.7/24" is not in 192.168.50.0/24'),
    ],
)
def test_a_claimed_device_that_cannot_be_attached_is_refused_before_anything_is_done(
    claimed: Server, monkeypatch: pytest.MonkeyPatch, addresses: tuple[str, ...], code: grpc.StatusCode, says: str
) -> None:
    """Never run without what it claimed: refused, naming the claim and why."""
    monkeypatch.setattr(
        pods_of(claimed), "prepared_claims", lambda uid: (lan_claim(*addresses),) if uid == "u-1" else ()
    )
    request = host_network_pod(quiet_port())
    failed: list[tuple[Any, ...]] = []
    pods_of(claimed).claim_failure = lambda *args: failed.append(args)
    got, details, _ = claimed.rpc("RunPodSandbox", request)
    assert got == code, details
    assert details.startswith("pod default/web: ") and says in details, details
    assert_left_nothing(claimed, request.config.port_mappings[0].host_port)
    assert [(r, says in m) for _, r, m in failed] == [("AttachFailed", True)]


def test_a_claim_whose_network_is_no_longer_configured_is_refused(
    claimed: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    sb = claimed.sandboxes
    monkeypatch.setattr(sb, "config", replace(sb.config, dra=replace(sb.config.dra, networks=())))
    request = host_network_pod(quiet_port())
    code, details, _ = claimed.rpc("RunPodSandbox", request)
    assert code == grpc.StatusCode.FAILED_PRECONDITION, details
    assert "network lan is not configured on this node any more" in details
    assert_left_nothing(claimed, request.config.port_mappings[0].host_port)


class SandboxIds:
    """Stands in for ``shim.containerd.tasks.Tasks``: the sandbox ids CreateSandbox adds and forgets."""

    def __init__(self) -> None:
        self.ids: set[str] = set()

    def add_sandbox(self, sandbox_id: str) -> None:
        self.ids.add(sandbox_id)

    def forget_sandbox(self, sandbox_id: str) -> None:
        self.ids.discard(sandbox_id)


def test_shim_modes_create_sandbox_attaches_the_claims_prepared_for_the_pods_uid(claimed: Server) -> None:
    """containerd's CreateSandbox (shim mode) carries the kubelet's PodSandboxConfig: the claims are
    found by its uid, as on the CRI socket, the NIC is checked in the guest's report at READY and the
    claim's status written."""
    port = quiet_port()
    mac = claimed_mac(CLAIMED_SID, "c-uid", 0)
    reporting_nics({"name": "net1", "mac": mac, "addresses": ["192.168.50.7/24"], "up": True})
    written: list[tuple[Any, ...]] = []
    pods_of(claimed).claim_status = lambda *args: written.append(args)
    ids = SandboxIds()
    service = SandboxService(pods_of(claimed), "vmsandbox", ids)  # type: ignore[arg-type]
    options = any_pb2.Any(type_url="runtime.v1.PodSandboxConfig")
    options.value = host_network_pod(port).config.SerializeToString()
    service.create(sandbox_pb2.CreateSandboxRequest(sandbox_id=CLAIMED_SID, options=options))
    assert ids.ids == {CLAIMED_SID}
    ((claims, nics, reported),) = written
    assert [c.uid for c in claims] == ["c-uid"] and [n.mac for n in nics] == [mac]
    assert [(r.name, r.mac) for r in reported] == [("net1", mac)]
    assert f"vmsandbox.xnic={mac},net1,192.168.50.7/24" in claimed.sandboxes.hypervisor.live_xml(
        domain_name(CLAIMED_SID)
    )
    remove(claimed, CLAIMED_SID)
    assert_left_nothing(claimed, port)


def test_shim_modes_create_sandbox_refuses_a_claim_it_cannot_attach_and_forgets_the_sandbox(
    claimed: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pods_of(claimed), "prepared_claims", lambda uid: (lan_claim(),) if uid == "u-1" else ())
    port = quiet_port()
    ids = SandboxIds()
    service = SandboxService(pods_of(claimed), "vmsandbox", ids)  # type: ignore[arg-type]
    options = any_pb2.Any(type_url="runtime.v1.PodSandboxConfig")
    options.value = host_network_pod(port).config.SerializeToString()
    says = "claim default/web-net device lan (request net) has no static addresses"
    with pytest.raises(WrongState, match=re.escape(says)):
        service.create(sandbox_pb2.CreateSandboxRequest(sandbox_id=CLAIMED_SID, options=options))
    assert ids.ids == set()
    assert_left_nothing(claimed, port)


def test_the_namespace_a_request_gives_reaches_the_network_step(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    request = host_network_pod(quiet_port())
    request.config.linux.security_context.namespace_options.network = pb.POD
    req = inbound.run_pod_sandbox(request)
    assert req.given_netns is None  # the CRI has no way to give one: the shim makes the network
    network = server.sandboxes.network
    real = network.attach
    given: list[str | None] = []

    def attach(*args: Any, given_netns: str | None = None) -> Attachment:
        given.append(given_netns)
        return real(*args)  # pod_network "none" here: no NIC, nothing to read

    monkeypatch.setattr(network, "attach", attach)
    sandbox_id = run_pod_sandbox(pods_of(server), replace(req, given_netns="/run/netns/cni-0a1b"))
    assert given == ["/run/netns/cni-0a1b"]
    remove(server, sandbox_id)
    assert_left_nothing(server, request.config.port_mappings[0].host_port)


class RecordingForwards:
    """Stands in for ``shim.loopback_forwards.LoopbackForwards``: what was opened and closed."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.open_now: set[str] = set()

    def open(self, sandbox_id: str, netns_path: str) -> int:
        self.calls.append(("open", netns_path))
        self.open_now.add(sandbox_id)
        return 40000

    def close(self, sandbox_id: str) -> None:
        self.calls.append(("close", sandbox_id))
        self.open_now.discard(sandbox_id)


@pytest.mark.parametrize(
    ("fault", "opened"),
    [
        (None, True),
        (f"{RPC}:ready", False),  # before the step: nothing opened, nothing to close
        (f"{RPC}:loopback-forward", True),
        (f"{RPC}:node-ports", True),
        (f"{RPC}:nri-started", True),
    ],
)
def test_a_given_namespace_has_its_loopback_forwarded_until_stop_or_rollback(
    server: Server, monkeypatch: pytest.MonkeyPatch, fault: str | None, opened: bool
) -> None:
    request = host_network_pod(quiet_port())
    request.config.linux.security_context.namespace_options.network = pb.POD
    req = replace(inbound.run_pod_sandbox(request), given_netns="/run/netns/cni-0a1b")
    network = server.sandboxes.network
    real = network.attach
    monkeypatch.setattr(network, "attach", lambda *args, given_netns=None: real(*args))
    pods = pods_of(server)
    forwards = RecordingForwards()
    monkeypatch.setattr(pods, "loopback_forwards", forwards)
    if fault is None:
        sandbox_id = run_pod_sandbox(pods, req)
        assert forwards.calls == [("open", "/run/netns/cni-0a1b")]
        assert forwards.open_now == {sandbox_id}
        remove(server, sandbox_id)  # the stop closes it (the removal's stop again: nothing there is fine)
        assert forwards.calls[1] == ("close", sandbox_id)
    else:
        with faults.raising(fault), pytest.raises(VmSandboxError, match=f"fault injected at {fault}"):
            run_pod_sandbox(pods, req)
        assert [c for c, _ in forwards.calls] == (["open", "close"] if opened else [])
    assert forwards.open_now == set()
    assert_left_nothing(server, request.config.port_mappings[0].host_port)


def test_a_failure_status_that_cannot_be_written_leaves_the_pods_own_error(
    claimed: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Best effort: the claims' status write failing is logged, the answer is still why the pod failed."""
    monkeypatch.setattr(pods_of(claimed), "prepared_claims", lambda uid: (lan_claim("10.1.0.7/24"),))

    def broken(*_args: object) -> None:
        raise RuntimeError("the API server is away")

    pods_of(claimed).claim_failure = broken
    request = host_network_pod(quiet_port())
    code, details, _ = claimed.rpc("RunPodSandbox", request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and '"10.1.0.7/24" is not in 192.168.50.0/24' in details
    assert_left_nothing(claimed, request.config.port_mappings[0].host_port)


def test_a_pod_without_claims_writes_no_claim_status(server: Server) -> None:
    written: list[tuple[Any, ...]] = []
    pods_of(server).claim_failure = lambda *args: written.append(args)
    pods_of(server).claim_status = lambda *args: written.append(args)
    with faults.raising("RunPodSandbox:ready"), pytest.raises(faults.InjectedFault):
        run_pod_sandbox(pods_of(server), inbound.run_pod_sandbox(host_network_pod(quiet_port())))
    assert written == []
