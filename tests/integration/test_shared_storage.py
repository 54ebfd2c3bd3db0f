"""What a guest writes on the host is bounded by its pod's ephemeral-storage, with a real guest.

Guest init (reached with ``nsenter`` from a privileged container in the guest's PID namespace; it
owns the 9p mount of the sandbox's shared directory) writes 64 MiB onto the share of a pod that
declared 16 MiB: it gets ENOSPC after about 16 MiB, the host holds no more than the sandbox's
image, the stats and ImageFsInfo report what it wrote, and RemovePodSandbox leaves no mount, loop
device or image. A shim killed half-way through RunPodSandbox leaves the sandbox's file system
mounted; the next shim's reconcile removes it."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from tests.shim_kit import Shim, pod, q, require_host, running_shim, start_shim, stop_shim
from vmsandbox import shared_storage
from vmsandbox.adapters import share_image

pytestmark = [pytest.mark.slow, pytest.mark.integration]

MI = 1 << 20
LIMITED = q({"cpu": "250m", "memory": "32Mi", "ephemeral-storage": "16Mi"})
FILL = (
    "nsenter -t 1 -m sh -c 'dd if=/dev/zero of=/run/vmsandbox/shared/fill bs=1048576 count=64 2>&1; "
    'echo "dd exit $?"; sync\'; exit 0'
)


def _host_leftovers(state: Path) -> tuple[list[str], list[str], list[str]]:
    """(entries below sandboxes/, mounts below the state, loop devices backed by a file of it)."""
    root = Path(os.path.realpath(state)) / "sandboxes"
    entries = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
    mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines() if str(root) in line]
    loops = []
    for f in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            if f.read_text().startswith(str(root)):
                loops.append(f.parent.parent.name)
        except OSError:
            continue
    return entries, mounts, loops


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shim]:
    require_host()
    with running_shim(tmp_path_factory.mktemp("shared-storage")) as running:
        yield running


def test_a_guest_writing_past_its_pods_ephemeral_storage_gets_enospc(
    shim: Shim, tmp_path_factory: pytest.TempPathFactory
) -> None:
    rt = shim.runtime
    logs = tmp_path_factory.mktemp("logs")
    config = pod("filler", containers=[("filler", LIMITED)])
    config.linux.security_context.privileged = True
    config.log_directory = str(logs)
    sid = rt.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=300).pod_sandbox_id
    top = Path(os.path.realpath(shim.state_dir)) / "sandboxes" / sid
    image = top.parent / f"{sid}.img"
    try:
        assert share_image.is_mount(top)
        assert image.stat().st_size == shared_storage.image_bytes(16 * MI)
        c = pb.ContainerConfig(
            metadata=pb.ContainerMetadata(name="filler"),
            image=pb.ImageSpec(image="busybox"),
            command=["sh", "-c", "sleep 600"],
            log_path="filler.log",
        )
        c.kubernetes_resources.CopyFrom(LIMITED)
        c.linux.security_context.privileged = True
        c.linux.security_context.namespace_options.pid = pb.POD
        cid = rt.CreateContainer(
            pb.CreateContainerRequest(pod_sandbox_id=sid, config=c, sandbox_config=config), timeout=120
        ).container_id
        rt.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=120)
        fs_before = shim.images.ImageFsInfo(pb.ImageFsInfoRequest(), timeout=60).container_filesystems[0]
        res = rt.ExecSync(
            pb.ExecSyncRequest(container_id=cid, cmd=["/bin/busybox", "sh", "-c", FILL], timeout=120), timeout=180
        )
        out = res.stdout.decode(errors="replace")
        assert "No space left on device" in out and "dd exit 1" in out, out
        written = (top / "shared" / "fill").stat().st_size  # under 9p's mapped model a plain file
        assert 16 * MI <= written <= 18 * MI, written
        assert image.stat().st_blocks * 512 <= shared_storage.image_bytes(16 * MI)
        # the kubelet sees it: in the container's writable layer and the container file system
        stats = rt.ContainerStats(pb.ContainerStatsRequest(container_id=cid), timeout=60).stats
        assert stats.writable_layer.used_bytes.value >= written
        pod_stats = rt.PodSandboxStats(pb.PodSandboxStatsRequest(pod_sandbox_id=sid), timeout=60).stats
        assert pod_stats.linux.containers[0].writable_layer.used_bytes.value >= written
        fs_after = shim.images.ImageFsInfo(pb.ImageFsInfoRequest(), timeout=60).container_filesystems[0]
        assert fs_after.used_bytes.value >= fs_before.used_bytes.value + written - MI
    finally:
        rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=120)
        rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=120)
    assert _host_leftovers(shim.state_dir) == ([], [], [])


def test_a_shim_killed_after_mounting_leaves_nothing_once_restarted(tmp_path: Path) -> None:
    require_host()
    shim = start_shim(tmp_path, env={"VMSANDBOX_FAULT": "RunPodSandbox:define"}, pull_busybox=False)
    try:
        config = pod("killed", containers=[("app", LIMITED)])
        with pytest.raises(grpc.RpcError):
            shim.runtime.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=300)
        shim.process.wait(timeout=30)
        entries, mounts, loops = _host_leftovers(shim.state_dir)
        assert len(entries) == 2 and len(mounts) == 1 and len(loops) == 1, (entries, mounts, loops)
    finally:
        stop_shim(shim)
    again = start_shim(tmp_path, pull_busybox=False)
    try:
        deadline = time.monotonic() + 60
        while _host_leftovers(again.state_dir) != ([], [], []):
            assert time.monotonic() < deadline, _host_leftovers(again.state_dir)
            time.sleep(0.2)
    finally:
        stop_shim(again)
        shutil.rmtree(tmp_path, ignore_errors=True)
