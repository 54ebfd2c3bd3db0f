"""Host NRI plugins against a real shim and real guests, through the CRI socket.

The plugin is a real one built from containerd/nri's stub (tests/nri_plugin/build.sh); these
tests skip unless ``NRI_PLUGIN`` names its binary. One copy is started by the shim from its
plugin directory (an injector, configured from the plugin config directory); others connect to
the shim's NRI socket as external plugins, each for one test.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from tests.shim_kit import Shim, our_domains, pod, q, require_host, running_shim

pytestmark = [pytest.mark.slow, pytest.mark.integration]

PLUGIN = os.environ.get("NRI_PLUGIN", "")
SMALL = q({"cpu": "250m", "memory": "32Mi"})
REQUEST_TIMEOUT_S = 2


@dataclass
class Env:
    shim: Shim
    tmp: Path
    events: Path
    nri_socket: Path


def _status_plugins(shim: Shim) -> list[str]:
    info = shim.runtime.Status(pb.StatusRequest(verbose=True), timeout=30).info["info"]
    return list(json.loads(info)["nri_plugins"])


def _wait_plugins(shim: Shim, present: set[str], absent: frozenset[str] = frozenset(), timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        names = set(_status_plugins(shim))
        if present <= names and not (absent & names):
            return
        assert time.monotonic() < deadline, f"plugins registered: {sorted(names)}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    if not PLUGIN:
        pytest.skip("set NRI_PLUGIN to a plugin built by tests/nri_plugin/build.sh")
    require_host()
    tmp = tmp_path_factory.mktemp("nri")
    plugins, confs = tmp / "plugins", tmp / "conf.d"
    plugins.mkdir()
    confs.mkdir()
    shutil.copy(PLUGIN, plugins / "10-inject")
    events = tmp / "events.log"
    (confs / "10-inject.conf").write_text(
        f"env=NRI_INJECTED=from-plugin annotation=nri.example.com/injected=yes events={events}\n"
    )
    nri_socket = tmp / "nri.sock"
    (tmp / "shim").mkdir()
    config: dict[str, object] = {
        "nri": {
            "enable": True,
            "socket_path": str(nri_socket),
            "plugin_path": str(plugins),
            "plugin_config_path": str(confs),
            "request_timeout_s": REQUEST_TIMEOUT_S,
        }
    }
    with running_shim(tmp / "shim", extra_config=config) as shim:
        yield Env(shim, tmp, events, nri_socket)


@pytest.fixture
def external(env: Env) -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(10)


def _start_external(env: Env, started: list[subprocess.Popen[bytes]], idx: str, name: str, config: str) -> None:
    log = (env.tmp / f"{idx}-{name}.log").open("wb")
    started.append(
        subprocess.Popen(
            [PLUGIN, "-idx", idx, "-name", name, "-socket", str(env.nri_socket), "-config", config],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    )
    _wait_plugins(env.shim, {f"{idx}-{name}"})


def _sandbox(
    env: Env, name: str, containers: list[tuple[str, pb.KubernetesResources]]
) -> tuple[str, pb.PodSandboxConfig]:
    config = pod(name, containers=containers)
    config.log_directory = str(env.tmp / "logs" / name)
    sid = env.shim.runtime.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=300).pod_sandbox_id
    return sid, config


def _create(env: Env, sid: str, config: pb.PodSandboxConfig, name: str, res: pb.KubernetesResources) -> str:
    c = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name=name),
        image=pb.ImageSpec(image="busybox"),
        command=["sleep", "3600"],
        log_path=f"{name}.log",
    )
    c.kubernetes_resources.CopyFrom(res)
    req = pb.CreateContainerRequest(pod_sandbox_id=sid, config=c, sandbox_config=config)
    return env.shim.runtime.CreateContainer(req, timeout=120).container_id


def _teardown(env: Env, sid: str) -> None:
    env.shim.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=120)
    env.shim.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=120)


def test_injected_env_and_annotation_reach_the_guest_container(env: Env) -> None:
    assert "10-inject" in _status_plugins(env.shim), env.shim.log_text()[-4000:]
    sid, config = _sandbox(env, "inject", [("app", SMALL)])
    try:
        cid = _create(env, sid, config, "app", SMALL)
        env.shim.runtime.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=120)
        res = env.shim.runtime.ExecSync(
            pb.ExecSyncRequest(container_id=cid, cmd=["sh", "-c", "echo $NRI_INJECTED"], timeout=30), timeout=60
        )
        assert (res.exit_code, res.stdout) == (0, b"from-plugin\n")
        status = env.shim.runtime.ContainerStatus(pb.ContainerStatusRequest(container_id=cid), timeout=30).status
        assert status.annotations["nri.example.com/injected"] == "yes"
    finally:
        _teardown(env, sid)
    seen = env.events.read_text().splitlines()
    for event in (
        "RunPodSandbox inject -",
        "CreateContainer inject app",
        "PostCreateContainer inject app",
        "StartContainer inject app",
        "PostStartContainer inject app",
        "StopContainer inject app",
        "StopPodSandbox inject -",
        "RemoveContainer inject app",
        "RemovePodSandbox inject -",
    ):
        assert event in seen


def test_plugin_growing_a_container_is_refused_naming_it(env: Env, external: list[subprocess.Popen[bytes]]) -> None:
    _start_external(env, external, "20", "grow", f"memory={1 << 30}")
    sid, config = _sandbox(env, "grow", [("app", SMALL)])
    try:
        with pytest.raises(grpc.RpcError) as err:
            _create(env, sid, config, "app", SMALL)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        message = err.value.details() or ""
        assert 'NRI plugin "20-grow"' in message
        assert 'container "app": limits.memory declared 32Mi, requested 1Gi' in message
        listed = env.shim.runtime.ListContainers(
            pb.ListContainersRequest(filter=pb.ContainerFilter(pod_sandbox_id=sid)), timeout=30
        )
        assert list(listed.containers) == []
    finally:
        _teardown(env, sid)


def test_hanging_plugin_is_dropped_and_pods_carry_on(env: Env, external: list[subprocess.Popen[bytes]]) -> None:
    _start_external(env, external, "30", "hang", "hang=CreateContainer")
    sid, config = _sandbox(env, "hang", [("app", SMALL)])
    try:
        started = time.monotonic()
        cid = _create(env, sid, config, "app", SMALL)
        took = time.monotonic() - started
        assert REQUEST_TIMEOUT_S <= took < REQUEST_TIMEOUT_S + 30
        assert "30-hang" not in _status_plugins(env.shim)
        assert "10-inject" in _status_plugins(env.shim), env.shim.log_text()[-4000:]
        env.shim.runtime.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=120)
        assert "NRI: plugin 30-hang dropped" in env.shim.log_text()
    finally:
        _teardown(env, sid)


def test_failing_plugin_never_blocks_teardown(env: Env, external: list[subprocess.Popen[bytes]]) -> None:
    _start_external(env, external, "40", "fail", "fail=StopPodSandbox fail=RemovePodSandbox fail=StopContainer")
    sid, config = _sandbox(env, "fail", [("app", SMALL)])
    cid = _create(env, sid, config, "app", SMALL)
    env.shim.runtime.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=120)
    _teardown(env, sid)
    listed = env.shim.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items
    assert sid not in {s.id for s in listed}
    assert not [d for d in our_domains(env.shim) if sid[:32] in d]
    assert "40-fail" in _status_plugins(env.shim)  # an error is not a crash: the plugin stays
    log = env.shim.log_text()
    assert "NRI: plugin 40-fail failed StopContainer" in log
    assert "NRI: plugin 40-fail failed StopPodSandbox" in log
    assert "NRI: plugin 40-fail failed RemovePodSandbox" in log


def test_plugin_refusing_a_pod_fails_run_pod_sandbox(env: Env, external: list[subprocess.Popen[bytes]]) -> None:
    before = set(our_domains(env.shim))
    _start_external(env, external, "50", "veto", "fail=RunPodSandbox")
    with pytest.raises(grpc.RpcError) as err:
        _sandbox(env, "veto", [("app", SMALL)])
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert 'NRI plugin "50-veto" refused RunPodSandbox: test plugin refuses RunPodSandbox of veto' in (
        err.value.details() or ""
    )
    assert set(our_domains(env.shim)) <= before
    assert env.shim.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items == []


def test_plugin_growing_an_update_is_refused_naming_it(env: Env, external: list[subprocess.Popen[bytes]]) -> None:
    sid, config = _sandbox(env, "upd", [("app", SMALL)])
    try:
        cid = _create(env, sid, config, "app", SMALL)
        _start_external(env, external, "60", "upgrow", f"update-memory={1 << 30}")
        req = pb.UpdateContainerResourcesRequest(
            container_id=cid, linux=pb.LinuxContainerResources(memory_limit_in_bytes=16 << 20)
        )
        with pytest.raises(grpc.RpcError) as err:
            env.shim.runtime.UpdateContainerResources(req, timeout=60)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        message = err.value.details() or ""
        assert 'container "app" as NRI plugin "60-upgrow" adjusted it does not fit in the VM' in message
        status = env.shim.runtime.ContainerStatus(pb.ContainerStatusRequest(container_id=cid), timeout=30).status
        assert status.resources.linux.memory_limit_in_bytes == 32 << 20  # unchanged
    finally:
        _teardown(env, sid)
