"""shim.dra.nri_plugin: vmsandbox as an external NRI plugin, against the runtime side of NRI as
vmsandbox itself speaks it (``shim.nri.host.NriHost``) over a real unix socket: registration,
Configure's subscription, Synchronize's reconcile, RunPodSandbox making a pod's devices (and its
refusal failing the pod with our message), Stop/RemovePodSandbox removing them, the older
StateChange form, and a new connection after the runtime restarts."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gen.nri import api_pb2 as api
from shim.dra.nri_plugin import EVENTS, NriPlugin, event_mask, status_code
from shim.dra.runc_nics import RuncNics
from shim.dra.store import ClaimStore
from shim.nri import codec
from shim.nri.conn import PluginCallError
from shim.nri.host import NriHost
from tests.shim.dra.test_runc_nics import LAN, FakeLinks, _claim
from vmsandbox import nri_rules, ttrpc
from vmsandbox.dra_runc import host_link_name
from vmsandbox.errors import InfrastructureError, InvalidArgument, PermissionDenied, Unsupported, WrongState

SB, GONE = "e" * 64, "f" * 64


def _pod(sandbox: str, uid: str, netns: str = "/run/netns/cni-1", handler: str = "") -> api.PodSandbox:
    pod = api.PodSandbox(id=sandbox, uid=uid, name="web", namespace="default", runtime_handler=handler)
    pod.linux.namespaces.add(type="ipc", path="")
    if netns:
        pod.linux.namespaces.add(type="network", path=netns)
    return pod


def _until(what: str, check: Callable[[], object], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.01)


class Runtime:
    """containerd's side: an NriHost on a socket, whose pods are ``pods``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.pods: list[api.PodSandbox] = []
        self.host: NriHost | None = None

    def start(self) -> NriHost:
        config = nri_rules.NriConfig(
            enable=True, socket_path=str(self.path), plugin_path="", registration_timeout_s=2, request_timeout_s=5
        )
        self.host = NriHost(config, "containerd", "test", lambda: (list(self.pods), []), lambda _p, _u: [])
        self.host.start()
        return self.host


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[tuple[Runtime, NriPlugin, FakeLinks, ClaimStore, RuncNics]]:
    store = ClaimStore(tmp_path / "claims")
    links = FakeLinks()
    nics = RuncNics(store, (LAN,), frozenset({"vmsandbox"}), tmp_path / "runc", None, links)
    runtime = Runtime(tmp_path / "nri.sock")
    runtime.pods = [_pod(SB, "pod-1")]
    plugin = NriPlugin(str(runtime.path), nics, retry_s=0.05)
    yield runtime, plugin, links, store, nics
    plugin.stop()
    if runtime.host is not None:
        runtime.host.close()


def test_registers_reconciles_makes_and_removes(
    setup: tuple[Runtime, NriPlugin, FakeLinks, ClaimStore, RuncNics],
) -> None:
    runtime, plugin, links, store, nics = setup
    store.put(_claim("u1", "pod-1", ("lan", "", ("192.168.50.7/24",))))
    store.put(_claim("u9", "pod-9", ("lan", "", ("192.168.50.9/24",))))
    nics.attach(
        codec.runc_pod(_pod(GONE, "pod-9", netns="/run/netns/old"))
    )  # made before a crash, for a sandbox the runtime no longer has
    host = runtime.start()
    plugin.start()  # the runtime listens first here; the other order is the retry's (below)
    _until("registration", lambda: host.registered() == ["50-vmsandbox-dra"])
    _until("the reconcile", lambda: [m.sandbox_id for m in nics.recorded()] == [])
    assert ("delete", host_link_name(GONE, "u9", 0)) in links.calls

    host.run_pod_sandbox(_pod(SB, "pod-1"))
    assert ("veth", host_link_name(SB, "u1", 0), "net1", links.inside["net1"], "br-lan") in links.calls
    assert [m.sandbox_id for m in nics.recorded()] == [SB]
    host.stop_pod_sandbox(_pod(SB, "pod-1"))
    assert nics.recorded() == [] and links.host == set()
    host.remove_pod_sandbox(_pod(SB, "pod-1"))  # nothing left: fine

    host.run_pod_sandbox(_pod(SB, "pod-1", handler="vmsandbox"))  # a VM pod: left alone
    assert nics.recorded() == []


def test_a_refusal_fails_the_pods_run_with_its_reason(
    setup: tuple[Runtime, NriPlugin, FakeLinks, ClaimStore, RuncNics],
) -> None:
    runtime, plugin, links, store, _ = setup
    store.put(_claim("u1", "pod-1", ("lan", "", ())))
    host = runtime.start()
    plugin.start()
    _until("registration", lambda: host.registered())
    with pytest.raises(PermissionDenied) as err:
        host.run_pod_sandbox(_pod(SB, "pod-1"))
    assert "vmsandbox-dra: pod default/web: claim default/claim-u1 device lan" in str(err.value)
    assert "has no static addresses" in str(err.value)
    store.put(_claim("u1", "pod-1", ("lan", "", ("192.168.50.7/24",))))
    with pytest.raises(PermissionDenied, match="no network namespace of its own"):
        host.run_pod_sandbox(_pod(SB, "pod-1", netns=""))
    assert links.calls == []


def test_connects_when_the_runtime_comes_and_again_after_it_restarts(
    setup: tuple[Runtime, NriPlugin, FakeLinks, ClaimStore, RuncNics],
) -> None:
    runtime, plugin, _, store, nics = setup
    plugin.start()  # nothing listens yet
    time.sleep(0.2)
    host = runtime.start()
    _until("registration", lambda: host.registered())
    host.close()
    _until("the connection closed", lambda: not plugin.registered.is_set())
    again = runtime.start()
    _until("registration again", lambda: again.registered())
    store.put(_claim("u1", "pod-1", ("lan", "", ("192.168.50.7/24",))))
    again.run_pod_sandbox(_pod(SB, "pod-1"))
    assert [m.sandbox_id for m in nics.recorded()] == [SB]


def test_state_change_events_and_other_methods(
    setup: tuple[Runtime, NriPlugin, FakeLinks, ClaimStore, RuncNics],
) -> None:
    _, plugin, _, store, nics = setup
    store.put(_claim("u1", "pod-1", ("lan", "", ("192.168.50.7/24",))))
    serve = plugin._serve
    serve("StateChange", api.StateChangeEvent(event=api.RUN_POD_SANDBOX, pod=_pod(SB, "pod-1")).SerializeToString())
    assert [m.sandbox_id for m in nics.recorded()] == [SB]
    serve("StateChange", api.StateChangeEvent(event=api.REMOVE_POD_SANDBOX, pod=_pod(SB, "pod-1")).SerializeToString())
    assert nics.recorded() == []
    reply = api.ConfigureResponse.FromString(serve("Configure", api.ConfigureRequest().SerializeToString()))
    assert reply.events == event_mask() == 0b111
    assert all(nri_rules.subscribed(reply.events, e) for e in EVENTS)
    assert not nri_rules.subscribed(reply.events, api.CREATE_CONTAINER)
    more = api.SynchronizeResponse.FromString(
        serve("Synchronize", api.SynchronizeRequest(more=True).SerializeToString())
    )
    assert more.more is True
    with pytest.raises(PluginCallError) as err:
        serve("CreateContainer", b"")
    assert err.value.code == ttrpc.UNIMPLEMENTED
    with pytest.raises(PluginCallError) as err:
        serve("RunPodSandbox", b"\xff")
    assert err.value.code == ttrpc.INVALID_ARGUMENT


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (InvalidArgument("x"), ttrpc.INVALID_ARGUMENT),
        (Unsupported("x"), ttrpc.FAILED_PRECONDITION),  # UNIMPLEMENTED would turn NRI to StateChange
        (WrongState("x"), ttrpc.FAILED_PRECONDITION),
        (InfrastructureError("x"), ttrpc.UNAVAILABLE),
    ],
)
def test_status_codes(exc: Exception, code: int) -> None:
    assert status_code(exc) == code  # type: ignore[arg-type]
