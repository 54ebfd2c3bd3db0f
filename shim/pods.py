"""``Pods``: the one owner the RuntimeService calls, for a pod and everything in it.

A pod is five parts, each kept by the component that alone knows its storage:
- its record and VM (``shim.sandboxes``): admission against the declaration, the host resources
  it holds (through ``ResourceManager``), the libvirt domain, the pod network, and the ledger
  rows of the sandbox and of its containers (``shim.records``, read here directly);
- its containers' guest side (``shim.containers``): the agent connection, the shared directory,
  image holds and image disks, volume binds and log copiers;
- its node ports, for host-network pods (``shim.host_ports``): those below the node's first
  unprivileged port open once a container holding CAP_NET_BIND_SERVICE is created (recorded on
  the container, so a restarted shim opens them again);
- its loopback forward, for pods in a network namespace their caller made (``shim.loopback_forwards``):
  containerd's PortForward dials the namespace's loopback, which is relayed into the guest;
- what NRI plugins are told of it (``shim.nri.hooks``).

Every RuntimeService RPC makes one call here, with the request already translated, but those
that change state: their steps (``shim.rpc``: RunPodSandbox, StopPodSandbox, RemovePodSandbox,
UpdatePodSandboxResources, CreateContainer, StartContainer, StopContainer, RemoveContainer,
UpdateContainerResources) take the parts from here, in their order, and undo a half-done call.
It also keeps the last CPU sample of each sandbox and container, from which stats report nano
cores.

Locking stays with the parts: a sandbox's life cycle runs under its lock (``SandboxLocks``),
record writes go through ``Records`` (one lock for container rows), a container's guest
operations through a lock of its own in ``Containers``. There is deliberately no lock held
across a whole pod for a whole RPC: the kubelet stops a pod's containers in parallel, each for
up to its grace period, and one lock would add those periods up.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence

from shim.containers import Containers
from shim.host_ports import HostPorts
from shim.loopback_forwards import LoopbackForwards
from shim.model import (
    CONTAINER_EXITED,
    CONTAINER_RUNNING,
    SANDBOX_READY,
    Condition,
    ContainerFilter,
    ContainerRecord,
    ContainerStats,
    SandboxFilter,
    SandboxRecord,
    SandboxStats,
)
from shim.nri.hooks import NriHooks
from shim.sandboxes import Sandboxes
from shim.streaming.server import Target
from vmsandbox import cri_metrics, shared_storage, stream_rules
from vmsandbox.adapters.host_checks import host_warnings
from vmsandbox.agent_ops import CgroupStats, ExecResult
from vmsandbox.agent_protocol import NicReport
from vmsandbox.dra import ClaimedNic, PreparedClaim
from vmsandbox.errors import DeadlineExceeded, InvalidArgument, VmSandboxError, WrongState

log = logging.getLogger(__name__)

HOST_SETUP_CONDITION = "HostSetupOptimal"
"""Status condition for host set-up problems (the kubelet acts only on RuntimeReady and NetworkReady)."""
EXEC_OUTPUT_LIMIT = 16 << 20
"""Bytes of stdout and of stderr ExecSync returns (the kubelet caps probe output itself)."""


class _CpuRates:
    """The last CPU sample of each sandbox and container, for nano cores between two stats calls."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[int, int]] = {}  # id -> (timestamp ns, cpu ns)
        self._lock = threading.Lock()

    def rate(self, key: str, s: CgroupStats | None) -> int | None:
        if s is None:
            return None
        with self._lock:
            last = self._last.get(key)
            self._last[key] = (s.timestamp_ns, s.cpu_usage_ns)
        if last is None or s.timestamp_ns <= last[0]:
            return None
        return max(s.cpu_usage_ns - last[1], 0) * 1_000_000_000 // (s.timestamp_ns - last[0])

    def forget(self, *keys: str) -> None:
        with self._lock:
            for key in keys:
                self._last.pop(key, None)


class Pods:
    def __init__(
        self,
        sandboxes: Sandboxes,
        containers: Containers,
        nri: NriHooks | None = None,
        host_ports: HostPorts | None = None,
        loopback_forwards: LoopbackForwards | None = None,
    ) -> None:
        self.sandboxes = sandboxes
        self.records = sandboxes.records
        self.containers = containers
        self.nri = nri if nri is not None else NriHooks(None, sandboxes, containers)
        self.host_ports = host_ports
        self.loopback_forwards = loopback_forwards
        # the DRA claims prepared for a pod (by its uid), when vmsandbox is a DRA driver (shim.dra)
        self.prepared_claims: Callable[[str], Sequence[PreparedClaim]] = lambda _uid: ()
        # write the claims' status once the pod's guest is up: (claims, their NICs, the guest's NICs)
        self.claim_status: Callable[[Sequence[PreparedClaim], Sequence[ClaimedNic], Sequence[NicReport]], None] = (
            lambda _c, _n, _r: None
        )
        # set the claims' devices Ready False when the pod's RunPodSandbox failed: (claims, reason, message)
        self.claim_failure: Callable[[Sequence[PreparedClaim], str, str], None] = lambda _c, _r, _m: None
        self._rates = _CpuRates()

    # -- the runtime ---------------------------------------------------------------------------------
    def conditions(self) -> tuple[list[Condition], str]:
        """The runtime's conditions and the hypervisor's version ("" when it does not answer)."""
        try:
            version = self.sandboxes.hypervisor.version()
            runtime = Condition("RuntimeReady", True)
        except VmSandboxError as exc:
            version = ""
            runtime = Condition("RuntimeReady", False, "HypervisorUnavailable", str(exc))
        ready, reason, message = self.sandboxes.network.ready()
        conditions = [runtime, Condition("NetworkReady", ready, reason, message)]
        # a set-up flaw that slows every pod but breaks none: a condition of its own, only while it holds
        warnings = host_warnings(self.sandboxes.hypervisor.uri)
        if warnings:
            conditions.append(Condition(HOST_SETUP_CONDITION, False, "KvmDeviceNotAccessible", "; ".join(warnings)))
        return conditions, version

    def handlers(self) -> list[str]:
        return sorted(self.sandboxes.profiles)

    def describe(self, hypervisor_version: str) -> dict[str, object]:
        """What ``Status`` with ``verbose`` reports."""
        return {
            "libvirt_uri": self.sandboxes.hypervisor.uri,
            "libvirt_version": hypervisor_version,
            "owned_cpus": sorted(self.sandboxes.policy.owned_cpus),
            "handlers": self.handlers(),
            "nri_plugins": self.nri.plugins(),
        }

    def resume_node_ports(self) -> None:
        """Start-up: the node ports of the host-network pods an earlier process ran."""
        if self.host_ports is None:
            return
        for record in self.records.list_sandboxes():
            if record.state == SANDBOX_READY:
                privileged = any(c.net_bind_service for c in self.records.containers(record.id))
                try:
                    self.host_ports.open(record.id, record.namespaces, record.port_mappings, privileged=privileged)
                except VmSandboxError as exc:
                    log.error("sandbox %s: its node ports are not relayed: %s", record.id[:12], exc)

    # -- pods ----------------------------------------------------------------------------------------
    def sandbox(self, sandbox_id: str) -> SandboxRecord:
        return self.records.get(sandbox_id)

    def list_sandboxes(self, f: SandboxFilter) -> list[SandboxRecord]:
        return [r for r in self.records.list_sandboxes() if f.matches(r)]

    # -- containers ----------------------------------------------------------------------------------
    def container(self, container_id: str) -> ContainerRecord:
        """ContainerStatus: the record, with its guest's word on a live container."""
        return self.containers.refresh(self.records.container(container_id))

    def list_containers(self, f: ContainerFilter) -> list[ContainerRecord]:
        """ListContainers: the filter's id and labels first, then the guest's word on the live ones
        before the state is compared."""
        out = []
        for c in self.records.containers(self._filter_sandbox(f.sandbox_id)):
            if not f.matches_identity(c):
                continue
            c = self._refreshed(c)
            if f.matches_state(c):
                out.append(c)
        return out

    def lists_settled(self) -> bool:
        """Whether the list answers follow from the records alone, and so stay true for as long as
        ``Records.generation`` does: no container's state waits on its guest's word."""
        return not any(self.containers.asks_guest(c) for c in self.records.containers())

    def _filter_sandbox(self, sandbox_id: str) -> str | None:
        """A filter's sandbox id: a unique prefix names its sandbox, as containerd normalises the
        filter; anything else matches nothing (an id of no sandbox has no containers)."""
        if not sandbox_id:
            return None
        with contextlib.suppress(VmSandboxError):
            return self.records.get(sandbox_id).id
        return sandbox_id

    def _refreshed(self, c: ContainerRecord) -> ContainerRecord:
        if c.state == CONTAINER_EXITED:
            return c
        try:
            return self.containers.refresh(c)
        except VmSandboxError as e:
            log.warning("container %s: status from its guest failed: %s", c.id[:12], e)
            return c

    def exec_sync(self, container_id: str, argv: Sequence[str], timeout_s: int) -> ExecResult:
        if timeout_s < 0:
            raise InvalidArgument(f"ExecSync timeout is negative ({timeout_s})")
        res = self.containers.exec_sync(
            self.records.container(container_id).id, list(argv), timeout_s, EXEC_OUTPUT_LIMIT
        )
        if res.timed_out:
            raise DeadlineExceeded(f"command timed out after {timeout_s} s")
        return res

    def forget_rates(self, *ids: str) -> None:
        """The last CPU samples of removed sandboxes and containers go with them."""
        self._rates.forget(*ids)

    def reopen_log(self, container_id: str) -> None:
        self.containers.reopen_log(self.records.container(container_id).id)

    # -- streaming -----------------------------------------------------------------------------------
    def exec_target(
        self, container_id: str, cmd: Sequence[str], *, tty: bool, stdin: bool, stdout: bool, stderr: bool
    ) -> Target:
        c = self.records.container(container_id)  # the record: the guest checks again at the start
        req = stream_rules.check_stream_request(
            "Exec", c.id, list(cmd), tty=tty, stdin=stdin, stdout=stdout, stderr=stderr
        )
        if c.state != CONTAINER_RUNNING:
            raise WrongState(f"container {c.id[:12]} is not running: nothing to exec into")
        return Target("exec", c.sandbox_id, req)

    def attach_target(self, container_id: str, *, tty: bool, stdin: bool, stdout: bool, stderr: bool) -> Target:
        c = self.records.container(container_id)  # the record: the guest checks again at the start
        req = stream_rules.check_stream_request("Attach", c.id, [], tty=tty, stdin=stdin, stdout=stdout, stderr=stderr)
        if tty and not c.tty:
            raise InvalidArgument(
                f"Attach: container {c.id[:12]} was created without a terminal (tty false): attach without tty"
            )
        if c.state != CONTAINER_RUNNING:
            raise WrongState(f"container {c.id[:12]} is not running: nothing to attach to")
        return Target("attach", c.sandbox_id, req)

    def port_forward_target(self, sandbox_id: str, ports: Sequence[str]) -> Target:
        r = self.records.get(sandbox_id)
        if r.state != SANDBOX_READY:
            raise WrongState(f"sandbox {r.id[:12]} is not ready: nothing to forward to")
        return Target("portforward", r.id, ports=tuple(stream_rules.parse_port(p) for p in ports))

    # -- stats ---------------------------------------------------------------------------------------
    def container_stats(self, container_id: str) -> ContainerStats:
        c = self.records.container(container_id)
        return self._container_stats(c, self._shared_parts(c.sandbox_id).get(c.id, (0, 0)))

    def list_container_stats(self, f: ContainerFilter) -> list[ContainerStats]:
        chosen = [
            c
            for c in self.records.containers(f.sandbox_id or None)
            if c.state == CONTAINER_RUNNING and f.matches_identity(c)
        ]
        parts: dict[str, tuple[int, int]] = {}
        for sid in {c.sandbox_id for c in chosen}:
            parts.update(self._shared_parts(sid))
        return [self._container_stats(c, parts.get(c.id, (0, 0))) for c in chosen]

    def sandbox_stats(self, sandbox_id: str) -> SandboxStats:
        return self._sandbox_stats(self.records.get(sandbox_id))

    def list_sandbox_stats(self, f: SandboxFilter) -> list[SandboxStats]:
        return [self._sandbox_stats(r) for r in self.records.list_sandboxes() if f.matches_identity(r)]

    def list_sandbox_metrics(self, clock: Callable[[], int]) -> list[cri_metrics.PodMetrics]:
        """The CRI metrics of every READY pod: its network, and each running container's values
        from its guest (a container whose guest does not answer is left out, as containerd leaves
        out one whose task does not). ``clock``: the host's time in ns, read as each part is."""
        out: list[cri_metrics.PodMetrics] = []
        for r in self.records.list_sandboxes():
            if r.state != SANDBOX_READY:
                continue
            pod = cri_metrics.PodIdentity(r.meta.name, r.meta.namespace, r.id)
            links = self.sandboxes.network.link_counters(r.id)
            read_ns = clock()
            running = [c for c in self.records.containers(r.id) if c.state == CONTAINER_RUNNING]
            parts = self._shared_parts(r.id) if running else {}
            members: list[cri_metrics.ContainerMetrics] = []
            for c in running:
                try:
                    s = self.containers.stats(c.id)
                except VmSandboxError as exc:
                    log.info("metrics: container %s left out: %s", c.id[:12], exc)
                    continue
                if s is None:
                    continue
                shared = parts.get(c.id, (0, 0))
                used = (s.writable_bytes + shared[0], s.writable_inodes + shared[1])
                ident = cri_metrics.ContainerIdentity(c.name, c.id, c.image, c.started_ns)
                now_ns = clock()
                values = cri_metrics.container_values(pod, ident, s, now_ns, used, c.linux.cpu_shares)
                members.append(cri_metrics.ContainerMetrics(c.id, now_ns, tuple(values)))
            pod_values = tuple(cri_metrics.pod_values(pod, links))
            out.append(cri_metrics.PodMetrics(r.id, read_ns, pod_values, tuple(members)))
        return out

    def _container_stats(self, c: ContainerRecord, shared: tuple[int, int] = (0, 0)) -> ContainerStats:
        s = self.containers.stats(c.id)
        return ContainerStats(c, s, self._rates.rate(c.id, s), *shared)

    def _shared_parts(self, sandbox_id: str) -> dict[str, tuple[int, int]]:
        """What the sandbox's guest wrote on the host (one statvfs), split among its running
        containers by their ephemeral-storage limits: container id -> (bytes, inodes)."""
        running = [c for c in self.records.containers(sandbox_id) if c.state == CONTAINER_RUNNING]
        usage = self.sandboxes.dirs.usage(sandbox_id) if running else None
        if usage is None:
            return {}
        weights = shared_storage.container_weights(c.resources for c in running)
        split_bytes = shared_storage.split(usage.used_bytes, weights)
        split_inodes = shared_storage.split(usage.used_inodes, weights)
        return {c.id: (b, i) for c, b, i in zip(running, split_bytes, split_inodes, strict=True)}

    def _host_usage(self, r: SandboxRecord) -> CgroupStats | None:
        """The pod's usage as its cgroup on the host counts it (its QEMU: guest memory, vCPUs,
        emulator and I/O threads), as the kubelet's accounting sees it; None when the pod names
        no cgroup (the guest's own count is reported then) or it cannot be read."""
        if not r.cgroup_parent:
            return None
        try:
            u = self.sandboxes.boot.cgroups.usage(r.cgroup_parent)
        except VmSandboxError as exc:
            log.info("stats: sandbox %s: %s; the guest's own count instead", r.id[:12], exc)
            return None
        return CgroupStats(
            timestamp_ns=u.timestamp_ns,
            cpu_usage_ns=u.cpu_usage_ns,
            memory_usage_bytes=u.memory_usage_bytes,
            memory_working_set_bytes=u.memory_working_set_bytes,
            memory_rss_bytes=u.memory_rss_bytes,
            page_faults=u.page_faults,
            major_page_faults=u.major_page_faults,
            pids=0,
            writable_bytes=0,
            writable_inodes=0,
        )

    def _sandbox_stats(self, r: SandboxRecord) -> SandboxStats:
        s = self._host_usage(r) if r.state == SANDBOX_READY else None
        if s is None and r.state == SANDBOX_READY:
            s = self.containers.sandbox_stats(r.id)
        parts = self._shared_parts(r.id)
        members = tuple(
            self._container_stats(c, parts.get(c.id, (0, 0)))
            for c in self.records.containers(r.id)
            if c.state == CONTAINER_RUNNING
        )
        return SandboxStats(r, s, self._rates.rate(r.id, s), members)
