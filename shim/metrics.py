"""Prometheus metrics of the shim, served over HTTP when ``metrics_address`` is configured.

Events are counted where they happen with one-line calls (``observe_start`` in the orchestrator,
``rejected`` in the RPC wrapper, ``image_pull`` in the image store, ``libvirt_event`` from the
hypervisor adapter's hook); the host's state (guests running, CPUs and hugepages allocated vs
free per NUMA node) is read from the ledger
and the sysfs inventory at scrape time by ``HostCollector``, so it cannot drift. The core
(``vmsandbox/``) never imports this module.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
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

if TYPE_CHECKING:
    from shim.sandboxes import Sandboxes

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

_PAGE_KEY = re.compile(r"^hugepages-(\d+)kB:node(\d+):\d+$")


def observe_start(handler: str, seconds: float) -> None:
    START_SECONDS.labels(handler=handler).observe(seconds)


def rejected(rpc: str, reason: str) -> None:
    REJECTIONS.labels(rpc=rpc, reason=reason).inc()


def image_pull(result: str, fetched_bytes: int, seconds: float) -> None:
    IMAGE_PULLS.labels(result=result).inc()
    IMAGE_PULL_BYTES.inc(fetched_bytes)
    IMAGE_PULL_SECONDS.observe(seconds)


def image_pull_shared() -> None:
    IMAGE_PULLS_SHARED.inc()


def libvirt_event(event: str) -> None:
    """The hypervisor adapter's hook: ``retry`` for a retried transient error, ``error`` for a failure."""
    (LIBVIRT_RETRIES if event == "retry" else LIBVIRT_ERRORS).inc()


class HostCollector(Collector):
    """Guests running and the shim's CPUs and hugepages per NUMA node, read at scrape time."""

    def __init__(self, sandboxes: Sandboxes) -> None:
        self.sandboxes = sandboxes

    def describe(self) -> Iterator[Metric]:
        return iter(())  # no collect() at registration: the ledger may not be ready yet

    def collect(self) -> Iterator[Metric]:
        s = self.sandboxes
        try:
            rows = s.ledger.sandboxes()
            taken = s.ledger.taken()
            inv = s.inventory()
            budgets = s.policy.budgets(inv)
        except Exception as exc:  # a scrape must not take the server down
            log.warning("metrics: cannot read the ledger or the inventory: %s", exc)
            return
        running = GaugeMetricFamily("vmsandbox_guests_running", "Sandboxes whose guest is up (SANDBOX_READY)")
        running.add_metric([], sum(1 for _, state, _, _ in rows if state == "SANDBOX_READY"))
        yield running

        held_cpus = {int(k[4:]) for k in taken if k.startswith("cpu:") and k[4:].isdigit()}
        cpus = GaugeMetricFamily(
            "vmsandbox_cpus", "CPUs the shim owns per NUMA node, allocated (pinned) or free", labels=["node", "state"]
        )
        for node in inv.nodes:
            owned = [c.id for c in inv.cpus if c.node == node and c.id in s.policy.owned_cpus]
            allocated = sum(1 for c in owned if c in held_cpus)
            cpus.add_metric([str(node), "allocated"], allocated)
            cpus.add_metric([str(node), "free"], len(owned) - allocated)
        yield cpus

        held_pages: dict[tuple[int, int], int] = {}
        for key in taken:
            m = _PAGE_KEY.match(key)
            if m:
                where = (int(m.group(2)), int(m.group(1)) * 1024)
                held_pages[where] = held_pages.get(where, 0) + 1
        pages = GaugeMetricFamily(
            "vmsandbox_hugepages",
            "Hugepages of the shim's budget per NUMA node and page size, allocated or free",
            labels=["node", "page_size", "state"],
        )
        host_free = GaugeMetricFamily(
            "vmsandbox_host_hugepages_free",
            "Free hugepages per NUMA node and page size as the kernel reports them",
            labels=["node", "page_size"],
        )
        for (node, size), budget in sorted(budgets.items()):
            allocated = held_pages.get((node, size), 0)
            label = page_size_label(size)
            pages.add_metric([str(node), label, "allocated"], allocated)
            pages.add_metric([str(node), label, "free"], max(budget.pages - allocated, 0))
            host_free.add_metric([str(node), label], budget.host_free)
        yield pages
        yield host_free


def parse_address(address: str) -> tuple[str, int]:
    """``host:port``, ``:port`` (all interfaces) or ``[v6]:port``."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(f"metrics_address: {address!r} is not host:port (e.g. 127.0.0.1:9464)")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port)


def serve(address: str, sandboxes: Sandboxes) -> Callable[[], None]:
    """Register the host collector and serve ``/metrics`` on ``address``; returns the stop function."""
    host, port = parse_address(address)
    collector = HostCollector(sandboxes)
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
