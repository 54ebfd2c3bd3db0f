"""Mount propagation from the host into a running container, through the CRI socket with a real
guest (critest's "mount with 'rslave'"): a mount the host makes below a HostToContainer or
Bidirectional volume's source after the container started reaches it, as the volume's own files
do, though it is root's and 0700 and QEMU runs as an unprivileged uid; one the host takes away
goes; a Private volume keeps what it had."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from tests.integration.image_setup import one_image_registry
from tests.registry_kit import busybox_entries
from tests.shim_kit import Shim, pod, q, require_host, running_shim

pytestmark = [pytest.mark.slow, pytest.mark.integration]

APPLETS = ("sh", "cat", "ls", "sleep")
SMALL = q({"cpu": "250m", "memory": "32Mi"})
PROPAGATIONS = {
    "slave": pb.PROPAGATION_HOST_TO_CONTAINER,
    "shared": pb.PROPAGATION_BIDIRECTIONAL,
    "private": pb.PROPAGATION_PRIVATE,
}


@dataclass
class Env:
    shim: Shim
    image: str
    sandbox: str
    config: pb.PodSandboxConfig
    volumes: Path


def _mounts(volumes: Path, name: str) -> list[pb.Mount]:
    return [pb.Mount(container_path="/vol", host_path=str(volumes / name), propagation=PROPAGATIONS[name])]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    require_host()
    tmp = tmp_path_factory.mktemp("propagation")
    with one_image_registry(tmp, busybox_entries(APPLETS), "test/propagation:1") as ref:
        volumes = tmp / "allowed"
        sources = []
        for name in PROPAGATIONS:  # each source an rshared mount of its own, as critest makes them
            source = volumes / name
            (source / "later").mkdir(parents=True)
            subprocess.run(["mount", "--bind", str(source), str(source)], check=True)
            subprocess.run(["mount", "--make-rshared", str(source)], check=True)
            sources.append(source)
        try:
            (tmp / "shim").mkdir()
            extra: dict[str, object] = {"mount_allowlist": [str(volumes)]}
            with running_shim(tmp / "shim", extra_config=extra, pull_busybox=False) as shim:
                shim.images.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image=ref)), timeout=300)
                config = pod("propagation", containers=[(name, SMALL) for name in PROPAGATIONS])
                for decl in config.pod_resources.containers:
                    decl.mounts.extend(_mounts(volumes, decl.name))
                config.log_directory = str(tmp / "logs")
                sid = shim.runtime.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=300).pod_sandbox_id
                yield Env(shim, ref, sid, config, volumes)
                shim.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=120)
                shim.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=120)
        finally:
            for source in sources:
                subprocess.run(["umount", "-R", str(source)], capture_output=True)


def _start(env: Env, name: str) -> str:
    config = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name=name),
        image=pb.ImageSpec(image=env.image),
        command=["sleep", "600"],
        log_path=f"{name}.log",
        mounts=_mounts(env.volumes, name),
    )
    config.kubernetes_resources.CopyFrom(SMALL)
    rt = env.shim.runtime
    req = pb.CreateContainerRequest(pod_sandbox_id=env.sandbox, config=config, sandbox_config=env.config)
    cid = rt.CreateContainer(req, timeout=120).container_id
    rt.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=120)
    return cid


def _exec(env: Env, cid: str, script: str) -> tuple[int, str]:
    req = pb.ExecSyncRequest(container_id=cid, cmd=["sh", "-c", script], timeout=60)
    res = env.shim.runtime.ExecSync(req, timeout=120)
    return res.exit_code, (res.stdout + res.stderr).decode(errors="replace").strip()


def _mount_private_tmpfs(at: Path) -> None:
    """A tmpfs of root's, 0700, with a 0600 file: closed to QEMU's uid unless it is idmapped."""
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0700", "none", str(at)], check=True)
    (at / "flag").write_text("mounted after the start\n")
    (at / "flag").chmod(0o600)


@pytest.mark.parametrize("name", ["slave", "shared"])
def test_a_host_mount_made_after_the_start_reaches_the_container(env: Env, name: str) -> None:
    cid = _start(env, name)
    assert _exec(env, cid, "ls -A /vol/later") == (0, "")
    later = env.volumes / name / "later"
    _mount_private_tmpfs(later)
    try:
        assert _exec(env, cid, "cat /vol/later/flag") == (0, "mounted after the start")
    finally:
        subprocess.run(["umount", str(later)], check=True)
    assert _exec(env, cid, "ls -A /vol/later") == (0, "")


def test_a_private_volume_keeps_what_it_had(env: Env) -> None:
    cid = _start(env, "private")
    later = env.volumes / "private" / "later"
    _mount_private_tmpfs(later)
    try:
        assert _exec(env, cid, "ls -A /vol/later") == (0, "")
    finally:
        subprocess.run(["umount", str(later)], check=True)
