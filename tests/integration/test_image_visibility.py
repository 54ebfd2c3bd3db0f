"""A pod sees only the images its own containers use, through the CRI socket with a real guest:
the store holds two images, a container runs from one, and guest root (init's mount namespace,
reached with ``nsenter`` from a privileged container in the guest's PID namespace) finds that one
image's tree and nothing of the other."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from shim.cri.runtime.v1 import api_pb2 as pb
from tests.integration.conftest import pod, q, require_host, running_shim
from tests.integration.image_setup import require_image_tools
from tests.registry_kit import Layout, Registry, busybox_entries, file, push

pytestmark = [pytest.mark.slow, pytest.mark.integration]

SMALL = q({"cpu": "250m", "memory": "32Mi"})
APPLETS = ("sh", "ls", "cat", "nsenter")
# guest init's view of the image export (the 9p channel takes one mount: this is all guest root gets)
LOOK = "nsenter -t 1 -m sh -c 'ls -A /run/vmsandbox/images; cat /run/vmsandbox/images/*/etc/secret'; exit $?"


def test_a_pod_sees_only_the_images_of_its_own_containers(tmp_path: Path) -> None:
    require_host()
    require_image_tools()
    registry = Registry(tmp_path / "registry").start()
    try:
        layout = Layout(tmp_path / "layout")
        for name in ("mine", "theirs"):
            entries = [*busybox_entries(APPLETS), file("etc/secret", f"{name}\n".encode())]
            layout.tag(name, layout.image([layout.layer(entries)], cmd=("/bin/sh",)))
            push(layout, name, f"{registry.host}/test/{name}:1")
        (tmp_path / "shim").mkdir()
        with running_shim(tmp_path / "shim", pull_busybox=False) as shim:
            for name in ("mine", "theirs"):
                ref = f"{registry.host}/test/{name}:1"
                shim.images.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image=ref)), timeout=300)
            config = pod("visibility", containers=[("look", SMALL)])
            config.linux.security_context.privileged = True
            config.log_directory = str(tmp_path / "logs")
            rt = shim.runtime
            sid = rt.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=300).pod_sandbox_id
            container = pb.ContainerConfig(
                metadata=pb.ContainerMetadata(name="look"),
                image=pb.ImageSpec(image=f"{registry.host}/test/mine:1"),
                command=["sh", "-c", LOOK],
                log_path="look.log",
            )
            container.kubernetes_resources.CopyFrom(SMALL)
            container.linux.security_context.privileged = True
            container.linux.security_context.namespace_options.pid = pb.POD
            cid = rt.CreateContainer(
                pb.CreateContainerRequest(pod_sandbox_id=sid, config=container, sandbox_config=config), timeout=120
            ).container_id
            rt.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=120)
            deadline = time.monotonic() + 120
            while rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid)).status.state != pb.CONTAINER_EXITED:
                assert time.monotonic() < deadline, "the container did not exit"
                time.sleep(0.2)
            lines = (tmp_path / "logs" / "look.log").read_text().splitlines()
            out = [line.split(" ", 3)[3] for line in lines if line.split(" ", 3)[1] == "stdout"]
            rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=120)
            rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=120)
        # one tree in init's view, and only this image's secret
        assert len(out) == 2 and out[1] == "mine", lines
    finally:
        registry.stop()
