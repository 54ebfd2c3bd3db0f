"""Containers through the CRI socket: a real shim, real guests (the image of $VMSANDBOX_IMAGE_DIR),
real crun inside them, images pulled from a real registry on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from tests.integration.image_setup import one_image_registry
from tests.registry_kit import busybox_entries, file
from tests.shim_kit import Shim, pod, q, require_host, running_shim

pytestmark = [pytest.mark.slow, pytest.mark.integration]

APPLETS = ("sh", "echo", "cat", "sleep", "dd", "true", "ls", "id", "printf")
SMALL = q({"cpu": "250m", "memory": "32Mi"})
LONG = q({"cpu": "250m", "memory": "48Mi"})


@dataclass
class Env:
    shim: Shim
    image: str
    sandbox: str
    config: pb.PodSandboxConfig
    logs: Path
    allowed: Path


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    require_host()
    tmp = tmp_path_factory.mktemp("containers")
    entries = [*busybox_entries(APPLETS), file("data/original", b"from the image\n")]
    default = ("sh", "-c", "echo image default")
    with one_image_registry(tmp, entries, "test/busybox:1", cmd=default) as ref:
        allowed = tmp / "allowed"
        allowed.mkdir()
        (tmp / "shim").mkdir()
        with running_shim(tmp / "shim", extra_config={"mount_allowlist": [str(allowed)]}) as shim:
            shim.images.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image=ref)), timeout=300)
            apps = [("exit3", SMALL), ("hog", SMALL), ("long", LONG), ("writer", SMALL)]
            config = pod("ctr", init=[("setup", SMALL)], containers=apps)
            for decl in config.pod_resources.containers:
                if decl.name == "writer":
                    decl.mounts.append(_note_mount(allowed))
                if decl.name == "long":
                    decl.mounts.append(_termination_mount(allowed))
            logs = tmp / "logs"
            config.log_directory = str(logs)
            sid = shim.runtime.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=300).pod_sandbox_id
            yield Env(shim, ref, sid, config, logs, allowed)


def _note_mount(allowed: Path) -> pb.Mount:
    return pb.Mount(container_path="/mnt/note", host_path=str(allowed / "note"), readonly=True)


def _termination_mount(allowed: Path) -> pb.Mount:
    return pb.Mount(container_path="/dev/termination-log", host_path=str(allowed / "termination-log"))


def _config(env: Env, name: str, argv: list[str], res: pb.KubernetesResources = SMALL) -> pb.ContainerConfig:
    c = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name=name),
        image=pb.ImageSpec(image=env.image),
        command=argv[:1],
        args=argv[1:],
        log_path=f"{name}.log",
    )
    c.kubernetes_resources.CopyFrom(res)
    return c


def _run(env: Env, config: pb.ContainerConfig) -> str:
    rt = env.shim.runtime
    cid = rt.CreateContainer(
        pb.CreateContainerRequest(pod_sandbox_id=env.sandbox, config=config, sandbox_config=env.config), timeout=120
    ).container_id
    rt.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=120)
    return cid


def _status(env: Env, cid: str) -> pb.ContainerStatus:
    return env.shim.runtime.ContainerStatus(pb.ContainerStatusRequest(container_id=cid), timeout=60).status


def _wait_exit(env: Env, cid: str, timeout_s: float = 90) -> pb.ContainerStatus:
    deadline = time.monotonic() + timeout_s
    while (st := _status(env, cid)).state != pb.CONTAINER_EXITED:
        assert time.monotonic() < deadline, f"{cid[:12]} still {st.state}\n{env.shim.log_text()[-3000:]}"
        time.sleep(0.2)
    return st


def _log_lines(path: Path) -> list[tuple[str, str, str]]:
    out = []
    for line in path.read_text().splitlines():
        stamp, stream, tag, text = line.split(" ", 3)
        assert stamp.endswith("Z"), line
        out.append((stream, tag, text))
    return out


def test_init_container_runs_to_completion_first(env: Env) -> None:
    cid = _run(env, _config(env, "setup", ["sh", "-c", "echo init done"]))
    st = _wait_exit(env, cid)
    assert (st.exit_code, st.reason) == (0, "Completed")
    assert ("stdout", "F", "init done") in _log_lines(Path(st.log_path))


def test_exit_code_status_and_logs(env: Env) -> None:
    cid = _run(env, _config(env, "exit3", ["sh", "-c", "echo hello; echo oops >&2; exit 3"]))
    st = _wait_exit(env, cid)
    assert (st.exit_code, st.reason) == (3, "Error")
    assert 0 < st.created_at <= st.started_at <= st.finished_at
    assert st.log_path == str(env.logs / "exit3.log")
    assert st.image.image == env.image and st.image_ref.startswith(env.image.rsplit(":", 1)[0] + "@sha256:")
    lines = _log_lines(Path(st.log_path))
    assert ("stdout", "F", "hello") in lines and ("stderr", "F", "oops") in lines
    listed = env.shim.runtime.ListContainers(
        pb.ListContainersRequest(filter=pb.ContainerFilter(state=pb.ContainerStateValue(state=pb.CONTAINER_EXITED))),
        timeout=60,
    ).containers
    assert cid in {c.id for c in listed}
    env.shim.runtime.RemoveContainer(pb.RemoveContainerRequest(container_id=cid), timeout=60)
    assert cid not in {c.id for c in env.shim.runtime.ListContainers(pb.ListContainersRequest(), timeout=60).containers}


def test_oom_killed_by_its_own_limit(env: Env) -> None:
    cid = _run(env, _config(env, "hog", ["dd", "if=/dev/zero", "of=/dev/null", "bs=96M", "count=1"]))
    st = _wait_exit(env, cid)
    assert (st.reason, st.exit_code) == ("OOMKilled", 137)


def test_long_running_exec_stats_stop(env: Env) -> None:
    on_term = "echo bye; echo terminated politely > /dev/termination-log; exit 0"
    script = f"trap '{on_term}' TERM; echo up; while :; do sleep 0.2; done"
    (env.allowed / "termination-log").write_text("")
    config = _config(env, "long", ["sh", "-c", script], LONG)
    config.mounts.append(_termination_mount(env.allowed))
    cid = _run(env, config)
    rt = env.shim.runtime
    assert _status(env, cid).state == pb.CONTAINER_RUNNING
    res = rt.ExecSync(
        pb.ExecSyncRequest(container_id=cid, cmd=["sh", "-c", "echo out; echo err >&2; exit 4"], timeout=30), timeout=60
    )
    assert (res.stdout, res.stderr, res.exit_code) == (b"out\n", b"err\n", 4)
    with pytest.raises(grpc.RpcError) as info:
        rt.ExecSync(pb.ExecSyncRequest(container_id=cid, cmd=["sleep", "20"], timeout=1), timeout=60)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    stats = rt.ContainerStats(pb.ContainerStatsRequest(container_id=cid), timeout=60).stats
    assert stats.attributes.id == cid
    assert stats.cpu.usage_core_nano_seconds.value > 0 and stats.memory.working_set_bytes.value > 0
    listed = rt.ListContainerStats(pb.ListContainerStatsRequest(), timeout=60).stats
    assert cid in {s.attributes.id for s in listed}
    pod_stats = rt.PodSandboxStats(pb.PodSandboxStatsRequest(pod_sandbox_id=env.sandbox), timeout=60).stats
    assert pod_stats.linux.memory.working_set_bytes.value > 0
    assert cid in {c.attributes.id for c in pod_stats.linux.containers}
    # the kubelet stats every mountpoint it is given on the host (cadvisor's device of a directory)
    fs_info = env.shim.images.ImageFsInfo(pb.ImageFsInfoRequest(), timeout=60)
    mountpoints = {s.writable_layer.fs_id.mountpoint for s in [stats, *listed, *pod_stats.linux.containers]}
    mountpoints |= {f.fs_id.mountpoint for f in [*fs_info.image_filesystems, *fs_info.container_filesystems]}
    assert all(Path(m).is_dir() for m in mountpoints), mountpoints
    rt.StopContainer(pb.StopContainerRequest(container_id=cid, timeout=20), timeout=120)
    st = _status(env, cid)
    assert (st.state, st.exit_code, st.reason) == (pb.CONTAINER_EXITED, 0, "Completed")
    assert ("stdout", "F", "bye") in _log_lines(Path(st.log_path))
    assert (env.allowed / "termination-log").read_text() == "terminated politely\n"
    with pytest.raises(grpc.RpcError) as info:
        rt.ExecSync(pb.ExecSyncRequest(container_id=cid, cmd=["true"], timeout=5), timeout=60)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_writes_do_not_leak_into_the_image(env: Env) -> None:
    (env.allowed / "note").write_text("from the host\n")
    config = _config(
        env,
        "writer",
        ["sh", "-c", "cat /mnt/note; echo changed > /data/original; echo x > /data/new; cat /data/original"],
    )
    config.mounts.append(pb.Mount(container_path="/mnt/note", host_path=str(env.allowed / "note"), readonly=True))
    st = _wait_exit(env, _run(env, config))
    assert st.exit_code == 0
    lines = _log_lines(Path(st.log_path))
    assert ("stdout", "F", "from the host") in lines and ("stdout", "F", "changed") in lines
    with tempfile.TemporaryDirectory() as tmp:  # the image's files, as its disk holds them
        tree = Path(tmp) / "tree"
        for i, disk in enumerate((env.shim.state_dir / "images" / "disks").glob("*.erofs")):
            subprocess.run(["fsck.erofs", f"--extract={tree}{i}", str(disk)], check=True, capture_output=True)
        trees = [t for t in Path(tmp).iterdir() if (t / "data").is_dir()]
        assert len(trees) == 1  # the image's disk, whatever the store names it
        assert (trees[0] / "data" / "original").read_text() == "from the image\n"
        assert not (trees[0] / "data" / "new").exists()


def test_writable_layers_count_in_image_fs_info(env: Env) -> None:
    def container_fs() -> tuple[int, int]:
        fs = env.shim.images.ImageFsInfo(pb.ImageFsInfoRequest(), timeout=60).container_filesystems[0]
        return fs.used_bytes.value, fs.inodes_used.value

    before = container_fs()
    config = _config(env, "writer", ["sh", "-c", "dd if=/dev/zero of=/data/blob bs=1024 count=4096; sleep 600"])
    config.metadata.attempt = 1
    config.mounts.append(_note_mount(env.allowed))  # as the pod declared it
    cid = _run(env, config)
    try:
        deadline = time.monotonic() + 60
        while (after := container_fs())[0] < before[0] + (4 << 20):
            assert time.monotonic() < deadline, f"container file system {before} -> {after}"
            time.sleep(0.5)
        assert after[1] > before[1]
        stats = env.shim.runtime.ContainerStats(pb.ContainerStatsRequest(container_id=cid), timeout=60).stats
        assert stats.writable_layer.used_bytes.value >= 4 << 20
    finally:
        env.shim.runtime.StopContainer(pb.StopContainerRequest(container_id=cid, timeout=0), timeout=60)
        env.shim.runtime.RemoveContainer(pb.RemoveContainerRequest(container_id=cid), timeout=60)
    assert container_fs()[0] < before[0] + (4 << 20)


def test_mount_outside_the_allowed_paths_is_refused(env: Env) -> None:
    config = _config(env, "exit3", ["true"])
    config.metadata.attempt = 7
    config.mounts.append(pb.Mount(container_path="/host-etc", host_path="/etc"))
    with pytest.raises(grpc.RpcError) as info:
        env.shim.runtime.CreateContainer(
            pb.CreateContainerRequest(pod_sandbox_id=env.sandbox, config=config, sandbox_config=env.config), timeout=60
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'/etc'" in str(info.value.details())


def test_a_unique_id_prefix_names_the_container_in_the_guest_and_on_disk(env: Env) -> None:
    config = _config(env, "setup", ["sleep", "300"])
    config.metadata.attempt = 7  # a retry of a declared container
    cid = _run(env, config)
    prefix = cid[:13]
    rt = env.shim.runtime
    res = rt.ExecSync(pb.ExecSyncRequest(container_id=prefix, cmd=["echo", "hi"], timeout=30), timeout=60)
    assert (res.exit_code, res.stdout) == (0, b"hi\n")
    own_dir = env.shim.state_dir / "sandboxes" / env.sandbox / "shared" / "containers" / cid
    assert own_dir.is_dir()
    rt.StopContainer(pb.StopContainerRequest(container_id=prefix, timeout=2), timeout=120)
    assert _status(env, cid).state == pb.CONTAINER_EXITED
    rt.RemoveContainer(pb.RemoveContainerRequest(container_id=prefix), timeout=60)
    assert not own_dir.exists(), "the container's directory outlived RemoveContainer by a prefix"
    assert cid not in {c.id for c in rt.ListContainers(pb.ListContainersRequest(), timeout=60).containers}


def test_a_container_without_a_log_path_is_not_held_back_by_its_output(env: Env) -> None:
    """The agent holds 1 MiB of a container's output until the host takes it; with no log path
    the host still takes (and drops) it, so a container writing more runs to its end."""
    config = _config(env, "setup", ["dd", "if=/dev/zero", "bs=65536", "count=64"])  # 4 MiB to stdout
    config.metadata.attempt = 3
    config.log_path = ""
    st = _wait_exit(env, _run(env, config))
    assert (st.exit_code, st.log_path) == (0, "")


def test_guest_death_exits_its_containers(env: Env) -> None:
    """Last: it kills the pod's QEMU."""
    config = _config(env, "exit3", ["sleep", "600"])
    config.metadata.attempt = 1
    cid = _run(env, config)
    assert _status(env, cid).state == pb.CONTAINER_RUNNING
    info = json.loads(
        env.shim.runtime.PodSandboxStatus(
            pb.PodSandboxStatusRequest(pod_sandbox_id=env.sandbox, verbose=True), timeout=30
        ).info["info"]
    )
    pid = int(Path(f"/run/libvirt/qemu/{info['domain']}.pid").read_text())
    os.kill(pid, signal.SIGKILL)
    st = _wait_exit(env, cid, timeout_s=60)
    assert st.reason == "SandboxDied", st
    with pytest.raises(grpc.RpcError) as err:
        env.shim.runtime.ExecSync(pb.ExecSyncRequest(container_id=cid, cmd=["true"], timeout=5), timeout=60)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
