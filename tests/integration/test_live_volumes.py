"""Container volumes are the host's files, live, through the CRI socket with real guests: what one
container writes to a volume, the host and the pod's other containers see at once; what the host
writes, a running container sees; a read-only volume refuses writes; a writable file mount (the
termination log) is written in place; removing the pod leaves the volume's files on the host."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from tests.integration.image_setup import one_image_registry
from tests.registry_kit import busybox_entries
from tests.shim_kit import Shim, pod, q, require_host, running_shim

pytestmark = [pytest.mark.slow, pytest.mark.integration]

APPLETS = ("sh", "echo", "cat", "sleep", "touch", "[", "test", "stat")
SMALL = q({"cpu": "250m", "memory": "32Mi"})


@dataclass
class Env:
    shim: Shim
    image: str
    sandbox: str
    config: pb.PodSandboxConfig
    logs: Path
    volume: Path
    termination: Path


def _mounts(volume: Path, termination: Path, name: str) -> list[pb.Mount]:
    if name == "broken":  # the second host path does not exist: CreateContainer fails after the first bind
        return [
            pb.Mount(container_path="/data", host_path=str(volume)),
            pb.Mount(container_path="/gone", host_path=str(volume.parent / "missing")),
        ]
    if name == "writer":
        return [
            pb.Mount(container_path="/data", host_path=str(volume)),
            pb.Mount(container_path="/dev/termination-log", host_path=str(termination)),
        ]
    return [pb.Mount(container_path="/data", host_path=str(volume), readonly=True)]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    require_host()
    tmp = tmp_path_factory.mktemp("volumes")
    with one_image_registry(tmp, busybox_entries(APPLETS), "test/volumes:1") as ref:
        allowed = tmp / "allowed"
        volume, termination = allowed / "volume", allowed / "termination-log"
        volume.mkdir(parents=True)
        termination.write_text("")
        (tmp / "shim").mkdir()
        with running_shim(tmp / "shim", extra_config={"mount_allowlist": [str(allowed)]}, pull_busybox=False) as shim:
            shim.images.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image=ref)), timeout=300)
            config = pod("volumes", containers=[("writer", SMALL), ("reader", SMALL), ("broken", SMALL)])
            for decl in config.pod_resources.containers:
                decl.mounts.extend(_mounts(volume, termination, decl.name))
            config.log_directory = str(tmp / "logs")
            sid = shim.runtime.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=300).pod_sandbox_id
            yield Env(shim, ref, sid, config, tmp / "logs", volume, termination)


def _config(env: Env, name: str, script: str) -> pb.ContainerConfig:
    config = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name=name),
        image=pb.ImageSpec(image=env.image),
        command=["sh", "-c", script],
        log_path=f"{name}.log",
        mounts=_mounts(env.volume, env.termination, name),
    )
    config.kubernetes_resources.CopyFrom(SMALL)
    return config


def _start(env: Env, name: str, script: str) -> str:
    rt = env.shim.runtime
    config = _config(env, name, script)
    cid = rt.CreateContainer(
        pb.CreateContainerRequest(pod_sandbox_id=env.sandbox, config=config, sandbox_config=env.config), timeout=120
    ).container_id
    rt.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=120)
    return cid


def _wait_for(what: str, check: object, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _exited(env: Env, cid: str) -> pb.ContainerStatus:
    rt = env.shim.runtime
    _wait_for(
        f"container {cid[:12]} to exit",
        lambda: (
            rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid), timeout=60).status.state
            == pb.CONTAINER_EXITED
        ),
    )
    return rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid), timeout=60).status


def _stdout(env: Env, name: str) -> list[str]:
    out = []
    for line in (env.logs / f"{name}.log").read_text().splitlines():
        _, stream, _, text = line.split(" ", 3)
        if stream == "stdout":
            out.append(text)
    return out


def test_volumes_are_shared_live_between_host_and_containers(env: Env) -> None:
    # the writer waits for the host, so the host's file reaches a container that is already running
    writer = _start(
        env,
        "writer",
        "while [ ! -f /data/from-host ]; do sleep 0.2; done; cat /data/from-host; stat -c '%u:%g %a' /data/from-host; "
        "echo from the writer > /data/from-writer; echo finished > /dev/termination-log",
    )
    (env.volume / "from-host").write_text("from the host\n")
    (env.volume / "from-host").chmod(0o644)
    status = _exited(env, writer)
    assert status.exit_code == 0, _stdout(env, "writer")
    # a file of host root's, as the kubelet makes them, is QEMU's own in the guest (the idmapped bind)
    info = env.shim.runtime.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=env.sandbox, verbose=True))
    uid = json.loads(info.info["info"])["qemu_uid"]
    assert uid > 0 and _stdout(env, "writer") == ["from the host", f"{uid}:{uid} 644"]
    # what the guest made is host root's on the host, a plain 0600 file
    made = (env.volume / "from-writer").stat()
    assert (made.st_uid, made.st_gid, made.st_mode & 0o7777) == (0, 0, 0o600)
    assert (env.volume / "from-writer").read_text() == "from the writer\n"
    assert env.termination.read_text() == "finished\n"

    reader = _start(env, "reader", "cat /data/from-writer; touch /data/nope 2>&1 || echo refused")
    assert _exited(env, reader).exit_code == 0
    lines = _stdout(env, "reader")
    assert lines[0] == "from the writer" and lines[-1] == "refused", lines
    assert not (env.volume / "nope").exists()


def _qemu_mounts(env: Env) -> list[str]:
    """Volume mount points (below the sandbox's shared directory) in its QEMU's mount namespace;
    the pod's image trees, bound beside it for the pod's life, are not volumes."""
    status = env.shim.runtime.PodSandboxStatus(
        pb.PodSandboxStatusRequest(pod_sandbox_id=env.sandbox, verbose=True), timeout=30
    )
    domain = json.loads(status.info["info"])["domain"]
    pid = Path(f"/run/libvirt/qemu/{domain}.pid").read_text().strip()
    mountinfo = Path(f"/proc/{pid}/mountinfo").read_text()
    return [line.split()[4] for line in mountinfo.splitlines() if f"{env.sandbox}/shared" in line.split()[4]]


def test_exited_containers_let_go_and_a_failed_create_leaves_no_bind(env: Env) -> None:
    assert _qemu_mounts(env) == []  # writer and reader have exited: their binds are detached
    with pytest.raises(grpc.RpcError) as info:
        env.shim.runtime.CreateContainer(
            pb.CreateContainerRequest(
                pod_sandbox_id=env.sandbox, config=_config(env, "broken", "true"), sandbox_config=env.config
            ),
            timeout=120,
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not exist" in str(info.value.details())
    assert _qemu_mounts(env) == []
    containers = env.shim.state_dir / "sandboxes" / env.sandbox / "shared" / "containers"
    assert sorted(p.name for p in containers.iterdir()) == sorted(
        c.id for c in env.shim.runtime.ListContainers(pb.ListContainersRequest(), timeout=30).containers
    )


def test_volumes_do_not_count_as_the_runtimes_disk_use(env: Env) -> None:
    def used() -> int:
        fs = env.shim.images.ImageFsInfo(pb.ImageFsInfoRequest(), timeout=60).container_filesystems[0]
        return fs.used_bytes.value

    before = used()
    (env.volume / "big").write_bytes(b"\1" * (16 << 20))
    try:
        assert used() - before < 1 << 20
    finally:
        (env.volume / "big").unlink()


def test_removing_the_pod_keeps_the_volume(env: Env) -> None:
    rt = env.shim.runtime
    rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=env.sandbox), timeout=120)
    rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=env.sandbox), timeout=120)
    assert sorted(p.name for p in env.volume.iterdir()) == ["from-host", "from-writer"]
    assert env.termination.read_text() == "finished\n"
    assert not (env.shim.state_dir / "sandboxes" / env.sandbox).exists()
    mountinfo = Path("/proc/self/mountinfo").read_text()
    assert str(env.shim.state_dir) not in mountinfo
