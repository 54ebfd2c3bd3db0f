"""Each sandbox's directory is a file system of its own (vmsandbox.adapters.share_image through
shim.sandbox_dirs): a guest writing past its capacity gets ENOSPC and the host's disk stays
untouched; its use is read in O(1), so ImageFsInfo answers whatever the guest nested there; it is
reported in the stats; and neither a removal, a failed make nor a failed RunPodSandbox leaves a
mount, a loop device or an image behind. Needs root and loop devices (as the shim does)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from shim.model import CONTAINER_RUNNING
from shim.sandbox_dirs import SandboxDirs
from tests.cri_server import SEED_CONTAINER, SEED_SANDBOXES, Server, assert_no_leak, cri_server
from vmsandbox import shared_storage
from vmsandbox.adapters import share_image
from vmsandbox.agent_ops import CgroupStats
from vmsandbox.errors import InfrastructureError

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        os.geteuid() != 0 or not os.path.exists("/dev/loop-control"), reason="needs root and loop devices"
    ),
]

MI = 1 << 20
SID = "5a" * 32
QEMU_UID = 4242


def loops_backed_by(under: Path) -> list[str]:
    """Loop devices whose backing file is (or was) below ``under``."""
    out = []
    for f in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            if f.read_text().strip().startswith(str(under)):
                out.append(f.parent.parent.name)
        except OSError:
            continue
    return out


def mounts_below(under: Path) -> list[str]:
    return [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines() if str(under) in line]


def assert_nothing_left(dirs: SandboxDirs, sid: str) -> None:
    assert not (dirs.root / sid).exists()
    assert not dirs.image(sid).exists()
    assert mounts_below(dirs.root) == []
    assert loops_backed_by(dirs.root) == []


@pytest.fixture
def dirs(tmp_path: Path) -> Iterator[SandboxDirs]:
    d = SandboxDirs(str(tmp_path / "state"))
    try:
        yield d
    finally:
        d.sweep(set())


def fill(path: Path) -> int:
    """Write 1 MiB blocks into ``path`` until the file system refuses; the bytes written."""
    written = 0
    block = b"\xa5" * MI
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            try:
                written += os.write(fd, block)
                os.fsync(fd)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                return written
            assert written < 64 * MI, "the file system did not stop the writer"
    finally:
        os.close(fd)


def test_a_writer_past_the_capacity_gets_enospc_and_the_host_holds_only_the_image(dirs: SandboxDirs) -> None:
    capacity = 16 * MI
    (share,) = dirs.make(SID, QEMU_UID, capacity)
    top = dirs.root / SID
    assert share.source == str(dirs.shared(SID))
    assert share_image.is_mount(top) and mounts_below(dirs.root) == [str(top)]
    st = os.stat(top)
    assert (st.st_uid, st.st_mode & 0o777) == (QEMU_UID, 0o700)
    assert sorted(os.listdir(top)) == ["shared"]  # no lost+found
    image = dirs.image(SID)
    assert image.stat().st_size == shared_storage.image_bytes(capacity)
    assert image.stat().st_mode & 0o777 == 0o600 and image.stat().st_uid == 0
    assert image.stat().st_blocks * 512 < MI  # sparse until written
    written = fill(dirs.shared(SID) / "big")
    assert capacity <= written <= capacity + 4 * MI
    usage = dirs.usage(SID)
    assert usage is not None and usage.used_bytes >= written
    assert image.stat().st_blocks * 512 <= shared_storage.image_bytes(capacity)
    # what the guest deletes is given back to the host (discard punches it out of the image)
    os.unlink(dirs.shared(SID) / "big")
    os.sync()
    deadline = time.monotonic() + 10
    while image.stat().st_blocks * 512 > 4 * MI:
        assert time.monotonic() < deadline, f"the image still holds {image.stat().st_blocks * 512} bytes"
        time.sleep(0.1)
    dirs.drop(SID)
    assert_nothing_left(dirs, SID)


def test_usage_is_one_statvfs_whatever_the_nesting(dirs: SandboxDirs) -> None:
    dirs.make(SID, QEMU_UID, 64 * MI)
    fd = os.open(dirs.shared(SID), os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(1500):
        os.mkdir("d", dir_fd=fd)
        child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = child
    os.close(fd)
    usage = dirs.usage(SID)
    assert usage is not None and usage.used_inodes >= 1500 and usage.used_bytes >= 1500 * 4096
    assert dirs.total_usage() == (usage.used_bytes, usage.used_inodes)
    started = time.monotonic()
    dirs.drop(SID)  # unmounted and the image deleted: nothing the guest made is walked
    assert time.monotonic() - started < 2
    assert_nothing_left(dirs, SID)


def test_a_plain_directory_has_no_usage(dirs: SandboxDirs) -> None:
    dirs.make(SID, os.getuid(), None)  # a snapshot's placeholder: never started, nothing written
    assert not share_image.is_mount(dirs.root / SID) and dirs.usage(SID) is None
    dirs.drop(SID)
    assert_nothing_left(dirs, SID)


@pytest.mark.parametrize("step", ["mkfs", "mount", "after-mount"])
def test_a_make_that_fails_leaves_nothing(dirs: SandboxDirs, monkeypatch: pytest.MonkeyPatch, step: str) -> None:
    if step == "mkfs":
        real = share_image.make
        monkeypatch.setattr(share_image, "make", lambda *a, **k: real(*a, **k, mkfs="/bin/false"))
    elif step == "mount":
        monkeypatch.setattr(share_image, "MOUNT_DATA", b"no-such-option")
    else:

        def refuse(*args: object) -> None:
            raise InfrastructureError("the guest changed it")

        monkeypatch.setattr("vmsandbox.adapters.shared_tree.make_dirs", refuse)
    with pytest.raises(InfrastructureError):
        dirs.make(SID, QEMU_UID, 16 * MI)
    assert_nothing_left(dirs, SID)


def test_make_refuses_a_directory_that_exists(dirs: SandboxDirs) -> None:
    dirs.make(SID, QEMU_UID, 16 * MI)
    with pytest.raises(InfrastructureError, match="exists already"):
        dirs.make(SID, QEMU_UID, 16 * MI)
    assert share_image.is_mount(dirs.root / SID)  # the existing one is left alone


def test_the_sweep_removes_forgotten_mounts_and_stray_images(dirs: SandboxDirs) -> None:
    kept, forgotten, stray = "1" * 64, "2" * 64, "3" * 64
    for sid in (kept, forgotten):
        dirs.make(sid, QEMU_UID, 16 * MI)
    dirs.root.joinpath(f"{stray}.img").write_bytes(b"")  # a crash between making the image and mounting it
    dirs.sweep({kept})
    assert sorted(p.name for p in dirs.root.iterdir()) == [kept, f"{kept}.img"]
    assert mounts_below(dirs.root) == [str(dirs.root / kept)]
    assert len(loops_backed_by(dirs.root)) == 1


# -- through the CRI ------------------------------------------------------------------------------------
@pytest.fixture
def server() -> Iterator[Server]:
    with cri_server() as s:
        yield s


def _nest(top: Path, depth: int) -> None:
    """As a guest would: directories inside directories, past Python's recursion limit."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth):
        os.mkdir("d", dir_fd=fd)
        child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = child
    os.close(fd)


def _container_fs(server: Server) -> pb.FilesystemUsage:
    code, details, body = server.rpc("ImageFsInfo", pb.ImageFsInfoRequest())
    assert code == grpc.StatusCode.OK, details
    (fs,) = pb.ImageFsInfoResponse.FromString(body).container_filesystems
    return fs


def test_image_fs_info_answers_promptly_after_a_guest_nests_1500_directories(server: Server) -> None:
    sb = server.sandboxes
    sb.dirs.make(SEED_SANDBOXES[0], QEMU_UID, 64 * MI)
    before = _container_fs(server)
    _nest(sb.dirs.shared(SEED_SANDBOXES[0]), 1600)
    with open(sb.dirs.shared(SEED_SANDBOXES[0]) / "blob", "wb") as f:
        f.write(b"x" * (4 * MI))
    started = time.monotonic()
    after = _container_fs(server)
    assert time.monotonic() - started < 2
    assert after.used_bytes.value >= before.used_bytes.value + 4 * MI + 1600 * 4096
    assert after.inodes_used.value >= before.inodes_used.value + 1601
    assert after.fs_id.mountpoint == str(server.root / "state")


def test_the_stats_report_what_the_guest_wrote_on_the_host(server: Server) -> None:
    """The pod's use of its file system is in its running containers' writable layers (one here)."""
    sb = server.sandboxes
    sid = SEED_SANDBOXES[0]
    sb.dirs.make(sid, QEMU_UID, 64 * MI)
    with open(sb.dirs.shared(sid) / "blob", "wb") as f:
        f.write(b"x" * (8 * MI))
    assert sb.records.change_container(SEED_CONTAINER, state=CONTAINER_RUNNING) is not None
    in_guest = CgroupStats(time.time_ns(), 1, 1, 1, 1, 0, 0, 1, writable_bytes=MI, writable_inodes=3)
    assert server.containers is not None
    server.containers.stats = lambda container_id: in_guest  # type: ignore[method-assign]  # no guest here
    server.containers.sandbox_stats = lambda sandbox_id: in_guest  # type: ignore[method-assign]

    def layer(rpc: str, request: object) -> list[pb.FilesystemUsage]:
        code, details, body = server.rpc(rpc, request)  # type: ignore[arg-type]
        assert code == grpc.StatusCode.OK, details
        if rpc == "ContainerStats":
            return [pb.ContainerStatsResponse.FromString(body).stats.writable_layer]
        if rpc == "ListContainerStats":
            return [s.writable_layer for s in pb.ListContainerStatsResponse.FromString(body).stats]
        return [c.writable_layer for c in pb.PodSandboxStatsResponse.FromString(body).stats.linux.containers]

    for rpc, request in (
        ("ContainerStats", pb.ContainerStatsRequest(container_id=SEED_CONTAINER)),
        ("ListContainerStats", pb.ListContainerStatsRequest()),
        ("PodSandboxStats", pb.PodSandboxStatsRequest(pod_sandbox_id=sid)),
    ):
        (fs,) = layer(rpc, request)
        assert fs.used_bytes.value >= 9 * MI, rpc  # 8 MiB on the host + 1 MiB in the guest's memory
        assert fs.inodes_used.value >= 4, rpc


def test_a_failed_run_pod_sandbox_leaves_no_mount_loop_device_or_image(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The test driver's guest never says hello: the boot fails after the directory was mounted,
    sized by the pod's ephemeral-storage limit."""
    mounted: list[int] = []
    real_mount = share_image.mount

    def mount(image: Path, target: Path, *, namespace_pid: int | None = None) -> None:
        real_mount(image, target, namespace_pid=namespace_pid)
        mounted.append(os.stat(image).st_size)

    monkeypatch.setattr(share_image, "mount", mount)
    config = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name="web", namespace="default", uid="u-share"),
        log_directory="/var/log/pods/x",
    )
    c = config.pod_resources.containers.add(name="app")
    c.kubernetes_resources.limits["ephemeral-storage"].string = "100Mi"
    c.kubernetes_resources.limits["memory"].string = "16Mi"
    code, details, _ = server.rpc("RunPodSandbox", pb.RunPodSandboxRequest(config=config))
    assert code != grpc.StatusCode.OK and "rolled back" in details, details
    assert mounted == [shared_storage.image_bytes(100 * MI)]
    root = server.sandboxes.dirs.root
    assert sorted(p.name for p in root.iterdir()) == []
    assert mounts_below(root) == [] and loops_backed_by(root) == []
    assert_no_leak(server.sandboxes)


def _in_mount_namespace_of(pid: int, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["nsenter", "-t", str(pid), "-m", *argv], capture_output=True, text=True, timeout=30)


@pytest.fixture
def daemon() -> Iterator[int]:
    """A process in a mount namespace of its own, standing in for the hypervisor daemon whose
    namespace each QEMU's is copied from (libvirtd, when the shim runs in a namespace of its own)."""
    proc = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sleep", "120"])
    try:
        ours = os.readlink("/proc/self/ns/mnt")
        deadline = time.monotonic() + 10
        while os.readlink(f"/proc/{proc.pid}/ns/mnt") == ours:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_a_shim_in_a_namespace_of_its_own_mounts_where_the_guest_sees_it(tmp_path: Path, daemon: int) -> None:
    dirs = SandboxDirs(str(tmp_path / "state"), lambda: daemon)
    try:
        dirs.make(SID, QEMU_UID, 16 * MI)
        top = dirs.root / SID
        # one file system, seen here and where QEMU's namespace is copied from
        assert share_image.is_mount(top)
        assert _in_mount_namespace_of(daemon, "mountpoint", "-q", str(top)).returncode == 0
        (dirs.shared(SID) / "from-the-shim").write_text("seen\n")
        assert _in_mount_namespace_of(daemon, "cat", str(dirs.shared(SID) / "from-the-shim")).stdout == "seen\n"
        assert len(loops_backed_by(dirs.root)) == 1  # cloned, not mounted twice
        # a shim that starts again in a new namespace of its own sees it again
        script = (
            "import sys; from vmsandbox.adapters import share_image; "
            f"share_image._unmount_here({str(top)!r}); "
            f"assert not share_image.is_mount({str(top)!r}); "
            f"assert share_image.adopt({str(top)!r}, {daemon}); "
            f"print(open({str(dirs.shared(SID) / 'from-the-shim')!r}).read(), end='')"
        )
        again = subprocess.run(
            ["unshare", "-m", "--propagation", "private", sys.executable, "-c", script],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=Path(__file__).resolve().parents[3],
        )
        assert again.stdout == "seen\n", again.stderr
    finally:
        dirs.drop(SID)
    assert not share_image.is_mount(dirs.root / SID)
    assert _in_mount_namespace_of(daemon, "mountpoint", "-q", str(dirs.root / SID)).returncode != 0
    deadline = time.monotonic() + 10
    while loops_backed_by(dirs.root):  # the loop device lets go once the last mount is gone
        assert time.monotonic() < deadline, loops_backed_by(dirs.root)
        time.sleep(0.05)
