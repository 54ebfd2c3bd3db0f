"""Assemble and run the CRI server: state, hypervisor, profiles, reconciliation, unix socket.

The socket is created with mode 0660 (umask set around the bind, then chmod), owned by root
and the configured group; the state directory is 0700.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc

from shim import metrics
from shim.config import ShimConfig
from shim.containers import Containers
from shim.cri.runtime.v1 import api_pb2_grpc as pb_grpc
from shim.health import Health
from shim.image_service import ImageServicer
from shim.images import ImageStore
from shim.runtime_service import RuntimeServicer
from shim.sandboxes import Sandboxes
from vmsandbox.adapters.domain_events import DomainEvents
from vmsandbox.adapters.hypervisor import Hypervisor
from vmsandbox.adapters.layers import Limits
from vmsandbox.adapters.ledger import Ledger
from vmsandbox.adapters.profile_loader import default_profiles, load_profiles
from vmsandbox.errors import InfrastructureError

log = logging.getLogger(__name__)


@dataclass
class Running:
    server: grpc.Server
    sandboxes: Sandboxes
    ledger: Ledger
    hypervisor: Hypervisor
    health: Health | None = None
    stop_metrics: Callable[[], None] | None = None
    events: DomainEvents | None = None

    def stop(self, grace: float = 5.0) -> None:
        if self.health is not None:
            self.health.shutting_down()
        self.server.stop(grace).wait()
        if self.events is not None:
            self.events.close()
        if self.stop_metrics is not None:
            self.stop_metrics()
        self.hypervisor.close()
        self.ledger.close()


def _prepare_socket(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        if not path.is_socket():
            raise InfrastructureError(f"{path} exists and is not a socket; refusing to replace it")
        path.unlink()


def _secure_socket(path: Path, group: str) -> None:
    os.chmod(path, 0o660)
    if group:
        import grp

        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError:
            raise InfrastructureError(f"socket_group {group!r} does not exist") from None
        os.chown(path, 0, gid)


def image_store(config: ShimConfig) -> ImageStore:
    return ImageStore(
        Path(config.image_store_dir or Path(config.state_dir) / "images"),
        registries=config.registries,
        auth_file=config.registry_auth_file,
        limits=Limits(max_bytes=config.image_max_bytes, max_entries=config.image_max_entries),
    )


def start(config: ShimConfig) -> Running:
    state = Path(config.state_dir)
    state.mkdir(parents=True, exist_ok=True)
    os.chmod(state, 0o700)
    ledger = Ledger(state / "state.db")
    hypervisor = Hypervisor(config.libvirt_uri, observe=metrics.libvirt_event)
    profiles = load_profiles(config.profile_files) if config.profile_files else default_profiles()
    sandboxes = Sandboxes(config, ledger, hypervisor, profiles)
    report = sandboxes.reconcile()
    log.info("reconciled with libvirt: %s", {k: len(v) for k, v in report.items()})
    # a guest that dies (QEMU killed, panic) turns its sandbox NOTREADY; after a reconnect every guest is re-checked
    events = DomainEvents(config.libvirt_uri, sandboxes.guest_stopped, sandboxes.check_guests)
    events.start()
    sandboxes.check_guests()  # a guest that died between the reconcile and the subscription
    images = image_store(config)
    images.collect()  # after reconciliation: images removed while held and not held again are freed
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="cri"))
    containers = Containers(config.state_dir, sandboxes, images, hypervisor)
    pb_grpc.add_RuntimeServiceServicer_to_server(RuntimeServicer(sandboxes, containers), server)
    pb_grpc.add_ImageServiceServicer_to_server(ImageServicer(images, config.state_dir), server)
    health = Health(server)  # grpc.health.v1.Health on the CRI socket
    stop_metrics = metrics.serve(config.metrics_address, sandboxes) if config.metrics_address else None
    sock = Path(config.socket_path)
    _prepare_socket(sock)
    old = os.umask(0o117)
    try:
        port = server.add_insecure_port(f"unix:{sock}")
    finally:
        os.umask(old)
    if not port:
        raise InfrastructureError(f"cannot listen on unix socket {sock}")
    server.start()
    health.serving()
    _secure_socket(sock, config.socket_group)
    log.info(
        "vmsandbox listening on %s (libvirt %s, CPUs %s, handlers %s)",
        sock,
        config.libvirt_uri,
        sorted(sandboxes.policy.owned_cpus),
        sorted(profiles),
    )
    return Running(
        server=server,
        sandboxes=sandboxes,
        ledger=ledger,
        hypervisor=hypervisor,
        health=health,
        stop_metrics=stop_metrics,
        events=events,
    )


def serve(config: ShimConfig) -> None:
    running = start(config)
    done = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal %d: shutting down (guests keep running and are adopted on restart)", signum)
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    done.wait()
    running.stop()
