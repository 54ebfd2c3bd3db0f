"""A pod sees only the images its own containers use, through the CRI socket with a real guest:
the store holds two images, a container runs from one, and guest root (init's mount namespace,
reached with ``nsenter`` from a privileged container in the guest's PID namespace) finds one disk,
that image's, and no share of the host's image trees to mount."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from tests.integration.image_setup import require_image_tools
from tests.registry_kit import Layout, Registry, busybox_entries, file, push
from tests.shim_kit import pod, q, require_host, running_shim

pytestmark = [pytest.mark.slow, pytest.mark.integration]

SMALL = q({"cpu": "250m", "memory": "32Mi"})
APPLETS = ("sh", "ls", "cat", "nsenter", "echo", "mount", "mkdir")
# guest init's view: every virtio disk the guest has, the secret of each mounted image, and an attempt
# to mount the image trees' 9p share (which earlier versions exported to every pod)
LOOK = (
    "nsenter -t 1 -m sh -c '"
    "for f in /sys/block/vd*/serial; do [ -e $f ] && echo disk $(cat $f); done; "
    "cat /run/vmsandbox/disks/*/etc/secret; mkdir -p /tmp/look; "
    "mount -t 9p -o trans=virtio,version=9p2000.L,ro vmsandbox.images /tmp/look 2>/dev/null "
    "&& echo image share mounted || echo no image share'"
)


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
        # one disk in the guest, only this image's secret, no share of the store's trees
        assert len(out) == 3 and out[0].startswith("disk ") and out[1:] == ["mine", "no image share"], lines
    finally:
        registry.stop()


def _disks(sandbox_id: str) -> dict[str, str]:
    """serial -> source file of the image disks in the live domain of ``sandbox_id``."""
    import libvirt

    from tests.shim_kit import LIBVIRT_URI
    from vmsandbox.domain import domain_name
    from vmsandbox.domain_xml import read_image_disks

    conn = libvirt.open(LIBVIRT_URI)
    try:
        xml = conn.lookupByName(domain_name(sandbox_id)).XMLDesc(0)
    finally:
        conn.close()
    return {serial: d.source for serial, d in read_image_disks(xml).items()}


def test_image_disks_are_hot_plugged_once_per_pod_and_a_failed_create_detaches_its_own(tmp_path: Path) -> None:
    require_host()
    require_image_tools()
    registry = Registry(tmp_path / "registry").start()
    try:
        layout = Layout(tmp_path / "layout")
        for name in ("one", "two"):
            entries = [*busybox_entries(APPLETS), file("etc/secret", f"{name}\n".encode())]
            layout.tag(name, layout.image([layout.layer(entries)], cmd=("/bin/sh",)))
            push(layout, name, f"{registry.host}/test/{name}:1")
        (tmp_path / "shim").mkdir()
        with running_shim(tmp_path / "shim", pull_busybox=False) as shim:
            for name in ("one", "two"):
                ref = f"{registry.host}/test/{name}:1"
                shim.images.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image=ref)), timeout=300)
            config = pod("disks", containers=[("a", SMALL), ("b", SMALL), ("c", SMALL)])
            config.log_directory = str(tmp_path / "logs")
            rt = shim.runtime
            sid = rt.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=300).pod_sandbox_id
            assert _disks(sid) == {}  # nothing before the first container

            def create(name: str, image: str, sandbox_config: pb.PodSandboxConfig) -> str:
                ctr = pb.ContainerConfig(
                    metadata=pb.ContainerMetadata(name=name),
                    image=pb.ImageSpec(image=f"{registry.host}/test/{image}:1"),
                    command=["sh", "-c", "cat /etc/secret; sleep 600"],
                    log_path=f"{name}.log",
                )
                ctr.kubernetes_resources.CopyFrom(SMALL)
                req = pb.CreateContainerRequest(pod_sandbox_id=sid, config=ctr, sandbox_config=sandbox_config)
                return rt.CreateContainer(req, timeout=120).container_id

            # a create the guest refuses (a sysctl value the guest kernel rejects) after its disk was attached
            bad = pb.PodSandboxConfig()
            bad.CopyFrom(config)
            bad.linux.sysctls["net.ipv4.ip_unprivileged_port_start"] = "not-a-number"
            with pytest.raises(grpc.RpcError) as refused:
                create("a", "one", bad)
            assert "create: sysctl" in str(refused.value.details()), refused.value  # the guest's refusal
            assert _disks(sid) == {}, "the failed create left its image disk attached"
            # the same image again, then a second image and a second container of the first: one disk each
            create("a", "one", config)
            one = _disks(sid)
            assert len(one) == 1
            create("b", "two", config)
            create("c", "one", config)
            both = _disks(sid)
            assert len(both) == 2 and set(one) < set(both)
            for cid in rt.ListContainers(pb.ListContainersRequest()).containers:
                rt.StartContainer(pb.StartContainerRequest(container_id=cid.id), timeout=120)
            deadline = time.monotonic() + 120
            want = {"a.log": "one", "b.log": "two", "c.log": "one"}
            seen: dict[str, str] = {}
            while seen != want:
                assert time.monotonic() < deadline, f"logs: {seen}"
                for log_name in want:
                    path = tmp_path / "logs" / log_name
                    lines = path.read_text().splitlines() if path.exists() else []
                    if lines:
                        seen[log_name] = lines[0].split(" ", 3)[3]
                time.sleep(0.2)
            rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=120)
            rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=120)
    finally:
        registry.stop()
