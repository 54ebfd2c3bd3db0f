"""Prometheus metrics of the shim, served over HTTP when ``metrics_address`` is configured.

Events are counted where they happen with one-line calls (``observe_start`` in the orchestrator,
``rejected`` in the RPC wrapper, ``image_pull`` in the image store, ``log_records_fixed`` in the
log copy, ``libvirt_event`` from the
hypervisor adapter's hook); the host's state (guests running, CPUs, hugepages and ordinary memory
allocated vs free per NUMA node) is read from the ResourceManager and the sysfs inventory at scrape
time by ``HostCollector``, and so is each running guest's QEMU memory beyond guest RAM (its
``/proc/<pid>/smaps_rollup``, through the hypervisor adapter). The core
(``vmsandbox/``) never imports this module.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from vmsandbox.errors import InfrastructureError, InvalidArgument
from vmsandbox.resources import page_size_label
from vmsandbox.validation import quote

if TYPE_CHECKING:
    from shim.host_resources import ResourceManager
    from vmsandbox.host import HostInventory

log = logging.getLogger(__name__)

REGISTRY = CollectorRegistry()
ProcessCollector(registry=REGISTRY)
PlatformCollector(registry=REGISTRY)

START_SECONDS = Histogram(
    "vmsandbox_sandbox_start_seconds",
    "RunPodSandbox until the guest reported ready, in seconds",
    ["handler"],
    buckets=(0.25, 0.5, 1, 1.5, 2, 3, 4, 5, 7.5, 10, 15, 20, 30, 60, 120),
    registry=REGISTRY,
)
REJECTIONS = Counter(
    "vmsandbox_admission_rejections",
    "CRI requests refused, by RPC and reason (the gRPC status code answered)",
    ["rpc", "reason"],
    registry=REGISTRY,
)
LIBVIRT_ERRORS = Counter("vmsandbox_libvirt_errors", "libvirt calls that failed (after any retries)", registry=REGISTRY)
LIBVIRT_RETRIES = Counter("vmsandbox_libvirt_retries", "Transient libvirt errors that were retried", registry=REGISTRY)

IMAGE_PULLS = Counter(
    "vmsandbox_image_pulls", "PullImage calls that did the work, by result (ok or error)", ["result"], registry=REGISTRY
)
IMAGE_PULLS_SHARED = Counter(
    "vmsandbox_image_pulls_shared", "PullImage calls that waited for the same pull already running", registry=REGISTRY
)
IMAGE_PULL_BYTES = Counter(
    "vmsandbox_image_pull_bytes", "Compressed bytes of blobs fetched from registries", registry=REGISTRY
)
IMAGE_PULL_SECONDS = Histogram(
    "vmsandbox_image_pull_seconds",
    "PullImage duration (resolve, download, unpack), in seconds",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600),
    registry=REGISTRY,
)
LOG_RECORDS_FIXED = Counter(
    "vmsandbox_log_records_fixed",
    "Container log records from guests the host dropped or repaired, by fix (vmsandbox.log_copy_rules.check_records)",
    ["fix"],
    registry=REGISTRY,
)


def observe_start(handler: str, seconds: float) -> None:
    START_SECONDS.labels(handler=handler).observe(seconds)


def rejected(rpc: str, reason: str) -> None:
    REJECTIONS.labels(rpc=rpc, reason=reason).inc()


def image_pull(result: str, fetched_bytes: int, seconds: float) -> None:
    IMAGE_PULLS.labels(result=result).inc()
    IMAGE_PULL_BYTES.inc(fetched_bytes)
    IMAGE_PULL_SECONDS.observe(seconds)


def log_records_fixed(fix: str, count: int) -> None:
    LOG_RECORDS_FIXED.labels(fix=fix).inc(count)


def image_pull_shared() -> None:
    IMAGE_PULLS_SHARED.inc()


def libvirt_event(event: str) -> None:
    """The hypervisor adapter's hook: ``retry`` for a retried transient error, ``error`` for a failure."""
    (LIBVIRT_RETRIES if event == "retry" else LIBVIRT_ERRORS).inc()


class HostCollector(Collector):
    """Guests running and the shim's CPUs and hugepages per NUMA node, read at scrape time."""

    def __init__(
        self,
        resources: ResourceManager,
        inventory: Callable[[], HostInventory],
        guests_running: Callable[[], int],
        vmm_memory: Callable[[], Iterable[tuple[str, int]]] = lambda: (),
    ) -> None:
        self.resources = resources
        self.inventory = inventory
        self.guests_running = guests_running
        self.vmm_memory = vmm_memory

    def describe(self) -> Iterator[Metric]:
        return iter(())  # no collect() at registration: the ledger may not be ready yet

    def collect(self) -> Iterator[Metric]:
        try:
            guests = self.guests_running()
            usage = self.resources.usage()
            inv = self.inventory()
        except Exception as exc:  # a scrape must not take the server down
            log.warning("metrics: cannot read the ledger or the inventory: %s", exc)
            return
        running = GaugeMetricFamily("vmsandbox_guests_running", "Sandboxes whose guest is up (SANDBOX_READY)")
        running.add_metric([], guests)
        yield running

        allocated_cpus = {u.node: u.held for u in usage if u.resource == "cpu"}
        cpus = GaugeMetricFamily(
            "vmsandbox_cpus", "CPUs the shim owns per NUMA node, allocated (pinned) or free", labels=["node", "state"]
        )
        for node in inv.nodes:
            owned = sum(1 for c in inv.cpus if c.node == node and c.id in self.resources.policy.owned_cpus)
            allocated = allocated_cpus.get(node, 0)
            cpus.add_metric([str(node), "allocated"], allocated)
            cpus.add_metric([str(node), "free"], owned - allocated)
        yield cpus

        pages = GaugeMetricFamily(
            "vmsandbox_hugepages",
            "Hugepages of the shim's budget per NUMA node and page size, allocated or free",
            labels=["node", "page_size", "state"],
        )
        for u in usage:
            if u.resource.startswith("hugepages-"):
                label = u.resource.removeprefix("hugepages-")
                pages.add_metric([str(u.node), label, "allocated"], u.held)
                pages.add_metric([str(u.node), label, "free"], max(u.free, 0))
        yield pages
        memory = GaugeMetricFamily(
            "vmsandbox_memory_bytes",
            "Ordinary memory (guests not on hugepages) the shim may hand out per NUMA node, allocated or free",
            labels=["node", "state"],
        )
        for u in usage:
            if u.resource == "memory":
                memory.add_metric([str(u.node), "allocated"], u.held)
                memory.add_metric([str(u.node), "free"], max(u.free, 0))
        yield memory
        host_free = GaugeMetricFamily(
            "vmsandbox_host_hugepages_free",
            "Free hugepages per NUMA node and page size as the kernel reports them",
            labels=["node", "page_size"],
        )
        for pool in sorted(inv.hugepages):
            host_free.add_metric([str(pool.node), page_size_label(pool.page_size)], pool.free)
        yield host_free
        yield from self._vmm_memory()

    def _vmm_memory(self) -> Iterator[Metric]:
        try:
            measured = sorted(self.vmm_memory())
        except Exception as exc:  # a scrape must not take the server down
            log.warning("metrics: cannot read QEMU's memory: %s", exc)
            return
        vmm = GaugeMetricFamily(
            "vmsandbox_vmm_private_memory_bytes",
            "Memory each running sandbox's QEMU holds beyond guest RAM (its anonymous pages: TCG "
            "translation cache, device state, heap), by sandbox",
            labels=["sandbox_id"],
        )
        for sandbox_id, kib in measured:
            vmm.add_metric([sandbox_id], kib * 1024)
        yield vmm
        total = GaugeMetricFamily(
            "vmsandbox_vmm_private_memory_total_bytes",
            "The sum of vmsandbox_vmm_private_memory_bytes over the sandboxes measured",
        )
        total.add_metric([], sum(kib for _, kib in measured) * 1024)
        yield total


def parse_address(address: str) -> tuple[str, int]:
    """``host:port``, ``:port`` (loopback: 127.0.0.1) or ``[v6]:port``; all interfaces only when asked
    for by name (``0.0.0.0:port`` or ``[::]:port``)."""
    host, sep, port = address.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise InvalidArgument(f"metrics_address: {quote(address)} is not host:port (e.g. 127.0.0.1:9464)")
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port)


def serve(address: str, collector: HostCollector) -> Callable[[], None]:
    """Register the host collector and serve ``/metrics`` on ``address``; returns the stop function."""
    host, port = parse_address(address)
    REGISTRY.register(collector)
    try:
        server, thread = start_http_server(port, addr=host, registry=REGISTRY)
    except OSError as exc:
        REGISTRY.unregister(collector)
        raise InfrastructureError(f"cannot serve metrics on {address}: {exc.strerror or exc}") from exc
    log.info("metrics on http://%s/metrics", address)

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
        REGISTRY.unregister(collector)

    return stop
