"""Assemble and run the CRI server: state, hypervisor, profiles, reconciliation, unix socket.

The configuration is checked before anything touches the filesystem (``preflight``: the socket
group exists, the metrics address parses). The socket is created with mode 0660 (umask set around
the bind, then chmod), owned by root and the configured group; the state directory and the console
log directory are 0700 and the state database 0600 (SQLite gives its -wal and -shm files the
database's mode). With a downstream runtime and a ``front_binary``, the shim binds and secures the
CRI socket the same way and hands it to its front (``shim/front.py``), serving gRPC itself on
``<state_dir>/shim.sock`` (0600). With ``containerd_address`` it also serves the node's containerd
as its runtime shim (shim mode, ``shim.containerd.front``). With ``dra.kubeconfig`` it is also a DRA
driver, the kubelet's plugin (``shim.dra``), and with ``dra.nri_socket`` an NRI plugin of the node's
containerd that gives ordinary pods their claimed network devices (``shim.dra.nri_plugin``).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc

from gen.cri.runtime.v1 import api_pb2 as pb
from shim import metrics, status
from shim.config import ShimConfig
from shim.containerd.front import ContainerdFront
from shim.containers import Containers
from shim.dra.driver import DraDriver
from shim.dra.nri_plugin import NriPlugin, start_runc_nics
from shim.dra.pci import PciDevices
from shim.front import Front, FrontLimits, check_binary, shim_socket
from shim.health import Health
from shim.host_policy import qemu_reaches
from shim.host_ports import HostPorts
from shim.image_service import ImageServicer
from shim.image_store import ImageStore
from shim.loopback_forwards import LoopbackForwards
from shim.model import SANDBOX_READY
from shim.nri.hooks import NriHooks
from shim.nri.host import NriHost
from shim.periodic import Periodic
from shim.pods import Pods
from shim.proxy.downstream import Downstream, DownstreamUnavailable
from shim.proxy.ids import DownstreamIds
from shim.proxy.service import Proxy
from shim.runtime_service import RUNTIME_NAME, RuntimeServicer
from shim.sandboxes import Sandboxes
from shim.streaming.backends import ShimBackends, splice
from shim.streaming.server import StreamingServer
from shim.streaming.server import parse_address as parse_streaming_address
from vmsandbox import __version__, validation
from vmsandbox.adapters.domain_events import DomainEvents
from vmsandbox.adapters.host_checks import host_warnings
from vmsandbox.adapters.hypervisor import Hypervisor
from vmsandbox.adapters.layers import Limits
from vmsandbox.adapters.ledger import Ledger
from vmsandbox.adapters.profile_loader import default_profiles, load_profiles
from vmsandbox.agent_protocol import NicReport, report_from_body
from vmsandbox.errors import InfrastructureError, InvalidArgument
from vmsandbox.passable import reach_problems

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
    housekeeping: Periodic | None = None
    streaming: StreamingServer | None = None
    nri: NriHost | None = None
    downstream: Downstream | None = None
    front: Front | None = None
    containerd: ContainerdFront | None = None
    dra: DraDriver | None = None
    dra_nri: NriPlugin | None = None

    def stop(self, grace: float = 5.0) -> None:
        if self.front is not None:
            self.front.stop()  # no new calls; the shim still answers those under way
        if self.containerd is not None:
            self.containerd.close()
        if self.health is not None:
            self.health.shutting_down()
        self.server.stop(grace).wait()
        if self.dra_nri is not None:
            self.dra_nri.stop()
        if self.dra is not None:
            self.dra.stop()
        if self.nri is not None:
            self.nri.close()
        if self.streaming is not None:
            self.streaming.stop()
        if self.downstream is not None:
            self.downstream.close()
        if self.housekeeping is not None:
            self.housekeeping.stop()
        self.sandboxes.snapshots.stop()  # a snapshot being made would hold its pages until the next start
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


def _socket_gid(group: str) -> int | None:
    if not group:
        return None
    import grp

    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise InvalidArgument(f"socket_group {validation.quote(group)} does not exist") from None


def _secure_socket(path: Path, gid: int | None) -> None:
    os.chmod(path, 0o660)
    if gid is not None:
        os.chown(path, 0, gid)


def image_store(config: ShimConfig) -> ImageStore:
    return ImageStore(
        Path(config.image_store_dir or Path(config.state_dir) / "images"),
        registries=config.registries,
        auth_file=config.registry_auth_file,
        limits=Limits(max_bytes=config.image_max_bytes, max_entries=config.image_max_entries),
    )


def preflight(config: ShimConfig) -> int | None:
    """Every check of the configuration that needs no file of ours; returns the socket's group id."""
    gid = _socket_gid(config.socket_group)
    if config.metrics_address:
        metrics.parse_address(config.metrics_address)
    parse_streaming_address(config.streaming_address)
    if _fronted(config):
        check_binary(config.front_binary)
    return gid


def _owner_only_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)


def _open_ledger(state: Path) -> Ledger:
    db = state / "state.db"
    for f in (db, db.with_name("state.db-wal"), db.with_name("state.db-shm")):
        if f.exists():
            os.chmod(f, 0o600)  # a database written by an older build under umask 022
    old = os.umask(0o077)
    try:
        return Ledger(db)
    finally:
        os.umask(old)


def start(config: ShimConfig) -> Running:
    gid = preflight(config)
    profiles = load_profiles(config.profile_files) if config.profile_files else default_profiles()
    unreachable = reach_problems(qemu_reaches(config.state_dir, profiles.values()))
    if unreachable:  # else every RunPodSandbox fails in libvirt with "Permission denied"
        raise InvalidArgument("; ".join(unreachable))
    state = Path(config.state_dir)
    _owner_only_dir(state)
    # passable by others (0711): each sandbox's QEMU, as its own user, reaches its own directory
    # below (shim.containers, 0700 each); everything else here keeps its own mode (0700 or 0600)
    os.chmod(state, 0o711)
    if config.console_dir:
        _owner_only_dir(Path(config.console_dir))
    ledger = _open_ledger(state)
    hypervisor = Hypervisor(config.libvirt_uri, observe=metrics.libvirt_event)
    sandboxes = Sandboxes(config, ledger, hypervisor, profiles)
    images = image_store(config)
    containers = Containers(config.state_dir, sandboxes, images, hypervisor)
    for warning in host_warnings(config.libvirt_uri):
        log.warning("host set-up: %s", warning)
    report = sandboxes.reconciler.reconcile()
    log.info("reconciled with libvirt: %s", {k: len(v) for k, v in report.items()})
    # a guest that dies (QEMU killed, panic) turns its sandbox NOTREADY; after a reconnect every guest is re-checked
    events = DomainEvents(config.libvirt_uri, sandboxes.reconciler.guest_stopped, sandboxes.reconciler.check_guests)
    events.start()
    sandboxes.reconciler.check_guests()  # a guest that died between the reconcile and the subscription
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="cri"))
    log.info("image holds of %d containers restored", containers.hold_images())
    images.collect()  # after the containers hold theirs again: images removed while held and not held now are freed
    agreed = containers.reconcile_with_guests()  # before the logs: a container found started is copied too
    if any(agreed.values()):
        log.info("containers reconciled with their guests: %s", {k: len(v) for k, v in agreed.items()})
    resumed = containers.resume_logs()
    adopted = containers.resume_volumes()
    if adopted:
        log.info("volume copies kept current again for %d containers", adopted)
    if resumed:
        log.info("log copying resumed for %d running containers", resumed)
    # the agents of adopted guests: the same instance carries on, one that started over is a lost agent
    threading.Thread(target=containers.pool.watch_guests, name="agent-watch", daemon=True).start()

    def housekeep() -> None:
        sandboxes.reconciler.reconcile(periodic=True)
        containers.pool.watch_guests()

    housekeeping = Periodic(config.reconcile_interval_s, housekeep, name="periodic-reconcile")
    housekeeping.start()
    backends = ShimBackends(sandboxes.records, containers)
    streaming = StreamingServer(config, backends)
    streaming.start()
    hooks = NriHooks(None, sandboxes, containers)
    if config.nri.enable:  # after the reconcile: plugins synchronize with the pods we have
        hooks.host = NriHost(config.nri, RUNTIME_NAME, __version__, hooks.snapshot, hooks.apply_updates)
        hooks.host.start()
    pods = Pods(
        sandboxes, containers, hooks, HostPorts(backends.dial), LoopbackForwards(backends.guest_connect, splice)
    )
    pods.resume_node_ports()  # host-network pods this shim ran before a restart
    dra = None
    if config.dra.enabled:  # its passthrough devices: groups of the device pools, held in the one ledger
        pci = None
        if config.dra.pci_pools:
            pci = PciDevices(
                config.dra.pci_pools,
                lambda: sandboxes.resources.pools.devices,
                sandboxes.resources.pci_holder,
            )
        dra = DraDriver.start(config.dra, config.state_dir, pci=pci, cni_bin_dirs=config.cni_bin_dirs)
    if dra is not None:  # RunPodSandbox attaches what it prepared for the pod
        pods.prepared_claims = dra.store.for_pod
        pods.claim_status = dra.write_status
        pods.claim_failure = dra.write_failure
        _resync_claim_status(dra, sandboxes, containers)
    dra_nri = None
    if dra is not None and config.dra.nri_socket:  # ordinary pods' claimed devices, through containerd's NRI
        dra_nri = start_runc_nics(dra, config.dra, config.state_dir, frozenset(profiles))
    runtime = RuntimeServicer(pods, streaming)
    image_servicer = ImageServicer(images, config.state_dir, containers.writable_usage, sandboxes.dirs.total_usage)
    downstream = proxy = None
    if config.downstream_endpoint:
        downstream, proxy = _proxy(
            config, server, runtime, image_servicer, sandboxes, frozenset(profiles), _fronted(config)
        )
    else:
        status.add_servicer(server, pb.DESCRIPTOR.services_by_name["RuntimeService"], runtime)
        status.add_servicer(server, pb.DESCRIPTOR.services_by_name["ImageService"], image_servicer)
    health = Health(server)  # grpc.health.v1.Health on the CRI socket
    stop_metrics = None
    if config.metrics_address:
        collector = metrics.HostCollector(
            sandboxes.resources,
            sandboxes.inventory,
            lambda: sum(1 for s in sandboxes.records.list_sandboxes() if s.state == SANDBOX_READY),
            lambda: _vmm_memory(sandboxes),
        )
        stop_metrics = metrics.serve(config.metrics_address, collector)
    sock = Path(config.socket_path)
    _prepare_socket(sock)
    listener = None
    if _fronted(config):  # the front reads the CRI socket; the shim serves it on a socket of its own
        own = shim_socket(config.state_dir)
        _prepare_socket(own)
        _listen_grpc(server, own, 0o177)
        listener = _listen(sock)
    else:
        _listen_grpc(server, sock, 0o117)
    containerd = None
    if config.containerd_address:  # shim mode: containerd's runtime shim for every handler, too
        # before the CRI socket answers: the pods containerd lost with the last process go first
        containerd = ContainerdFront(config, pods)
        containerd.start()
    server.start()
    health.serving()
    _secure_socket(sock, gid)
    front = None
    if listener is not None and proxy is not None:
        front = Front(
            config.front_binary,
            listener,
            own,
            config.downstream_endpoint,
            config.downstream_timeout_s,
            proxy.local_list,
            lambda: sandboxes.records.generation,
            FrontLimits.of(config),
        )
        sandboxes.records.watch_generation(front.generation_changed)
        front.start()
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
        housekeeping=housekeeping,
        streaming=streaming,
        nri=hooks.host,
        downstream=downstream,
        front=front,
        containerd=containerd,
        dra=dra,
        dra_nri=dra_nri,
    )


def _resync_claim_status(dra: DraDriver, sandboxes: Sandboxes, containers: Containers) -> None:
    """The claims of the READY pods this shim ran before a restart get their status written again,
    from what each guest reports now (in the background: each guest answers in its own time)."""
    ready = [
        (s.id, f"{s.meta.namespace}/{s.meta.name}", s.meta.uid)
        for s in sandboxes.records.list_sandboxes()
        if s.state == SANDBOX_READY
    ]

    def report(sandbox_id: str) -> tuple[NicReport, ...]:
        body = containers.pool.client(sandbox_id).request("report", {}, timeout_s=10)
        return report_from_body(body).nics

    def run() -> None:
        done = dra.resync_status(ready, report)
        if done:
            log.info("DRA: the claims' status of %d running pods written again", done)

    threading.Thread(target=run, name="dra-status", daemon=True).start()


def _vmm_memory(sandboxes: Sandboxes) -> Iterator[tuple[str, int]]:
    """(sandbox id, KiB) of each ready sandbox's QEMU beyond guest RAM, for the metrics' scrape."""
    for s in sandboxes.records.list_sandboxes():
        if s.state == SANDBOX_READY and s.domain:
            shape = s.sized_shape()
            ordinary = 0 if shape.hugepage_backed else shape.memory_bytes // 1024
            kib = sandboxes.hypervisor.emulator_memory_kib(s.domain, ordinary)
            if kib is not None:
                yield s.id, kib


def _fronted(config: ShimConfig) -> bool:
    return bool(config.downstream_endpoint and config.front_binary)


def _listen_grpc(server: grpc.Server, path: Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        port = server.add_insecure_port(f"unix:{path}")
    finally:
        os.umask(old)
    if not port:
        raise InfrastructureError(f"cannot listen on unix socket {path}")


def _listen(path: Path) -> socket.socket:
    """The CRI socket, listening, for the front (mode 0660 as the shim's own would be)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o117)
    try:
        listener.bind(str(path))
    except OSError as exc:
        listener.close()
        raise InfrastructureError(f"cannot listen on unix socket {path}: {exc}") from None
    finally:
        os.umask(old)
    listener.listen(512)
    listener.set_inheritable(True)
    return listener


def _proxy(
    config: ShimConfig,
    server: grpc.Server,
    runtime: RuntimeServicer,
    images: ImageServicer,
    sandboxes: Sandboxes,
    handlers: frozenset[str],
    fronted: bool,
) -> tuple[Downstream, Proxy]:
    """Route every handler that is not a profile's to the downstream runtime (``shim/proxy``)."""
    downstream = Downstream(config.downstream_endpoint, config.downstream_timeout_s, max(1, config.workers // 2))
    ids = DownstreamIds(downstream)
    try:
        listed = ids.relist()
        log.info(
            "downstream %s: %d sandboxes, %d containers",
            config.downstream_endpoint,
            len(listed.sandboxes),
            len(listed.containers),
        )
    except DownstreamUnavailable as exc:  # found again by the first call that needs it
        log.warning("%s; its pods are listed again when it answers", exc)
    proxy = Proxy(runtime, images, sandboxes.records, downstream, ids, handlers, fronted)
    server.add_generic_rpc_handlers(proxy.generic_handlers())
    return downstream, proxy


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
