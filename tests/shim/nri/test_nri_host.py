"""``NriHost`` over real unix sockets: peers that break the protocol, register badly or ask for
container updates, and (with ``NRI_PLUGIN``, a plugin built by tests/nri_plugin/build.sh) a real
Go plugin that hangs or is synchronized with many containers."""

from __future__ import annotations

import os
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gen.nri import api_pb2 as api
from shim.nri import wire
from shim.nri.host import NriHost
from vmsandbox import nri_rules, ttrpc
from vmsandbox.errors import InvalidArgument, PermissionDenied

PLUGIN = os.environ.get("NRI_PLUGIN", "")


class Recorder:
    def __init__(self, containers: int = 0) -> None:
        self.updates: list[tuple[str, list[api.ContainerUpdate]]] = []
        self.containers = containers

    def snapshot(self) -> tuple[list[api.PodSandbox], list[api.Container]]:
        pods = [api.PodSandbox(id=f"{i:064x}", name=f"pod-{i}") for i in range(max(self.containers // 2, 1))]
        ctrs = [
            api.Container(id=f"{i:064x}", pod_sandbox_id=pods[i % len(pods)].id, name=f"c{i}", env=["A=B"] * 8)
            for i in range(self.containers)
        ]
        return pods, ctrs

    def update(self, plugin: str, updates: list[api.ContainerUpdate]) -> list[api.ContainerUpdate]:
        self.updates.append((plugin, updates))
        return [u for u in updates if u.container_id == "unknown"]


@pytest.fixture
def host(tmp_path: Path) -> Iterator[tuple[NriHost, Recorder, Path]]:
    rec = Recorder()
    path = tmp_path / "nri.sock"
    config = nri_rules.NriConfig(
        enable=True, socket_path=str(path), plugin_path="", registration_timeout_s=0.5, request_timeout_s=0.5
    )
    h = NriHost(config, "vmsandbox", "test", rec.snapshot, rec.update)
    h.start()
    yield h, rec, path
    h.close()


def _connect(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    _pending.pop(s.fileno(), None)
    _buffers.pop(s.fileno(), None)
    s.connect(str(path))
    s.settimeout(5)
    return s


def _closed(s: socket.socket) -> bool:
    try:
        while True:
            if not s.recv(65536):
                return True
    except TimeoutError:
        return False
    except OSError:
        return True


def _call(s: socket.socket, stream: int, method: str, payload: bytes) -> None:
    req = wire.Request("nri.pkg.api.v1alpha1.Runtime", method, payload)
    s.sendall(ttrpc.encode_mux(ttrpc.RUNTIME_SERVICE_CONN, ttrpc.encode_frame(wire.request_frame(stream, req))))


_pending: dict[int, list[tuple[int, ttrpc.Frame]]] = {}
_buffers: dict[int, tuple[bytes, dict[int, bytes]]] = {}


def _answer(s: socket.socket) -> tuple[int, ttrpc.Frame]:
    """The next frame the host sent on either logical connection."""
    queue = _pending.setdefault(s.fileno(), [])
    buf, streams = _buffers.get(s.fileno(), (b"", {1: b"", 2: b""}))
    while not queue:
        data = s.recv(65536)
        assert data, "connection closed"
        chunks, buf = ttrpc.decode_mux(buf + data)
        for cid, chunk in chunks:
            frames, streams[cid] = ttrpc.decode_frames(streams[cid] + chunk)
            queue += [(cid, f) for f in frames]
    _buffers[s.fileno()] = (buf, streams)
    return queue.pop(0)


def test_a_peer_that_never_registers_is_closed(host: tuple[NriHost, Recorder, Path]) -> None:
    h, _, path = host
    s = _connect(path)
    assert _closed(s)
    assert h.registered() == []


@pytest.mark.parametrize(
    "garbage",
    [
        (1).to_bytes(4, "big") + (ttrpc.MUX_MAX_PAYLOAD + 1).to_bytes(4, "big"),  # oversized chunk
        ttrpc.encode_mux(2, (ttrpc.MAX_MESSAGE + 1).to_bytes(4, "big") + bytes(6)),  # oversized message
        ttrpc.encode_mux(2, ttrpc.encode_frame(ttrpc.Frame(2, ttrpc.TYPE_REQUEST, 0, b""))),  # even stream id
        ttrpc.encode_mux(2, ttrpc.encode_frame(ttrpc.Frame(1, ttrpc.TYPE_REQUEST, 0, b"\x0a\xff"))),  # bad request
    ],
)
def test_a_peer_that_breaks_the_protocol_is_closed_at_once(
    host: tuple[NriHost, Recorder, Path], garbage: bytes
) -> None:
    _, _, path = host
    s = _connect(path)
    started = time.monotonic()
    s.sendall(garbage)
    assert _closed(s)
    assert time.monotonic() - started < 0.4  # before the registration timeout


@pytest.mark.parametrize(
    ("name", "idx", "message"),
    [("bad name", "10", "invalid plugin name"), ("ok", "1", "must be 2 digits"), ("", "10", "name is empty")],
)
def test_invalid_registration_is_refused(
    host: tuple[NriHost, Recorder, Path], name: str, idx: str, message: str
) -> None:
    h, _, path = host
    s = _connect(path)
    _call(s, 1, "RegisterPlugin", api.RegisterPluginRequest(plugin_name=name, plugin_idx=idx).SerializeToString())
    cid, frame = _answer(s)
    response = wire.parse_response(frame)
    assert (cid, response.code) == (ttrpc.RUNTIME_SERVICE_CONN, ttrpc.INVALID_ARGUMENT)
    assert message in response.message
    assert _closed(s)
    assert h.registered() == []


def _register_by_hand(path: Path) -> socket.socket:
    """Register as 50-hand and answer Configure and Synchronize, as a plugin does."""
    s = _connect(path)
    _call(s, 1, "RegisterPlugin", api.RegisterPluginRequest(plugin_name="hand", plugin_idx="50").SerializeToString())
    for _ in range(3):
        cid, frame = _answer(s)
        if cid == ttrpc.RUNTIME_SERVICE_CONN:
            assert wire.parse_response(frame).code == ttrpc.OK
            continue
        req = wire.parse_request(frame)
        reply = api.ConfigureResponse(events=0) if req.method == "Configure" else api.SynchronizeResponse()
        out = wire.response_frame(frame.stream_id, wire.Response(ttrpc.OK, "", reply.SerializeToString()))
        s.sendall(ttrpc.encode_mux(ttrpc.PLUGIN_SERVICE_CONN, ttrpc.encode_frame(out)))
    return s


def test_unsolicited_container_updates_reach_the_runtime(host: tuple[NriHost, Recorder, Path]) -> None:
    h, rec, path = host
    s = _register_by_hand(path)
    deadline = time.monotonic() + 5
    while h.registered() != ["50-hand"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    updates = [api.ContainerUpdate(container_id="a" * 64), api.ContainerUpdate(container_id="unknown")]
    _call(s, 3, "UpdateContainers", api.UpdateContainersRequest(update=updates).SerializeToString())
    _, frame = _answer(s)
    response = wire.parse_response(frame)
    assert response.code == ttrpc.OK
    failed = api.UpdateContainersResponse.FromString(response.payload).failed
    assert [u.container_id for u in failed] == ["unknown"]
    assert [(p, [u.container_id for u in us]) for p, us in rec.updates] == [("50-hand", ["a" * 64, "unknown"])]


def test_a_plugin_that_stops_answering_is_dropped(host: tuple[NriHost, Recorder, Path]) -> None:
    h, _, path = host
    s = _register_by_hand(path)
    deadline = time.monotonic() + 5
    while h.registered() != ["50-hand"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    started = time.monotonic()
    h.run_pod_sandbox(api.PodSandbox(id="p", name="p"))  # never answered
    assert 0.5 <= time.monotonic() - started < 2
    assert h.registered() == []
    assert _closed(s)


# -- a real plugin -------------------------------------------------------------------------------
needs_plugin = pytest.mark.skipif(not PLUGIN, reason="set NRI_PLUGIN to a plugin built by tests/nri_plugin/build.sh")


@needs_plugin
def test_registration_with_many_containers_is_quick(tmp_path: Path) -> None:
    rec = Recorder(containers=300)
    (tmp_path / "plugins").mkdir()
    shutil.copy(PLUGIN, tmp_path / "plugins" / "10-sync")
    config = nri_rules.NriConfig(enable=True, socket_path="", plugin_path=str(tmp_path / "plugins"))
    h = NriHost(config, "vmsandbox", "test", rec.snapshot, rec.update)
    try:
        started = time.monotonic()
        h.start()
        took = time.monotonic() - started
        assert h.registered() == ["10-sync"]
        assert took < 2.0, took  # 300 containers and 150 pods in two Synchronize messages
    finally:
        h.close()


@needs_plugin
def test_a_real_plugin_that_hangs_is_dropped_and_killed(tmp_path: Path) -> None:
    rec = Recorder()
    (tmp_path / "plugins").mkdir()
    (tmp_path / "conf").mkdir()
    shutil.copy(PLUGIN, tmp_path / "plugins" / "10-hang")
    (tmp_path / "conf" / "hang.conf").write_text("hang=CreateContainer")
    config = nri_rules.NriConfig(
        enable=True,
        socket_path="",
        plugin_path=str(tmp_path / "plugins"),
        plugin_config_path=str(tmp_path / "conf"),
        request_timeout_s=0.5,
    )
    h = NriHost(config, "vmsandbox", "test", rec.snapshot, rec.update)
    try:
        h.start()
        assert h.registered() == ["10-hang"]
        pid = h._plugins[0].pid
        assert pid is not None
        pod, ctr = api.PodSandbox(id="p", name="p"), api.Container(id="c", name="c")
        started = time.monotonic()
        target, _ = h.create_container(pod, ctr, nri_rules.Target(name="c"))
        assert 0.5 <= time.monotonic() - started < 2
        assert target == nri_rules.Target(name="c")
        assert h.registered() == []
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # killed and collected
        started = time.monotonic()
        h.create_container(pod, ctr, nri_rules.Target(name="c"))
        assert time.monotonic() - started < 0.1
    finally:
        h.close()


@needs_plugin
def test_plugins_are_called_in_index_order_and_may_not_share_a_field(tmp_path: Path) -> None:
    rec = Recorder()
    plugins, conf = tmp_path / "plugins", tmp_path / "conf"
    plugins.mkdir()
    conf.mkdir()
    for name, words in (("20-second", "env=WHO=second"), ("10-first", "env=WHO=first annotation=a.io/x=1")):
        shutil.copy(PLUGIN, plugins / name)
        (conf / f"{name}.conf").write_text(words)
    config = nri_rules.NriConfig(enable=True, socket_path="", plugin_path=str(plugins), plugin_config_path=str(conf))
    h = NriHost(config, "vmsandbox", "test", rec.snapshot, rec.update)
    try:
        h.start()
        assert h.registered() == ["10-first", "20-second"]
        with pytest.raises(InvalidArgument, match='NRI plugins "10-first" and "20-second" both adjust env WHO'):
            h.create_container(api.PodSandbox(id="p"), api.Container(id="c", name="c"), nri_rules.Target(name="c"))
    finally:
        h.close()


@needs_plugin
def test_a_validator_rejecting_the_adjustments_fails_the_container(tmp_path: Path) -> None:
    rec = Recorder()
    plugins, conf = tmp_path / "plugins", tmp_path / "conf"
    plugins.mkdir()
    conf.mkdir()
    shutil.copy(PLUGIN, plugins / "10-inject")
    (conf / "10-inject.conf").write_text("env=X=1")
    shutil.copy(PLUGIN, plugins / "90-policy")
    (conf / "90-policy.conf").write_text("reject=no-injected-env-here")
    config = nri_rules.NriConfig(enable=True, socket_path="", plugin_path=str(plugins), plugin_config_path=str(conf))
    h = NriHost(config, "vmsandbox", "test", rec.snapshot, rec.update)
    try:
        h.start()
        with pytest.raises(PermissionDenied) as err:
            h.create_container(api.PodSandbox(id="p"), api.Container(id="c", name="app"), nri_rules.Target(name="app"))
        assert (
            str(err.value) == 'NRI plugin "90-policy" rejected the adjustments of container "app": no-injected-env-here'
        )
        assert h.registered() == ["10-inject", "90-policy"]  # a rejection is an answer, not a failure
    finally:
        h.close()
