"""The CRI front (``front/``) with real parts: containerd + runc downstream, a VM pod, the shim.

The front reads the CRI socket (its process is the socket's peer), is started again when it dies
and ends with the shim; a client cannot speak for it (``vmsandbox-`` metadata is dropped, the
shim's internal service is refused); the VM side of the lists it keeps follows every change at
once, those a caller makes and those the shim sees by itself (a guest destroyed); a list bigger
than any flow-control window crosses it intact.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from shim.config import DEFAULT_FRONT_BINARY
from tests.integration.cluster_support import built_crictl
from tests.integration.downstream_kit import Containerd, containerd
from tests.shim_kit import (
    LIBVIRT_URI,
    Shim,
    our_domains,
    pod,
    q,
    remove_all,
    require_host,
    start_shim,
    stop_shim,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


class Env:
    def __init__(self, tmp: Path, ctd: Containerd) -> None:
        self.tmp = tmp
        self.ctd = ctd
        self.config: dict[str, object] = {
            "downstream_endpoint": ctd.endpoint,
            "downstream_timeout_s": 10,
            "registries": [{"prefix": "docker.io", "location": ctd.registry, "insecure": True}],
        }
        self.shim: Shim = start_shim(tmp / "shim", extra_config=self.config, pull_busybox=False)


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    require_host()
    if not Path(DEFAULT_FRONT_BINARY).is_file():
        pytest.skip(f"{DEFAULT_FRONT_BINARY} is not built (make setup builds it)")
    tmp = Path(tempfile.mkdtemp(prefix="vmsandbox-front-"))
    (tmp / "net.d").mkdir()
    (tmp / "shim").mkdir()
    try:
        with containerd(tmp / "containerd", tmp / "net.d") as ctd:
            e = Env(tmp, ctd)
            try:
                yield e
            finally:
                try:
                    remove_all(e.shim)
                finally:
                    stop_shim(e.shim)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def front_pid(shim: Shim) -> int:
    """The shim's child running the front."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == shim.process.pid and os.readlink(proc / "exe") == DEFAULT_FRONT_BINARY:
                found.append(int(proc.name))
        except (OSError, ValueError, IndexError):
            continue
    assert len(found) == 1, found
    return found[0]


def eventually(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def host_network(name: str, annotations: dict[str, str] | None = None) -> pb.PodSandboxConfig:
    config = pod(name, declared=False)
    config.annotations.update(annotations or {})
    config.linux.security_context.namespace_options.network = pb.NODE
    return config


def test_the_front_reads_the_socket_comes_back_and_ends_with_the_shim(env: Env) -> None:
    pid = front_pid(env.shim)
    assert oct(env.shim.socket.stat().st_mode & 0o777) == "0o660"
    # the front reads the socket: stopped, nothing is answered; continued, all is
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(grpc.RpcError) as err:
            env.shim.runtime.Version(pb.VersionRequest(), timeout=1)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        os.kill(pid, signal.SIGCONT)
    env.shim.runtime.Version(pb.VersionRequest(), timeout=10)
    os.kill(pid, signal.SIGKILL)

    def answered_by_a_new_front() -> bool:
        try:
            env.shim.runtime.Version(pb.VersionRequest(), timeout=2)
            return front_pid(env.shim) != pid
        except (grpc.RpcError, OSError, AssertionError):
            return False

    eventually(answered_by_a_new_front, 10, "no new front answered")
    assert "exited with -9; starting it again" in env.shim.log_text()
    # the shim gone (SIGKILL: no shutdown of its own), its front goes too
    newer = front_pid(env.shim)
    stop_shim(env.shim, kill=True)
    eventually(lambda: not Path(f"/proc/{newer}").exists(), 10, "the front outlived its shim")
    env.shim = start_shim(env.tmp / "shim", extra_config=env.config, pull_busybox=False)


def test_a_client_cannot_speak_for_the_front(env: Env) -> None:
    shim = env.shim
    plain = host_network("plain")
    sid = shim.runtime.RunPodSandbox(pb.RunPodSandboxRequest(config=plain), timeout=120).pod_sandbox_id
    try:
        for _ in range(2):  # the second time, the front sends it straight to containerd
            status = shim.runtime.PodSandboxStatus(
                pb.PodSandboxStatusRequest(pod_sandbox_id=sid),
                metadata=(("vmsandbox-downstream", "pretend it failed"), ("vmsandbox-side", "vmsandbox")),
                timeout=30,
            )
            assert status.status.id == sid
        listed = shim.runtime.ListPodSandbox(
            pb.ListPodSandboxRequest(), metadata=(("vmsandbox-side", "vmsandbox"),), timeout=30
        ).items
        assert sid in {s.id for s in listed}
        with pytest.raises(grpc.RpcError) as err:
            shim.channel.unary_unary("/vmsandbox.internal.Front/SawList", None, None)(b"", timeout=10)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        shim.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=60)
        shim.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=60)


def test_a_client_breaking_http2_loses_its_connection_and_is_logged(env: Env) -> None:
    def h2frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:  # RFC 9113 4.1
        return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(env.shim.socket))
        # the preface, empty settings, then HEADERS on an even stream (a server's, not a client's)
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + h2frame(4, 0, 0, b"") + h2frame(1, 0x4, 2, b"\x83"))
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    kinds = []
    while len(got) >= 9:
        length = int.from_bytes(got[:3], "big")
        kinds.append(got[3])
        got = got[9 + length :]
    assert 7 in kinds, kinds  # GOAWAY, then the connection closed
    eventually(lambda: "client connection: stream 2: not a new client stream" in env.shim.log_text(), 5, "not logged")
    env.shim.runtime.Version(pb.VersionRequest(), timeout=10)  # the others carry on


def test_a_list_larger_than_any_window_crosses_intact(env: Env) -> None:
    shim = env.shim
    big = {f"example.com/note-{i}": f"{i:04d}" * 1024 for i in range(64)}  # 256 KiB of annotations
    sid = shim.runtime.RunPodSandbox(
        pb.RunPodSandboxRequest(config=host_network("big", big)), timeout=120
    ).pod_sandbox_id
    try:
        with env.ctd.runtime() as direct:
            theirs = {s.id: s for s in direct.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items}
        for _ in range(3):
            mine = {s.id: s for s in shim.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items}
            assert mine[sid] == theirs[sid]
            assert dict(mine[sid].annotations) == big
    finally:
        shim.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=60)
        shim.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=60)


def test_crictl_lists_both_kinds_of_pods_with_their_handler(env: Env) -> None:
    crictl = built_crictl()
    if not crictl:
        pytest.skip("crictl not found (set CRICTL or put cri-tools' crictl on PATH)")
    shim = env.shim
    plain = shim.runtime.RunPodSandbox(
        pb.RunPodSandboxRequest(config=host_network("crictl-plain")), timeout=120
    ).pod_sandbox_id
    config = pod("crictl-vm", containers=[("app", q({"cpu": "1", "memory": "64Mi"}))])
    vm = shim.runtime.RunPodSandbox(
        pb.RunPodSandboxRequest(config=config, runtime_handler="vmsandbox"), timeout=180
    ).pod_sandbox_id
    try:
        endpoint = f"unix://{shim.socket}"
        listed = subprocess.run(
            [crictl, "--runtime-endpoint", endpoint, "pods", "-o", "json"], capture_output=True, text=True, timeout=60
        )
        assert listed.returncode == 0, listed.stderr
        handlers = {p["id"]: p["runtimeHandler"] for p in json.loads(listed.stdout)["items"]}
        assert handlers == {plain: "", vm: "vmsandbox"}
        table = subprocess.run(
            [crictl, "--runtime-endpoint", endpoint, "pods"], capture_output=True, text=True, timeout=60
        ).stdout
        rows = {line.split()[0]: line.split()[-1] for line in table.splitlines()[1:]}
        assert rows == {plain[:13]: "(default)", vm[:13]: "vmsandbox"}, table
    finally:
        for sid in (plain, vm):
            shim.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=120)
            shim.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=120)


def test_the_lists_follow_every_change_of_the_vm_side(env: Env) -> None:
    shim = env.shim

    def sandboxes() -> dict[str, int]:
        return {s.id: s.state for s in shim.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items}

    def containers() -> dict[str, int]:
        listed = shim.runtime.ListContainers(pb.ListContainersRequest(), timeout=30).containers
        return {c.id: c.state for c in listed}

    before = sandboxes()
    config = pod("vm", containers=[("app", q({"cpu": "1", "memory": "64Mi"}))])
    config.log_directory = str(env.tmp / "logs")
    vm = shim.runtime.RunPodSandbox(
        pb.RunPodSandboxRequest(config=config, runtime_handler="vmsandbox"), timeout=180
    ).pod_sandbox_id
    try:
        assert sandboxes() == {**before, vm: pb.SANDBOX_READY}  # the reply passed the front: at once
        shim.images.PullImage(  # into vmsandbox's store: it names the VM pod
            pb.PullImageRequest(image=pb.ImageSpec(image="busybox"), sandbox_config=config), timeout=120
        )
        for _ in range(20):
            assert sandboxes()[vm] == pb.SANDBOX_READY
        cid = shim.runtime.CreateContainer(
            pb.CreateContainerRequest(
                pod_sandbox_id=vm,
                config=pb.ContainerConfig(
                    metadata=pb.ContainerMetadata(name="app"),
                    image=pb.ImageSpec(image="busybox"),
                    command=["/bin/sh", "-c", "sleep 1"],
                    log_path="app.log",
                    kubernetes_resources=q({"cpu": "1", "memory": "64Mi"}),
                ),
                sandbox_config=config,
            ),
            timeout=120,
        ).container_id
        assert containers()[cid] == pb.CONTAINER_CREATED
        shim.runtime.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=60)
        assert containers()[cid] == pb.CONTAINER_RUNNING
        # its exit is the guest's word, asked by every list while it runs
        eventually(lambda: containers()[cid] == pb.CONTAINER_EXITED, 60, "the exit never showed in the list")
        shim.runtime.RemoveContainer(pb.RemoveContainerRequest(container_id=cid), timeout=60)
        assert cid not in containers()
        # a change no caller made: the guest destroyed behind the shim's back
        import libvirt

        conn = libvirt.open(LIBVIRT_URI)
        try:
            for name in our_domains(shim):
                conn.lookupByName(name).destroy()
        finally:
            conn.close()
        eventually(lambda: sandboxes()[vm] == pb.SANDBOX_NOTREADY, 15, "the dead guest's pod still listed ready")
    finally:
        shim.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=vm), timeout=120)
        shim.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=vm), timeout=120)
    assert vm not in sandboxes()
