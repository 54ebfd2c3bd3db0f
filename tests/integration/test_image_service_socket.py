"""ImageService over the shim's real unix socket, against a real registry: every RPC, the status
codes a kubelet and crictl see, and a shim killed mid-pull restarting clean."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from tests.integration.image_setup import DockerImage, Pushed, docker_images, pushed  # noqa: F401
from tests.registry_kit import digest_of, served_manifest
from tests.shim_kit import (
    Shim,
    container,
    pod,
    q,
    remove_all,
    require_host,
    run_to_exit,
    running_shim,
    start_shim,
    stop_shim,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]
TOKEN = pb.AuthConfig(registry_token="a-bearer-token")


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shim]:
    require_host()
    with running_shim(tmp_path_factory.mktemp("image-shim"), pull_busybox=False) as running:
        yield running


def spec(image: str) -> pb.ImageSpec:
    return pb.ImageSpec(image=image)


def fs_used(shim: Shim) -> tuple[int, int]:
    info = shim.images.ImageFsInfo(pb.ImageFsInfoRequest(), timeout=10)
    assert len(info.image_filesystems) == 1 and len(info.container_filesystems) == 1
    usage = info.image_filesystems[0]
    assert usage.fs_id.mountpoint.endswith("/images") and usage.timestamp > 0
    return usage.used_bytes.value, usage.inodes_used.value


def test_pull_status_list_remove_fsinfo(shim: Shim, pushed: Pushed) -> None:  # noqa: F811
    bytes0, inodes0 = fs_used(shim)
    ref = pushed.ref("uid")
    answer = shim.images.PullImage(pb.PullImageRequest(image=spec(ref)), timeout=120)
    assert answer.image_ref == pushed.id("uid")
    status = shim.images.ImageStatus(pb.ImageStatusRequest(image=spec(ref), verbose=True), timeout=10)
    image = status.image
    assert image.id == pushed.id("uid")
    assert list(image.repo_tags) == [ref]
    assert list(image.repo_digests) == [f"{ref.rsplit(':', 1)[0]}@{pushed.top('uid')}"]
    assert image.HasField("uid") and image.uid.value == 1000 and image.username == ""
    assert image.size > 1_000_000
    info = json.loads(status.info["info"])
    assert info["id"] == image.id and info["imageSpec"]["cmd"] == ["/bin/sh"]

    shim.images.PullImage(pb.PullImageRequest(image=spec(pushed.ref("named"))), timeout=120)
    named = shim.images.ImageStatus(pb.ImageStatusRequest(image=spec(pushed.ref("named"))), timeout=10).image
    assert not named.HasField("uid") and named.username == "nobody"

    every = shim.images.ListImages(pb.ListImagesRequest(), timeout=10).images
    assert {i.id for i in every} == {pushed.id("uid"), pushed.id("named")}
    one = shim.images.ListImages(pb.ListImagesRequest(filter=pb.ImageFilter(image=spec(ref))), timeout=10).images
    assert [i.id for i in one] == [pushed.id("uid")]
    bytes1, inodes1 = fs_used(shim)
    assert bytes1 > bytes0 + 1_000_000 and inodes1 > inodes0

    for name in ("uid", "named"):
        shim.images.RemoveImage(pb.RemoveImageRequest(image=spec(pushed.id(name))), timeout=30)
    shim.images.RemoveImage(pb.RemoveImageRequest(image=spec(pushed.id("uid"))), timeout=30)  # absent: OK
    shim.images.RemoveImage(pb.RemoveImageRequest(image=spec("never/pulled:1")), timeout=30)
    assert not shim.images.ImageStatus(pb.ImageStatusRequest(image=spec(ref)), timeout=10).HasField("image")
    assert list(shim.images.ListImages(pb.ListImagesRequest(), timeout=10).images) == []
    assert fs_used(shim) == (bytes0, inodes0)


def _store_files(shim: Shim) -> dict[str, set[Path]]:
    root = shim.state_dir / "images"
    return {
        "blobs": set((root / "blobs" / "sha256").iterdir()),
        "trees": set((root / "trees").iterdir()),
        "disks": set((root / "disks").iterdir()),
    }


def test_image_fs_usage_counts_each_images_disk(shim: Shim, pushed: Pushed) -> None:  # noqa: F811
    """The kubelet's image GC reads ImageFsInfo: a pull raises it by everything the image takes on
    disk, its EROFS disk included (bytes and one inode), and removing the image takes it all back."""
    bytes0, inodes0 = fs_used(shim)
    before = _store_files(shim)
    ref = pushed.ref("uid")
    shim.images.PullImage(pb.PullImageRequest(image=spec(ref)), timeout=120)
    added = {kind: files - before[kind] for kind, files in _store_files(shim).items()}
    assert sorted(f.suffix for f in added["disks"]) == [".erofs", ".json"] and not added["trees"], added
    image_disk = next(f for f in added["disks"] if f.suffix == ".erofs").stat().st_blocks * 512
    disk = sum(f.stat().st_blocks * 512 for f in added["disks"])
    blobs = sum(f.stat().st_blocks * 512 for f in added["blobs"])
    bytes1, inodes1 = fs_used(shim)
    assert image_disk > 0 and bytes1 - bytes0 >= image_disk
    assert (bytes1 - bytes0, inodes1 - inodes0) == (blobs + disk, len(added["blobs"]) + 2)
    shim.images.RemoveImage(pb.RemoveImageRequest(image=spec(pushed.id("uid"))), timeout=30)
    assert fs_used(shim) == (bytes0, inodes0)


def test_multi_arch_pull_over_the_socket(shim: Shim, pushed: Pushed) -> None:  # noqa: F811
    answer = shim.images.PullImage(pb.PullImageRequest(image=spec(pushed.ref("multi"))), timeout=120)
    assert answer.image_ref == pushed.id("multi")
    shim.images.RemoveImage(pb.RemoveImageRequest(image=spec(pushed.ref("multi"))), timeout=30)


@pytest.mark.parametrize("name", ["docker", "docker-list", "docker-raw"])
def test_docker_format_images_over_the_socket(
    shim: Shim,
    docker_images: dict[str, DockerImage],  # noqa: F811
    name: str,
) -> None:
    """Ids and repo digests are the registry's own: the served config's digest, the served manifest's
    (the list's for a multi-arch image), fetched here with the Accept header a client sends."""
    image = docker_images[name]
    top, manifest = image.served()
    config_digest = json.loads(manifest)["config"]["digest"]
    answer = shim.images.PullImage(pb.PullImageRequest(image=spec(image.ref)), timeout=120)
    assert answer.image_ref == config_digest
    status = shim.images.ImageStatus(pb.ImageStatusRequest(image=spec(image.ref)), timeout=10).image
    assert status.id == config_digest
    assert list(status.repo_tags) == [image.ref]
    assert list(status.repo_digests) == [f"{image.host}/{image.repo}@{digest_of(top)}"]
    by_digest = shim.images.ImageStatus(
        pb.ImageStatusRequest(image=spec(f"{image.host}/{image.repo}@{digest_of(top)}")), timeout=10
    ).image
    assert by_digest.id == config_digest
    shim.images.RemoveImage(pb.RemoveImageRequest(image=spec(image.ref)), timeout=30)


def test_a_copied_config_cannot_poison_the_cache_over_the_socket(shim: Shim, pushed: Pushed) -> None:  # noqa: F811
    with pytest.raises(grpc.RpcError) as exc:
        shim.images.PullImage(pb.PullImageRequest(image=spec(pushed.ref("attacker"))), timeout=120)
    err: grpc.Call = exc.value  # type: ignore[assignment]
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "layer 2/2" in (err.details() or "")
    assert list(shim.images.ListImages(pb.ListImagesRequest(), timeout=10).images) == []
    answer = shim.images.PullImage(pb.PullImageRequest(image=spec(pushed.ref("public"))), timeout=120)
    assert answer.image_ref == pushed.id("public")
    status = shim.images.ImageStatus(pb.ImageStatusRequest(image=spec(pushed.ref("public"))), timeout=10).image
    assert list(status.repo_tags) == [pushed.ref("public")]
    shim.images.RemoveImage(pb.RemoveImageRequest(image=spec(pushed.ref("public"))), timeout=30)


def test_a_container_runs_from_a_docker_format_image(
    shim: Shim,
    docker_images: dict[str, DockerImage],  # noqa: F811
    tmp_path: Path,
) -> None:
    """buildah's Docker-format image (its Cmd and User from the served config) in a real guest."""
    ref = docker_images["docker"].ref
    shim.images.PullImage(pb.PullImageRequest(image=spec(ref)), timeout=120)
    res = q({"cpu": "250m", "memory": "32Mi"})
    config = pod("docker-format", containers=[("app", res)])
    config.log_directory = str(tmp_path)
    rt = shim.runtime
    sid = rt.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=300).pod_sandbox_id
    try:
        c = pb.ContainerConfig(metadata=pb.ContainerMetadata(name="app"), image=spec(ref), log_path="app.log")
        c.kubernetes_resources.CopyFrom(res)
        cid = rt.CreateContainer(
            pb.CreateContainerRequest(pod_sandbox_id=sid, config=c, sandbox_config=config), timeout=120
        ).container_id
        rt.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=120)
        deadline = time.monotonic() + 90
        while (st := rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid), timeout=60).status).state != (
            pb.CONTAINER_EXITED
        ):
            assert time.monotonic() < deadline, shim.log_text()[-3000:]
            time.sleep(0.2)
        assert (st.exit_code, st.reason) == (0, "Completed")
        texts = [line.split(" ", 3)[3] for line in (tmp_path / "app.log").read_text().splitlines()]
        assert texts == ["from-docker", "1000"]
        assert st.image_ref == f"{docker_images['docker'].host}/{docker_images['docker'].repo}@" + digest_of(
            served_manifest(docker_images["docker"].host, docker_images["docker"].repo, "1")
        )
    finally:
        rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=120)
        rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=120)
    shim.images.RemoveImage(pb.RemoveImageRequest(image=spec(ref)), timeout=30)


def test_a_user_name_resolves_from_the_images_own_passwd(shim: Shim, pushed: Pushed, tmp_path: Path) -> None:  # noqa: F811
    """The image's config names its user ("nobody"): the host resolves it through the image's
    /etc/passwd and /etc/group, kept with its disk when the pull deleted the tree."""
    ref = pushed.ref("named")
    shim.images.PullImage(pb.PullImageRequest(image=spec(ref)), timeout=120)
    assert not list((shim.state_dir / "images" / "trees").iterdir())
    res = q({"cpu": "250m", "memory": "32Mi"})
    config = pod("named-user", containers=[("app", res)])
    config.log_directory = str(tmp_path)
    rt = shim.runtime
    sid = rt.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=300).pod_sandbox_id
    try:
        c = pb.ContainerConfig(
            metadata=pb.ContainerMetadata(name="app"),
            image=spec(ref),
            command=["sh", "-c", "id -u; id -g"],
            log_path="app.log",
        )
        c.kubernetes_resources.CopyFrom(res)
        texts = [text for _, text in run_to_exit(shim, sid, config, c)]
        assert texts == ["65534", "65534"], shim.log_text()[-3000:]
    finally:
        rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=120)
        rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=120)
    shim.images.RemoveImage(pb.RemoveImageRequest(image=spec(ref)), timeout=30)


@pytest.mark.parametrize(
    ("image", "auth", "code", "says"),
    [
        ("", None, grpc.StatusCode.INVALID_ARGUMENT, "image is empty"),
        ("Not/Valid", None, grpc.StatusCode.INVALID_ARGUMENT, "lower case"),
        ("busybox@sha256:123", None, grpc.StatusCode.INVALID_ARGUMENT, "only sha256"),
        ("REGISTRY/test/busybox:missing", None, grpc.StatusCode.NOT_FOUND, "REGISTRY/test/busybox:missing"),
        ("REGISTRY/test/armonly:1", None, grpc.StatusCode.NOT_FOUND, "no linux/amd64 image"),
        ("REGISTRY/test/hostile:1", None, grpc.StatusCode.INVALID_ARGUMENT, "climbs out of the image root"),
        ("REGISTRY/test/lying:1", None, grpc.StatusCode.INVALID_ARGUMENT, "rootfs.diff_ids says sha256:"),
        ("REGISTRY/test/miscount:1", None, grpc.StatusCode.INVALID_ARGUMENT, "has 2 layers but the config's"),
        ("REGISTRY/docker/zstd:1", None, grpc.StatusCode.INVALID_ARGUMENT, "unsupported layer media type"),
        ("127.0.0.1:1/x/y:1", None, grpc.StatusCode.UNAVAILABLE, "connection refused"),
        ("REGISTRY/test/busybox:uid", TOKEN, grpc.StatusCode.INVALID_ARGUMENT, "registry_token"),
    ],
)  # fmt: skip
def test_errors_carry_the_right_code_and_no_traceback(
    shim: Shim,
    pushed: Pushed,  # noqa: F811
    docker_images: dict[str, DockerImage],  # noqa: F811 (pushed to the same registry)
    image: str,
    auth: pb.AuthConfig | None,
    code: grpc.StatusCode,
    says: str,
) -> None:
    image = image.replace("REGISTRY", pushed.registry.host)
    request = pb.PullImageRequest(image=spec(image))
    if auth is not None:
        request.auth.CopyFrom(auth)
    with pytest.raises(grpc.RpcError) as exc:
        shim.images.PullImage(request, timeout=120)
    err: grpc.Call = exc.value  # type: ignore[assignment]
    assert err.code() == code
    details = err.details() or ""
    assert says.replace("REGISTRY", pushed.registry.host) in details
    assert "Traceback" not in details and len(details) < 1000
    assert list(shim.images.ListImages(pb.ListImagesRequest(), timeout=10).images) == []


def test_a_shim_killed_mid_pull_restarts_with_no_image(tmp_path: Path, pushed: Pushed) -> None:  # noqa: F811
    require_host()
    first = start_shim(tmp_path, env={"VMSANDBOX_FAULT": "PullImage:disk"}, pull_busybox=False)
    try:
        with pytest.raises(grpc.RpcError) as exc:
            first.images.PullImage(pb.PullImageRequest(image=spec(pushed.ref("uid"))), timeout=120)
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
        first.process.wait(timeout=30)
    finally:
        stop_shim(first, kill=True)
    second = start_shim(tmp_path, pull_busybox=False)
    try:
        assert list(second.images.ListImages(pb.ListImagesRequest(), timeout=10).images) == []
        store = second.state_dir / "images"
        assert [p.name for p in (store / "trees").iterdir()] == []
        assert [p.name for p in (store / "disks").iterdir()] == []
        assert [p.name for p in (store / "blobs/sha256").iterdir()] == []
        answer = second.images.PullImage(pb.PullImageRequest(image=spec(pushed.ref("uid"))), timeout=120)
        assert answer.image_ref == pushed.id("uid")
    finally:
        stop_shim(second)
        shutil.rmtree(tmp_path, ignore_errors=True)


def test_containers_hold_their_image_across_a_shim_restart(tmp_path: Path) -> None:
    """After a restart a running container's image is still held: RemoveImage hides it, its disk
    stays (the guest reads it) until the container is removed."""
    require_host()
    (tmp_path / "shim").mkdir()
    res = q({"cpu": "250m", "memory": "32Mi"})
    shim = start_shim(tmp_path / "shim")
    try:
        config = pod("holds", containers=[("sleeper", res)])
        sid = shim.runtime.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=300).pod_sandbox_id
        c = container("sleeper", res)
        c.command[:] = ["sleep", "600"]
        cid = shim.runtime.CreateContainer(
            pb.CreateContainerRequest(pod_sandbox_id=sid, config=c, sandbox_config=config), timeout=120
        ).container_id
        shim.runtime.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=120)
    except BaseException:
        remove_all(shim)
        stop_shim(shim)
        raise
    stop_shim(shim)
    shim = start_shim(tmp_path / "shim", pull_busybox=False)
    try:
        disks = shim.state_dir / "images" / "disks"
        shim.images.RemoveImage(pb.RemoveImageRequest(image=spec("busybox")), timeout=30)
        assert not shim.images.ImageStatus(pb.ImageStatusRequest(image=spec("busybox")), timeout=10).HasField("image")
        assert [p for p in disks.iterdir() if p.suffix == ".erofs"], "the running container's disk was freed"
        done = shim.runtime.ExecSync(pb.ExecSyncRequest(container_id=cid, cmd=["ls", "/bin"], timeout=60), timeout=90)
        assert done.exit_code == 0 and b"busybox" in done.stdout, done.stderr
        shim.runtime.StopContainer(pb.StopContainerRequest(container_id=cid, timeout=1), timeout=60)
        shim.runtime.RemoveContainer(pb.RemoveContainerRequest(container_id=cid), timeout=60)
        assert list(disks.iterdir()) == []  # the last holder gone: freed
    finally:
        remove_all(shim)
        stop_shim(shim)
        shutil.rmtree(tmp_path, ignore_errors=True)
