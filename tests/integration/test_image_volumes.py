"""Image volumes (KEP-4639) through the CRI socket with a real guest: a container mounts an image's
tree and a sub path of it as the kubelet sends them (``Mount.image``, ``image_sub_path``), reads
its files, cannot write to them (EROFS), and a symlink of the image leads nowhere outside it. The
image stays stored while the container holds it (a RemoveImage hides it, as for a container's own
image) and is freed when the container is removed."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from gen.cri.runtime.v1 import api_pb2_grpc as pb_grpc
from tests.integration.image_setup import require_image_tools
from tests.registry_kit import Layout, Registry, busybox_entries, directory, file, push, symlink
from tests.shim_kit import pod, q, require_host, running_shim

pytestmark = [pytest.mark.slow, pytest.mark.integration]

SMALL = q({"cpu": "250m", "memory": "32Mi"})
APPLETS = ("sh", "cat", "echo", "sleep", "touch", "ls")
DATA_ENTRIES = [
    directory("data"),
    file("data/hello.txt", b"hello from the image\n"),
    directory("data/sub"),
    file("data/sub/inner.txt", b"inner\n"),
    # absolute: resolved inside the image's tree, never the guest's /run
    symlink("data/run-link", "/data/sub"),
    symlink("data/escape", "/run/vmsandbox"),
]


def _exec(rt: pb_grpc.RuntimeServiceStub, cid: str, *argv: str) -> pb.ExecSyncResponse:
    response: pb.ExecSyncResponse = rt.ExecSync(
        pb.ExecSyncRequest(container_id=cid, cmd=list(argv), timeout=60), timeout=120
    )
    return response


def test_an_image_volume_is_read_only_and_holds_its_image(tmp_path: Path) -> None:
    require_host()
    require_image_tools()
    registry = Registry(tmp_path / "registry").start()
    try:
        layout = Layout(tmp_path / "layout")
        layout.tag("app", layout.image([layout.layer(busybox_entries(APPLETS))], cmd=("/bin/sh",)))
        layout.tag("data", layout.image([layout.layer(DATA_ENTRIES)], cmd=("/bin/true",)))
        for name in ("app", "data"):
            push(layout, name, f"{registry.host}/test/{name}:1")
        (tmp_path / "shim").mkdir()
        with running_shim(tmp_path / "shim", pull_busybox=False) as shim:
            data_ref = f"{registry.host}/test/data:1"
            for name in ("app", "data"):
                ref = f"{registry.host}/test/{name}:1"
                shim.images.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image=ref)), timeout=300)
            # the kubelet names the image by what PullImage answered (its id)
            data_id = shim.images.ImageStatus(pb.ImageStatusRequest(image=pb.ImageSpec(image=data_ref))).image.id
            disks = shim.state_dir / "images" / "disks"
            stored = set(disks.glob("*.erofs"))
            assert len(stored) == 2
            container = pb.ContainerConfig(
                metadata=pb.ContainerMetadata(name="app"),
                image=pb.ImageSpec(image=f"{registry.host}/test/app:1"),
                command=["sleep", "600"],
                log_path="app.log",
                mounts=[
                    pb.Mount(container_path="/vol", image=pb.ImageSpec(image=data_id, user_specified_image=data_ref)),
                    pb.Mount(
                        container_path="/sub",
                        image=pb.ImageSpec(image=data_id),
                        image_sub_path="data/run-link",
                        readonly=True,
                    ),
                ],
            )
            container.kubernetes_resources.CopyFrom(SMALL)
            config = pod("imagevol", containers=[("app", SMALL), ("late", SMALL)])
            for decl in config.pod_resources.containers:  # the declaration names the same mounts
                decl.mounts.extend(container.mounts)
            config.log_directory = str(tmp_path / "logs")
            rt = shim.runtime
            sid = rt.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=300).pod_sandbox_id
            cid = rt.CreateContainer(
                pb.CreateContainerRequest(pod_sandbox_id=sid, config=container, sandbox_config=config), timeout=120
            ).container_id
            rt.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=120)

            read = _exec(rt, cid, "cat", "/vol/data/hello.txt", "/sub/inner.txt")
            assert (read.exit_code, read.stdout) == (0, b"hello from the image\ninner\n"), read
            write = _exec(rt, cid, "touch", "/vol/new", "/sub/new")
            assert write.exit_code != 0 and b"Read-only file system" in write.stderr, write
            # a symlink in the image resolves inside the image when the container follows it too
            escape = _exec(rt, cid, "ls", "/vol/data/escape/")
            assert escape.exit_code != 0, escape

            # RemoveImage while the volume holds it: hidden at once, its disk kept, the volume readable
            rt_images = shim.images
            rt_images.RemoveImage(pb.RemoveImageRequest(image=pb.ImageSpec(image=data_ref)), timeout=60)
            listed = {i.id for i in rt_images.ListImages(pb.ListImagesRequest()).images}
            assert data_id not in listed
            assert set(disks.glob("*.erofs")) == stored, "an image a volume holds lost its disk"
            again = _exec(rt, cid, "cat", "/vol/data/hello.txt")
            assert again.stdout == b"hello from the image\n", again

            # a create naming the removed image is refused: it is no longer visible
            other = pb.ContainerConfig()
            other.CopyFrom(container)
            other.metadata.name = "late"
            with pytest.raises(grpc.RpcError, match="of an image volume is not pulled"):
                rt.CreateContainer(
                    pb.CreateContainerRequest(pod_sandbox_id=sid, config=other, sandbox_config=config), timeout=120
                )

            rt.StopContainer(pb.StopContainerRequest(container_id=cid, timeout=5), timeout=120)
            rt.RemoveContainer(pb.RemoveContainerRequest(container_id=cid), timeout=120)
            assert len(set(disks.glob("*.erofs"))) == 1, "the removed image was not freed with its last holder"
            rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=120)
            rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=120)
    finally:
        registry.stop()


def test_a_sub_path_that_leaves_the_image_or_is_missing_is_refused(tmp_path: Path) -> None:
    require_host()
    require_image_tools()
    registry = Registry(tmp_path / "registry").start()
    try:
        layout = Layout(tmp_path / "layout")
        layout.tag("app", layout.image([layout.layer(busybox_entries(APPLETS))], cmd=("/bin/sh",)))
        layout.tag("data", layout.image([layout.layer(DATA_ENTRIES)], cmd=("/bin/true",)))
        for name in ("app", "data"):
            push(layout, name, f"{registry.host}/test/{name}:1")
        (tmp_path / "shim").mkdir()
        with running_shim(tmp_path / "shim", pull_busybox=False) as shim:
            for name in ("app", "data"):
                ref = f"{registry.host}/test/{name}:1"
                shim.images.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image=ref)), timeout=300)
            # the link leads to /run/vmsandbox, which the image does not have (the guest's is not followed)
            subs = {"escape": "data/escape/shared", "missing": "data/missing"}
            mounts = {
                name: pb.Mount(
                    container_path="/v", image=pb.ImageSpec(image=f"{registry.host}/test/data:1"), image_sub_path=sub
                )
                for name, sub in subs.items()
            }
            config = pod("imagevol-bad", containers=[(name, SMALL) for name in subs])
            for decl in config.pod_resources.containers:
                decl.mounts.append(mounts[decl.name])
            config.log_directory = str(tmp_path / "logs")
            rt = shim.runtime
            sid = rt.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=300).pod_sandbox_id
            for name in subs:
                container = pb.ContainerConfig(
                    metadata=pb.ContainerMetadata(name=name),
                    image=pb.ImageSpec(image=f"{registry.host}/test/app:1"),
                    command=["sleep", "600"],
                    log_path=f"{name}.log",
                    mounts=[mounts[name]],
                )
                container.kubernetes_resources.CopyFrom(SMALL)
                with pytest.raises(grpc.RpcError, match="no such file"):
                    rt.CreateContainer(
                        pb.CreateContainerRequest(pod_sandbox_id=sid, config=container, sandbox_config=config),
                        timeout=120,
                    )
            assert not rt.ListContainers(pb.ListContainersRequest()).containers
            rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=120)
            rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=120)
    finally:
        registry.stop()
