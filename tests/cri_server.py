"""An in-process CRI server for tests: the production servicers over a real ledger and libvirt's
``test:///default`` driver, sized from a fixture sysfs tree, on a unix socket.

Three READY sandboxes are seeded (two share the id prefix "ab") with one container, as a
RunPodSandbox and CreateContainer leave them; their guests do not exist, so a valid RunPodSandbox
defines and starts a test-driver domain and then fails for want of a guest, and rolls back (a
test that wants it to go on points the agent channel at a fake guest: ``tests.fake_guest``).
Host-network pods' node ports are listened on (their connections dial no guest).
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import cast

import grpc
from google.protobuf import descriptor as _descriptor
from google.protobuf.message import Message

from gen.cri.runtime.v1 import api_pb2 as pb
from shim import status
from shim.config import ShimConfig
from shim.containers import Containers
from shim.host_ports import HostPorts
from shim.image_service import ImageServicer
from shim.image_store import ImageStore
from shim.model import SANDBOX_READY, ContainerRecord, PodMeta, SandboxRecord
from shim.pods import Pods
from shim.runtime_service import RuntimeServicer
from shim.sandboxes import Sandboxes
from tests import fake_guest as fg
from vmsandbox.adapters.hypervisor import Hypervisor
from vmsandbox.adapters.ledger import Ledger
from vmsandbox.adapters.sysfs import read_inventory
from vmsandbox.domain import domain_name
from vmsandbox.errors import InfrastructureError
from vmsandbox.lifecycle import STATE_CREATING
from vmsandbox.profile import Profile
from vmsandbox.sizing import PodDemand, shape_for

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "sysfs" / "one-node-2cpu"
SEED_SANDBOXES = ("ab" * 32, "abcd" + "0" * 60, "c0ffee" + "1" * 58)
SEED_CONTAINER = "de" * 32
SEED_LOG_DIRECTORY = "/var/log/pods/default_seed-0_uid-0"


@dataclass
class Server:
    sandboxes: Sandboxes
    channel: grpc.Channel
    root: Path
    containers: Containers | None = None
    pods: Pods | None = None

    def rpc(self, name: str, request: Message | bytes) -> tuple[grpc.StatusCode, str, bytes]:
        """Call RuntimeService/``name`` (or ImageService/``name``): status, details, response bytes."""
        service = (
            "RuntimeService"
            if name in pb.DESCRIPTOR.services_by_name["RuntimeService"].methods_by_name
            else ("ImageService")
        )
        body = request if isinstance(request, bytes) else request.SerializeToString()
        try:
            out = self.channel.unary_unary(f"/runtime.v1.{service}/{name}", None, None)(body, timeout=20)
        except grpc.RpcError as exc:
            call = cast(grpc.Call, exc)
            return call.code(), call.details() or "", b""
        return grpc.StatusCode.OK, "", cast(bytes, out)

    def call(self, method: _descriptor.MethodDescriptor, body: bytes) -> grpc.StatusCode:
        """Send raw request bytes; the status, asserting it is neither INTERNAL nor UNKNOWN and bounded."""
        path = f"/{method.containing_service.full_name}/{method.name}"
        try:
            if method.server_streaming:
                for _ in self.channel.unary_stream(path, None, None)(body, timeout=20):
                    pass
            else:
                self.channel.unary_unary(path, None, None)(body, timeout=20)
        except grpc.RpcError as exc:
            call = cast(grpc.Call, exc)
            code = call.code()
            details = call.details() or ""
            assert code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), (
                f"{method.name} -> {code.name}: {details[:300]}"
            )
            assert len(details) <= 4096, f"{method.name}: a {len(details)}-character message"
            return cast(grpc.StatusCode, code)
        return grpc.StatusCode.OK


def seed(sb: Sandboxes) -> None:
    """(Re)write the seeded sandboxes and container, READY and CREATED."""
    profile = sb.profiles["vmsandbox"]
    shape = shape_for(PodDemand(cpu_millis=1000, memory_bytes=256 << 20, mode="linux-resources"), profile)
    for n, sid in enumerate(SEED_SANDBOXES):
        record = SandboxRecord(
            id=sid,
            meta=PodMeta(f"seed-{n}", "default", f"uid-{n}"),
            state=SANDBOX_READY,
            created_ns=n,
            runtime_handler="vmsandbox",
            profile="vmsandbox",
            domain=domain_name(sid),
            log_directory=SEED_LOG_DIRECTORY,
            shape=shape,
        )
        sb.ledger.put_sandbox(sid, SANDBOX_READY, n, record.to_doc())
    sb.records.reload()
    c = ContainerRecord(
        id=SEED_CONTAINER,
        sandbox_id=SEED_SANDBOXES[0],
        name="app",
        attempt=0,
        state="CONTAINER_CREATED",
        created_ns=1,
    )
    sb.records.save_container(c)


def assert_no_leak(sb: Sandboxes, pods: Pods | None = None) -> None:
    """No half-made row and no RunPodSandbox in flight; every claim and every domain of this
    ledger belongs to a READY sandbox, every sandbox directory, pod network record and (with
    ``pods``) node port to a recorded one."""
    rows = {sid: state for sid, state, _, _ in sb.ledger.sandboxes()}
    assert STATE_CREATING not in rows.values(), "a RunPodSandbox left a half-made row"
    assert not sb.locks.in_flight, f"sandboxes still being made: {sorted(sb.locks.in_flight)}"
    ready = {sid for sid, state in rows.items() if state == SANDBOX_READY}
    assert sb.ledger.claim_owners() <= ready, "claims held by no live sandbox"
    domains = {d.sandbox_id for d in sb.hypervisor.list_ours() if d.owner == sb.ledger.instance_id}
    assert domains <= ready, f"domains of no live sandbox: {sorted(domains - ready)}"
    dirs = {p.name.removesuffix(".img") for p in sb.dirs.root.iterdir()} if sb.dirs.root.is_dir() else set()
    assert dirs <= set(rows), f"directories of no sandbox: {sorted(dirs - set(rows))}"
    networks = {p.stem for p in sb.network.records.glob("*.json")}
    assert networks <= set(rows), f"pod networks of no sandbox: {sorted(networks - set(rows))}"
    if pods is not None and pods.host_ports is not None:
        listening = pods.host_ports.sandboxes()
        assert listening <= ready, f"node ports of no live sandbox: {sorted(listening - ready)}"


def pods_for(sb: Sandboxes, host_ports: HostPorts | None = None) -> Pods:
    """The owners the RuntimeService's RPCs work with, over ``sb`` (an image store of its own in
    its state directory)."""
    images = ImageStore(Path(sb.config.state_dir) / "images")
    return Pods(sb, Containers(sb.config.state_dir, sb, images, sb.hypervisor), host_ports=host_ports)


@contextmanager
def booting(server: Server) -> Iterator[fg.FakeGuest]:
    """While the ``with`` block runs, a RunPodSandbox goes all the way to READY: every domain's
    agent channel is one fake guest answering as an agent does (a one-vCPU guest, as the profile's
    default pod gets), waited for as long as a busy machine may take to schedule it, and the
    profile makes no snapshots (one made in the background would hold claims of its own)."""
    sb = server.sandboxes
    profile = sb.profiles["vmsandbox"]
    guest = fg.FakeGuest(server.root / "agent.sock", lambda _n, peer: peer.serve(fg.agent()))
    sb.profiles["vmsandbox"] = replace(profile, snapshots=False, boot_timeout_s=20)
    sb.hypervisor.channel_path = lambda _domain, _channel: str(guest.path)  # type: ignore[method-assign, assignment]
    try:
        yield guest
    finally:
        del sb.hypervisor.channel_path  # the class's again
        sb.profiles["vmsandbox"] = profile
        guest.close()


def _no_guest(sandbox_id: str, port: int) -> socket.socket:
    raise InfrastructureError(f"sandbox {sandbox_id[:12]}: no guest in this test to relay port {port} to")


@contextmanager
def _no_registry_beyond_loopback() -> Iterator[None]:
    """Pulls of arbitrary references go to a closed loopback port: nothing leaves this machine."""
    closed = "http://127.0.0.1:9"
    saved = {k: os.environ.get(k) for k in ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY")}
    os.environ.update(HTTP_PROXY=closed, HTTPS_PROXY=closed, NO_PROXY="")
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def cri_server() -> Iterator[Server]:
    with _no_registry_beyond_loopback(), tempfile.TemporaryDirectory(prefix="vmsandbox-cri-") as tmp:
        root = Path(tmp)
        image = root / "image"
        image.mkdir()
        for f in ("vmlinux", "initramfs.img"):
            (image / f).write_bytes(b"")  # present, so a valid request reaches define and start
        config = ShimConfig(
            state_dir=str(root / "state"),
            console_dir=str(root / "console"),
            libvirt_uri="test:///default",
            pod_network="none",
        )
        (root / "state").mkdir()
        ledger = Ledger(root / "state" / "state.db")
        hypervisor = Hypervisor("test:///default", attempts=1)
        profile = Profile(
            name="vmsandbox",
            handler="vmsandbox",
            image_dir=str(image),
            boot_timeout_s=0.2,
            memory_overhead_bytes=16 << 20,
            memory_min_bytes=32 << 20,
            default_memory_bytes=16 << 20,
        )  # 32 MiB guests: 16 of the fixture's 60 free 2 MiB pages
        sb = Sandboxes(
            config,
            ledger,
            hypervisor,
            {"vmsandbox": profile},
            inventory=lambda: read_inventory(FIXTURE / "sys", FIXTURE / "proc"),
        )
        seed(sb)
        images = ImageStore(root / "images")
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        containers = Containers(config.state_dir, sb, images, hypervisor)
        host_ports = HostPorts(_no_guest)
        pods = Pods(sb, containers, host_ports=host_ports)
        runtime = RuntimeServicer(pods)
        status.add_servicer(server, pb.DESCRIPTOR.services_by_name["RuntimeService"], runtime)
        status.add_servicer(
            server,
            pb.DESCRIPTOR.services_by_name["ImageService"],
            ImageServicer(images, str(root / "state"), shares=sb.dirs.total_usage),
        )
        sock = root / "cri.sock"
        assert server.add_insecure_port(f"unix:{sock}")
        server.start()
        channel = grpc.insecure_channel(f"unix:{sock}")
        try:
            yield Server(sb, channel, root, containers, pods)
        finally:
            channel.close()
            server.stop(None).wait()
            for sid in host_ports.sandboxes():
                host_ports.close(sid)
            sb.dirs.sweep(set())  # a sandbox directory a test left is a mount: never rmtree through it
            hypervisor.close()
            ledger.close()
