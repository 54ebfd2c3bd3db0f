"""A READY pod in process whose guest is a fake agent: what the container RPCs' tests run against.

``running_pod`` starts the in-process CRI server (``tests/cri_server.py``: the production owners
over a real ledger and libvirt's test driver) and makes its first seeded sandbox a pod as
RunPodSandbox leaves one: a QEMU uid, its directory made, its agent channel a ``ContainerAgent``
(``tests/fake_guest.py``) that keeps its containers and volume copies, and a host-network pod
whose privileged node port waits for a container holding CAP_NET_BIND_SERVICE. What the shim
would do to the pod's QEMU (image disks hot-plugged, binds into its mount namespace) is recorded
by ``FakeVm`` instead. Two images are stored as a pull leaves them (their disks placeholder
files: the container's, and one its image volumes mount), and
the kubelet's pod directory holds a plain directory and a ConfigMap volume of the pod's.

``Pod.leftovers`` is everything a container RPC can leave behind, host and guest side: a test
compares it before and after.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from shim.host_ports import HostPorts
from shim.image_store import ImageStore
from shim.model import ContainerRecord, CreateContainer, SandboxRecord
from shim.nri.hooks import NriHooks
from shim.pods import Pods
from shim.translate import inbound
from tests import fake_guest as fg
from tests.cri_server import SEED_CONTAINER, SEED_SANDBOXES, Server, cri_server
from tests.kubelet_layout import volume_dir, write_volume
from tests.ports import quiet_port
from vmsandbox.adapters import binds
from vmsandbox.adapters.hypervisor import Hypervisor
from vmsandbox.adapters.image_disk import ImageDisk
from vmsandbox.domain_xml import read_image_disks
from vmsandbox.image_catalogue import ImageRecord, record_doc

QEMU_UID = 2_000_000_000
IMAGE = "registry.test/app:1"
IMAGE_ID = "sha256:" + "1" * 64
_TREE = "sha256:" + "3" * 64
VOLUME_IMAGE = "registry.test/data:1"  # mounted as an image volume
VOLUME_IMAGE_ID = "sha256:" + "4" * 64
_VOLUME_TREE = "sha256:" + "5" * 64


class FakeVm:
    """The pod's QEMU as the shim's calls would leave it: image disks attached (by serial) and
    binds made in its mount namespace (by target path)."""

    def __init__(self) -> None:
        self.disks: dict[str, str] = {}
        self.binds: set[str] = set()

    def install(self, monkeypatch: pytest.MonkeyPatch, hypervisor: Hypervisor) -> None:
        monkeypatch.setattr(hypervisor, "is_active", lambda name: True)
        monkeypatch.setattr(hypervisor, "emulator_pid", lambda name: os.getpid())
        monkeypatch.setattr(hypervisor, "live_xml", lambda name: self._xml(self.disks.values()))
        monkeypatch.setattr(hypervisor, "attach_device", self._attach)
        monkeypatch.setattr(hypervisor, "detach_device", self._detach)
        monkeypatch.setattr(binds, "bind", self._bind)
        monkeypatch.setattr(binds, "unbind_all", self._unbind_all)
        monkeypatch.setattr(binds, "mounts_under", lambda path, mountinfo=None: self._under(Path(path)))

    @staticmethod
    def _xml(disks: Any) -> str:
        return "<domain><devices>" + "".join(disks) + "</devices></domain>"

    def _serial(self, xml: str) -> str:
        (serial,) = read_image_disks(self._xml([xml]))
        return serial

    def _attach(self, name: str, xml: str) -> None:
        self.disks[self._serial(xml)] = xml

    def _detach(self, name: str, xml: str) -> None:
        del self.disks[self._serial(xml)]

    def _bind(self, qemu_pid: int, source: object, target: Path, *args: object, **kw: object) -> None:
        self.binds.add(str(target))

    def _under(self, path: Path) -> list[str]:
        return sorted(b for b in self.binds if Path(b).is_relative_to(path))

    def _unbind_all(self, qemu_pid: int, path: Path, keep: Any = ()) -> None:
        kept = [Path(k) for k in keep]
        for b in self._under(Path(path)):
            if not any(Path(b).is_relative_to(k) for k in kept):
                self.binds.discard(b)


class RecordingNri(NriHooks):
    """NRI without plugins, recording which container events plugins would have been told."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.told: list[tuple[str, str]] = []  # (event, container id)

    def container_created(self, sandbox: SandboxRecord, c: ContainerRecord) -> None:
        self.told.append(("PostCreateContainer", c.id))

    def container_started(self, sandbox: SandboxRecord, c: ContainerRecord) -> None:
        self.told.append(("PostStartContainer", c.id))

    def container_updated(self, sandbox: SandboxRecord, c: ContainerRecord) -> None:
        self.told.append(("PostUpdateContainer", c.id))

    def container_stopped(self, sandbox: SandboxRecord, c: ContainerRecord) -> None:
        self.told.append(("StopContainer", c.id))

    def container_removed(self, sandbox: SandboxRecord, c: ContainerRecord) -> None:
        self.told.append(("RemoveContainer", c.id))


@dataclass
class Pod:
    server: Server
    pods: Pods
    sandbox_id: str
    agent: fg.ContainerAgent
    vm: FakeVm
    volume: Path  # a plain host directory of the pod's (a bind)
    config_map: Path  # an atomic-writer volume of the pod's (a copy in the guest)
    node_port: int  # privileged: open once a container with CAP_NET_BIND_SERVICE is created
    nri: RecordingNri

    def config(self, name: str = "app") -> pb.ContainerConfig:
        """A container config as the kubelet sends it, using both volumes."""
        return pb.ContainerConfig(
            metadata=pb.ContainerMetadata(name=name),
            image=pb.ImageSpec(image=IMAGE),
            mounts=[
                pb.Mount(container_path="/data", host_path=str(self.volume)),
                pb.Mount(container_path="/etc/config", host_path=str(self.config_map), readonly=True),
            ],
            linux=pb.LinuxContainerConfig(
                resources=pb.LinuxContainerResources(
                    cpu_period=100_000, cpu_quota=20_000, memory_limit_in_bytes=32 << 20
                )
            ),
        )

    def image_volume_config(self, name: str = "app") -> pb.ContainerConfig:
        """``config(name)`` with image volumes as the kubelet sends them: VOLUME_IMAGE twice (its
        root and a sub path) and the container's own image (the same disk as its root)."""
        config = self.config(name)
        config.mounts.extend(
            [
                pb.Mount(container_path="/vol", image=pb.ImageSpec(image=VOLUME_IMAGE_ID), readonly=True),
                pb.Mount(container_path="/vol-etc", image=pb.ImageSpec(image=VOLUME_IMAGE), image_sub_path="etc"),
                pb.Mount(container_path="/self", image=pb.ImageSpec(image=IMAGE)),
            ]
        )
        return config

    def create_request(self, name: str = "app", config: pb.ContainerConfig | None = None) -> CreateContainer:
        """A CreateContainer of ``config`` (default: ``config(name)``) in this pod, translated."""
        request = pb.CreateContainerRequest(pod_sandbox_id=self.sandbox_id, config=config or self.config(name))
        return inbound.create_container(request)

    def node_port_open(self) -> bool:
        with socket.socket() as probe:
            # closed by a reset: its own port is not left in TIME_WAIT for another test's "free" port
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            probe.settimeout(5)
            try:
                probe.connect(("127.0.0.1", self.node_port))
            except ConnectionRefusedError:
                return False
        return True

    def leftovers(self) -> dict[str, object]:
        """What container RPCs change, host and guest side."""
        c = self.pods.containers
        shared = c.dirs.shared(self.sandbox_id) / "containers"
        return {
            "records": {r.id: (r.state, r.image_id, r.linux) for r in self.pods.records.containers()},
            "image holders": c.images.holders(IMAGE_ID),
            "volume image holders": c.images.holders(VOLUME_IMAGE_ID),
            "image disks": dict(self.vm.disks),
            "disk users": c.mounts.disk_users(self.sandbox_id),
            "binds": set(self.vm.binds),
            "volume users": c.volumes.users(self.sandbox_id),
            "guest volumes": dict(self.agent.volumes),
            "container dirs": sorted(p.name for p in shared.iterdir()),
            "guest containers": dict(self.agent.containers),
            "guest cgroups": {k: dict(v) for k, v in self.agent.cgroup.items()},
            "log copies": c.logs.copying(),
            "node port open": self.node_port_open(),
        }


def _store_image(root: Path) -> ImageStore:
    """A store holding IMAGE and VOLUME_IMAGE as a pull leaves them (their disks empty
    placeholders, never read here)."""
    disk = ImageDisk(root)
    records = [
        ImageRecord(
            id=image_id,
            repo_tags=(ref,),
            repo_digests=(),
            manifest="sha256:" + digit * 64,
            config=image_id,
            layers=(),
            size=0,
            spec={"cmd": ["sh"], "env": ["PATH=/bin"]},
            tree=tree,
        )
        for image_id, ref, tree, digit in (
            (IMAGE_ID, IMAGE, _TREE, "2"),
            (VOLUME_IMAGE_ID, VOLUME_IMAGE, _VOLUME_TREE, "6"),
        )
    ]
    disk.save_catalogue([record_doc(r) for r in records])
    facts = {"unpacked_bytes": 0, "unpacked_inodes": 1, "passwd": ["root:x:0:0::/root:/bin/sh"], "group": ["root:x:0:"]}
    for r in records:
        disk.disk_path(r.tree).with_suffix(".json").write_text(json.dumps(facts))
        disk.disk_path(r.tree).write_bytes(b"")
    return ImageStore(root)


@contextmanager
def running_pod(monkeypatch: pytest.MonkeyPatch) -> Iterator[Pod]:
    with cri_server() as server:
        sb, containers = server.sandboxes, server.containers
        assert containers is not None
        sid = SEED_SANDBOXES[0]
        port = quiet_port()
        config = pb.PodSandboxConfig(
            metadata=pb.PodSandboxMetadata(name="web", namespace="default", uid="uid-0"),
            port_mappings=[pb.PortMapping(container_port=port, host_port=port, host_ip="127.0.0.1")],
            linux=pb.LinuxPodSandboxConfig(
                security_context=pb.LinuxSandboxSecurityContext(namespace_options=pb.NamespaceOption(network=pb.NODE))
            ),
        )
        spec = inbound.sandbox_spec(config, "vmsandbox")
        record = replace(
            sb.records.get(sid), qemu_uid=QEMU_UID, namespaces=spec.namespaces, port_mappings=spec.port_mappings
        )
        sb.ledger.put_sandbox(sid, record.state, record.created_ns, record.to_doc())
        sb.records.reload()
        sb.records.remove_container(SEED_CONTAINER)  # a new pod: no container yet
        sb.dirs.make(sid, QEMU_UID, None)

        kubelet_pods = server.root / "kubelet" / "pods"
        containers.mounts.config = replace(sb.config, kubelet_pods_dir=str(kubelet_pods))
        volume = kubelet_pods / record.meta.uid / "volumes" / "kubernetes.io~empty-dir" / "data"
        volume.mkdir(parents=True)
        config_map = volume_dir(kubelet_pods, record.meta.uid, "configmap", "settings")
        write_volume(config_map, {"level": b"debug\n"})

        agent = fg.ContainerAgent()
        sock = server.root / "agent.sock"
        monkeypatch.setattr(sb.hypervisor, "channel_path", lambda _domain, _name: str(sock))
        guest = fg.FakeGuest(sock, agent.serve)
        vm = FakeVm()
        vm.install(monkeypatch, sb.hypervisor)
        containers.images = _store_image(server.root / "pod-images")
        host_ports = HostPorts(lambda s, p: socket.socket(), lambda: 65536)  # every port is privileged
        host_ports.open(sid, spec.namespaces, spec.port_mappings)
        nri = RecordingNri(None, sb, containers)
        pods = Pods(sb, containers, nri, host_ports)
        try:
            yield Pod(server, pods, sid, agent, vm, volume, config_map, port, nri)
        finally:
            host_ports.close(sid)
            containers.close()
            guest.close()
            vm.binds.clear()  # the pod's QEMU goes, and its mounts with it
