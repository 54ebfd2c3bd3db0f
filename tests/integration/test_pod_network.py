"""The pod network with real parts: Debian's CNI plugins (bridge, host-local, portmap) on a bridge
and subnet of the tests' own, real guests, busybox containers in them, the real socket.

Traffic goes only to addresses inside namespaces and guests these tests created (the test subnet
and its bridge), in bounded loops."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from tests.integration.cni_kit import CniEnv, cni_env
from tests.shim_kit import (
    Shim,
    container,
    our_domains,
    pod,
    q,
    require_host,
    running_shim,
    start_shim,
    stop_shim,
)

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.exclusive]

SMALL = q({"cpu": "250m", "memory": "32Mi"})
HOST_PORT = 18080


@dataclass
class Env:
    shim: Shim
    cni: CniEnv
    tmp: Path


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    require_host()
    tmp = tmp_path_factory.mktemp("podnet")
    with cni_env(tmp) as cni:
        (tmp / "shim").mkdir()
        with running_shim(tmp / "shim", extra_config=cni.shim_config()) as shim:
            yield Env(shim, cni, tmp)
        assert cni.leftovers() == {k: [] for k in cni.leftovers()}, "the network left something behind"


def _run_pod(env: Env, name: str, **kw: object) -> tuple[str, pb.PodSandboxConfig]:
    config = pod(name, containers=[("c", SMALL)])
    config.log_directory = str(env.tmp / "logs" / name)
    for m in kw.get("ports", []):  # type: ignore[attr-defined]
        config.port_mappings.append(m)
    if kw.get("host_network"):
        config.linux.security_context.namespace_options.network = pb.NODE
    sid = env.shim.runtime.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=300).pod_sandbox_id
    return sid, config


def kubelet_keeps(status: pb.PodSandboxStatus, host_network: bool) -> bool:
    """The kubelet's podSandboxChanged (pkg/kubelet/kuberuntime/kuberuntime_manager.go), negated:
    it starts a new sandbox when the one it has is not READY, when its network namespace mode is not
    the pod's (NODE for host-network pods, else POD), or when a pod that is not host-network has
    no IP."""
    mode = pb.NODE if host_network else pb.POD
    return (
        status.state == pb.SANDBOX_READY
        and status.linux.namespaces.options.network == mode
        and (host_network or status.network.ip != "")
    )


def _status(env: Env, sid: str) -> tuple[pb.PodSandboxStatus, dict[str, object]]:
    r = env.shim.runtime.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=sid, verbose=True), timeout=30)
    return r.status, json.loads(r.info["info"])


def _start(env: Env, sid: str, config: pb.PodSandboxConfig, argv: list[str]) -> str:
    c = container("c", SMALL)
    c.command[:] = argv
    c.log_path = "c.log"
    rt = env.shim.runtime
    cid = rt.CreateContainer(
        pb.CreateContainerRequest(pod_sandbox_id=sid, config=c, sandbox_config=config), timeout=120
    ).container_id
    rt.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=120)
    return cid


def _log(config: pb.PodSandboxConfig) -> str:
    path = Path(config.log_directory) / "c.log"
    return path.read_text() if path.exists() else ""


def _wait_for(what: str, check: object, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


def _remove(env: Env, *sids: str) -> None:
    for sid in sids:
        env.shim.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=120)
        env.shim.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=120)


def test_network_ready_follows_the_configuration(env: Env) -> None:
    def network_ready() -> pb.RuntimeCondition:
        conditions = env.shim.runtime.Status(pb.StatusRequest(), timeout=30).status.conditions
        (c,) = [c for c in conditions if c.type == "NetworkReady"]
        return c

    assert network_ready().status
    conf = env.cni.conf_dir / "10-test.conflist"
    kept = conf.read_text()
    conf.unlink()
    try:
        c = network_ready()
        assert not c.status and c.reason == "NetworkPluginNotReady" and str(env.cni.conf_dir) in c.message
        with pytest.raises(grpc.RpcError) as err:
            _run_pod(env, "no-network")
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "cni plugin not initialized" in str(err.value.details())
    finally:
        conf.write_text(kept)
    assert network_ready().status


def test_two_pods_get_their_own_addresses_and_talk_over_tcp(env: Env) -> None:
    a, a_config = _run_pod(env, "net-a")
    b, b_config = _run_pod(env, "net-b")
    try:
        (a_status, a_info), (b_status, _) = _status(env, a), _status(env, b)
        assert kubelet_keeps(a_status, host_network=False) and kubelet_keeps(b_status, host_network=False)
        ips = {a_status.network.ip, b_status.network.ip}
        assert len(ips) == 2 and all(ip.startswith("10.231.0.") for ip in ips)
        nics = a_info["guest"]["nics"]  # type: ignore[index]
        assert [n["addresses"][:1] for n in nics] == [[f"{a_status.network.ip}/24"]]
        assert sorted(env.cni.allocations()) == sorted(ips)

        _start(env, a, a_config, ["/bin/busybox", "nc", "-l", "-p", "8080"])
        script = (
            f"for i in $(seq 1 40); do echo hello-from-b | /bin/busybox nc -w 2 {a_status.network.ip} 8080 "
            "&& exit 0; sleep 0.5; done; exit 1"
        )
        _start(env, b, b_config, ["/bin/busybox", "sh", "-c", script])
        _wait_for("pod a to receive pod b's line", lambda: "hello-from-b" in _log(a_config))
    finally:
        _remove(env, a, b)


def test_a_port_mapping_reaches_the_pod_from_the_host(env: Env) -> None:
    mapping = pb.PortMapping(protocol=pb.TCP, container_port=8080, host_port=HOST_PORT)
    sid, config = _run_pod(env, "net-port", ports=[mapping])
    try:
        _start(env, sid, config, ["/bin/busybox", "sh", "-c", "echo mapped-reply | /bin/busybox nc -l -p 8080"])
        got = b""
        deadline = time.monotonic() + 90
        while b"mapped-reply" not in got:
            assert time.monotonic() < deadline, f"no reply through {env.cni.gateway}:{HOST_PORT}"
            try:
                with socket.create_connection((env.cni.gateway, HOST_PORT), timeout=3) as s:
                    got = s.recv(64)
            except OSError:
                time.sleep(0.5)
    finally:
        _remove(env, sid)


def test_a_host_network_pod_reports_node_and_no_ip(env: Env) -> None:
    sid, config = _run_pod(env, "net-host", host_network=True)
    try:
        status, info = _status(env, sid)
        assert kubelet_keeps(status, host_network=True)
        assert status.network.ip == ""
        nics = info["guest"]["nics"]  # type: ignore[index]
        assert [n["addresses"][:1] for n in nics] == [["10.0.2.15/24"]]
        assert env.cni.leftovers()["namespaces"] == []
        # the user-mode network's gateway is the host: a server on the host's loopback is reachable
        with socket.create_server(("127.0.0.1", 0)) as server:
            port = server.getsockname()[1]
            script = (
                f"for i in $(seq 1 40); do echo from-host-net | /bin/busybox nc -w 2 10.0.2.2 {port} && exit 0; "
                "sleep 0.5; done"
            )
            _start(env, sid, config, ["/bin/busybox", "sh", "-c", script])
            server.settimeout(90)
            conn, _ = server.accept()
            with conn:
                conn.settimeout(30)
                assert conn.recv(64).startswith(b"from-host-net")
    finally:
        _remove(env, sid)


def test_a_failed_cni_add_rolls_everything_back(env: Env) -> None:
    plugin = Path(env.cni.bin_dirs[0]) / "refuse"
    plugin.write_text(
        "#!/bin/sh\n"
        '[ "$CNI_COMMAND" = ADD ] || exit 0\n'
        'echo \'{"cniVersion":"1.0.0","code":11,"msg":"test plugin refuses","details":"on purpose"}\'\n'
        "exit 1\n"
    )
    plugin.chmod(0o755)
    good = json.loads((env.cni.conf_dir / "10-test.conflist").read_text())
    broken = {**good, "plugins": [good["plugins"][0], {"type": "refuse"}]}
    conf = env.cni.conf_dir / "00-broken.conflist"
    conf.write_text(json.dumps(broken))
    try:
        with pytest.raises(grpc.RpcError) as err:
            _run_pod(env, "net-refused")
        assert "test plugin refuses: on purpose" in str(err.value.details())
        assert env.cni.leftovers() == {k: [] for k in env.cni.leftovers()}
        assert our_domains(env.shim) == []
        assert list(env.shim.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items) == []
    finally:
        conf.unlink()


@pytest.mark.parametrize("fault", ["network:after-add", "RunPodSandbox:network", "RunPodSandbox:define"])
def test_a_shim_killed_mid_run_cleans_up_on_restart(env: Env, fault: str) -> None:
    tmp = env.tmp / f"crash-{fault.replace(':', '-')}"
    tmp.mkdir()
    shim = start_shim(tmp, extra_config=env.cni.shim_config(), env={"VMSANDBOX_FAULT": fault})
    try:
        with pytest.raises(grpc.RpcError):
            shim.runtime.RunPodSandbox(pb.RunPodSandboxRequest(config=pod("net-crash")), timeout=300)
        shim.process.wait(timeout=30)
        assert env.cni.leftovers()["namespaces"], "the fault point is after the namespace was made"
    finally:
        stop_shim(shim, kill=True)
    again = start_shim(tmp, extra_config=env.cni.shim_config())
    try:
        assert env.cni.leftovers() == {k: [] for k in env.cni.leftovers()}
        assert our_domains(again) == []
    finally:
        stop_shim(again)
