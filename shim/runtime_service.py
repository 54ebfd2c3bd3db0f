"""``runtime.v1.RuntimeService``: a thin servicer over ``Sandboxes`` (ImageService: ``shim.image_service``).

Each method translates the request (``shim.translate``), calls the orchestrator, translates the
answer. RPCs this build does not serve answer UNIMPLEMENTED with a sentence saying so.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from shim import translate
from shim.containers import Containers
from shim.cri.runtime.v1 import api_pb2 as pb
from shim.cri.runtime.v1 import api_pb2_grpc as pb_grpc
from shim.host_ports import HostPorts
from shim.model import CONTAINER_EXITED, CONTAINER_RUNNING, SANDBOX_READY, ContainerRecord, SandboxRecord
from shim.nri.hooks import NriHooks
from shim.sandboxes import Sandboxes
from shim.status import rpc
from shim.streaming.server import StreamingServer, Target
from vmsandbox import __version__, streaming
from vmsandbox.adapters.host_checks import host_warnings
from vmsandbox.agent_protocol import CgroupStats
from vmsandbox.errors import DeadlineExceeded, InfrastructureError, InvalidArgument, VmSandboxError, WrongState

log = logging.getLogger(__name__)

RUNTIME_NAME = "vmsandbox"
API_VERSION = "v1"
# Status condition for host set-up problems (the kubelet acts only on RuntimeReady and NetworkReady)
HOST_SETUP_CONDITION = "HostSetupOptimal"


def _labels_match(labels: dict[str, str], selector: Any) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _not_built(name: str, why: str) -> Callable[..., Any]:
    def handler(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{name} is not implemented by vmsandbox {__version__}: {why}")

    handler.__name__ = name
    return handler


_EXEC_OUTPUT_LIMIT = 16 << 20
"""Bytes of stdout and of stderr ExecSync returns (the kubelet caps probe output itself)."""


class RuntimeServicer(pb_grpc.RuntimeServiceServicer):
    def __init__(
        self,
        sandboxes: Sandboxes,
        containers: Containers,
        streaming: StreamingServer | None = None,
        nri: NriHooks | None = None,
        host_ports: HostPorts | None = None,
    ) -> None:
        self.sandboxes = sandboxes
        self.containers = containers
        self.streaming = streaming
        self.host_ports = host_ports
        self.nri = nri if nri is not None else NriHooks(None, sandboxes, containers)
        self._cpu_samples: dict[str, tuple[int, int]] = {}  # id -> (timestamp ns, cpu ns), for nano cores
        self._samples_lock = threading.Lock()

    def _forget_samples(self, *keys: str) -> None:
        """Removed sandboxes and containers leave no CPU sample behind."""
        with self._samples_lock:
            for key in keys:
                self._cpu_samples.pop(key, None)

    def _nano_cores(self, key: str, s: CgroupStats) -> int | None:
        with self._samples_lock:
            last = self._cpu_samples.get(key)
            self._cpu_samples[key] = (s.timestamp_ns, s.cpu_usage_ns)
        if last is None or s.timestamp_ns <= last[0]:
            return None
        return max(s.cpu_usage_ns - last[1], 0) * 1_000_000_000 // (s.timestamp_ns - last[0])

    def _container_stats(self, c: ContainerRecord) -> pb.ContainerStats:
        s = self.containers.stats(c.id)
        nano = self._nano_cores(c.id, s) if s is not None else None
        return translate.container_stats(c, s, nano, self.sandboxes.config.state_dir)

    def _sandbox_stats(self, r: SandboxRecord) -> pb.PodSandboxStats:
        s = self.containers.sandbox_stats(r.id) if r.state == SANDBOX_READY else None
        containers = [self._container_stats(c) for c in self.sandboxes.containers(r.id) if c.state == CONTAINER_RUNNING]
        nano = self._nano_cores(r.id, s) if s is not None else None
        return translate.pod_sandbox_stats(r, s, nano, containers)

    @rpc
    def Version(self, request: pb.VersionRequest, context: grpc.ServicerContext) -> pb.VersionResponse:
        return pb.VersionResponse(
            version="0.1.0", runtime_name=RUNTIME_NAME, runtime_version=__version__, runtime_api_version=API_VERSION
        )

    @rpc
    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusResponse:
        try:
            libvirt_version = self.sandboxes.hypervisor.version()
            runtime = pb.RuntimeCondition(type="RuntimeReady", status=True)
        except VmSandboxError as exc:
            libvirt_version = ""
            runtime = pb.RuntimeCondition(
                type="RuntimeReady", status=False, reason="HypervisorUnavailable", message=str(exc)
            )
        ready, reason, message = self.sandboxes.network.ready()
        network = pb.RuntimeCondition(type="NetworkReady", status=ready, reason=reason, message=message)
        conditions = [runtime, network]
        # A set-up flaw that slows every pod but breaks none: a condition of its own, shown by
        # `crictl info`, only while it holds; RuntimeReady stays what the kubelet acts on.
        warnings = host_warnings(self.sandboxes.hypervisor.uri)
        if warnings:
            conditions.append(
                pb.RuntimeCondition(
                    type=HOST_SETUP_CONDITION,
                    status=False,
                    reason="KvmDeviceNotAccessible",
                    message="; ".join(warnings),
                )
            )
        info = {}
        if request.verbose:
            import json

            info["info"] = json.dumps(
                {
                    "libvirt_uri": self.sandboxes.hypervisor.uri,
                    "libvirt_version": libvirt_version,
                    "owned_cpus": sorted(self.sandboxes.policy.owned_cpus),
                    "handlers": sorted(self.sandboxes.profiles),
                    "nri_plugins": self.nri.plugins(),
                },
                sort_keys=True,
            )
        return pb.StatusResponse(
            status=pb.RuntimeStatus(conditions=conditions),
            info=info,
            # recursive read-only mounts: enforced by the host's bind (vmsandbox/adapters/binds.py)
            runtime_handlers=[
                pb.RuntimeHandler(name=h, features=pb.RuntimeHandlerFeatures(recursive_read_only_mounts=True))
                for h in sorted(self.sandboxes.profiles)
            ],
        )

    @rpc
    def RunPodSandbox(
        self, request: pb.RunPodSandboxRequest, context: grpc.ServicerContext
    ) -> pb.RunPodSandboxResponse:
        if not request.HasField("config"):
            raise InvalidArgument("RunPodSandboxRequest.config is missing")
        spec = translate.sandbox_spec(request.config, request.runtime_handler)
        sandbox_id = self.sandboxes.run(spec)
        try:
            if self.host_ports is not None:
                self.host_ports.open(sandbox_id, spec.namespaces, spec.port_mappings)
        except BaseException:
            self.sandboxes.stop(sandbox_id)
            self.containers.sandbox_stopped(sandbox_id)
            self.sandboxes.remove(sandbox_id)
            raise
        try:
            return pb.RunPodSandboxResponse(pod_sandbox_id=self.nri.sandbox_started(sandbox_id))
        except BaseException:
            if self.host_ports is not None:
                self.host_ports.close(sandbox_id)
            raise

    @rpc
    def StopPodSandbox(
        self, request: pb.StopPodSandboxRequest, context: grpc.ServicerContext
    ) -> pb.StopPodSandboxResponse:
        record = self.sandboxes.find_for_teardown(request.pod_sandbox_id)
        if record is not None:
            if self.host_ports is not None:
                self.host_ports.close(record.id)
            self.sandboxes.stop(record.id)
            self.containers.sandbox_stopped(record.id)
            self.nri.sandbox_stopped(record)
        return pb.StopPodSandboxResponse()

    @rpc
    def RemovePodSandbox(
        self, request: pb.RemovePodSandboxRequest, context: grpc.ServicerContext
    ) -> pb.RemovePodSandboxResponse:
        record = self.sandboxes.find_for_teardown(request.pod_sandbox_id)
        if record is not None:
            members = self.sandboxes.containers(record.id)
            gone = [record.id, *(c.id for c in members)]
            if self.host_ports is not None:
                self.host_ports.close(record.id)
            self.containers.sandbox_removed(record.id)
            self.sandboxes.remove(record.id)
            self._forget_samples(*gone)
            self.nri.sandbox_removed(record, members)
        return pb.RemovePodSandboxResponse()

    @rpc
    def PodSandboxStatus(
        self, request: pb.PodSandboxStatusRequest, context: grpc.ServicerContext
    ) -> pb.PodSandboxStatusResponse:
        record = self.sandboxes.get(request.pod_sandbox_id)
        return pb.PodSandboxStatusResponse(
            status=translate.pod_sandbox_status(record),
            info=translate.sandbox_info(record) if request.verbose else {},
            timestamp=time.time_ns(),
        )

    @rpc
    def ListPodSandbox(
        self, request: pb.ListPodSandboxRequest, context: grpc.ServicerContext
    ) -> pb.ListPodSandboxResponse:
        f = request.filter

        def keep(r: SandboxRecord) -> bool:
            if f.id and not r.id.startswith(f.id):
                return False
            if f.HasField("state") and translate.sandbox_state(r.state) != f.state.state:
                return False
            return _labels_match(r.labels, f.label_selector)

        items = [translate.pod_sandbox(r) for r in self.sandboxes.list_sandboxes() if keep(r)]
        return pb.ListPodSandboxResponse(items=items)

    @rpc
    def UpdatePodSandboxResources(
        self, request: pb.UpdatePodSandboxResourcesRequest, context: grpc.ServicerContext
    ) -> pb.UpdatePodSandboxResourcesResponse:
        resources = translate.linux_resources(request.resources, "resources")
        self.sandboxes.update_sandbox(request.pod_sandbox_id, resources)
        self.nri.sandbox_updated(
            request.pod_sandbox_id, translate.linux_resources(request.overhead, "overhead"), resources
        )
        return pb.UpdatePodSandboxResourcesResponse()

    @rpc
    def CreateContainer(
        self, request: pb.CreateContainerRequest, context: grpc.ServicerContext
    ) -> pb.CreateContainerResponse:
        if not request.pod_sandbox_id:
            raise InvalidArgument("CreateContainerRequest.pod_sandbox_id is empty")
        if not request.HasField("config"):
            raise InvalidArgument("CreateContainerRequest.config is missing")
        spec = translate.container_spec(request.config)
        sandbox = self.sandboxes.get(request.pod_sandbox_id)
        sysctls = request.sandbox_config.linux.sysctls
        run, user, stop_signal = translate.container_request(request.config, sandbox.hostname, sysctls)
        mounts = translate.mount_requests(request.config)
        spec, run, mounts = self.nri.adjust_container(sandbox, spec, run, mounts)
        self.containers.check_mounts(mounts)
        cid = self.sandboxes.create_container(request.pod_sandbox_id, spec)
        try:
            self.containers.create(cid, run, user, stop_signal, mounts)
        except BaseException:
            self.sandboxes.remove_container(cid)
            raise
        self.nri.container_created(cid)
        return pb.CreateContainerResponse(container_id=cid)

    @rpc
    def StartContainer(
        self, request: pb.StartContainerRequest, context: grpc.ServicerContext
    ) -> pb.StartContainerResponse:
        self.nri.container_starting(request.container_id)
        self.containers.start(request.container_id)
        self.nri.container_started(request.container_id)
        return pb.StartContainerResponse()

    @rpc
    def StopContainer(
        self, request: pb.StopContainerRequest, context: grpc.ServicerContext
    ) -> pb.StopContainerResponse:
        if request.timeout < 0:
            raise InvalidArgument(f"StopContainer timeout is negative ({request.timeout})")
        self.containers.stop(request.container_id, int(request.timeout))
        self.nri.container_stopped(request.container_id)
        return pb.StopContainerResponse()

    @rpc
    def RemoveContainer(
        self, request: pb.RemoveContainerRequest, context: grpc.ServicerContext
    ) -> pb.RemoveContainerResponse:
        if not request.container_id:
            raise InvalidArgument("container_id is empty")
        record = self.nri.removing(request.container_id)
        removed = self.containers.remove(request.container_id)
        self.nri.container_removed(record if removed is not None else None)
        if removed is not None:
            self._forget_samples(removed)
        return pb.RemoveContainerResponse()

    @rpc
    def ListContainers(
        self, request: pb.ListContainersRequest, context: grpc.ServicerContext
    ) -> pb.ListContainersResponse:
        f = request.filter
        sandbox_id = f.pod_sandbox_id
        if sandbox_id:
            # a unique prefix names its sandbox, as containerd normalises the filter; else it matches nothing
            with contextlib.suppress(VmSandboxError):
                sandbox_id = self.sandboxes.get(sandbox_id).id
        out = []
        for c in self.sandboxes.containers(sandbox_id or None):
            if f.id and not c.id.startswith(f.id):
                continue
            c = self._refreshed(c)
            if f.HasField("state") and translate.container_state(c.state) != f.state.state:
                continue
            if not _labels_match(c.labels, f.label_selector):
                continue
            out.append(translate.container(c))
        return pb.ListContainersResponse(containers=out)

    @rpc
    def ContainerStatus(
        self, request: pb.ContainerStatusRequest, context: grpc.ServicerContext
    ) -> pb.ContainerStatusResponse:
        c = self.containers.refresh(self.sandboxes.container(request.container_id).id)
        return pb.ContainerStatusResponse(
            status=translate.container_status(c),
            info=translate.container_info(c) if request.verbose else {},
        )

    @rpc
    def UpdateContainerResources(
        self, request: pb.UpdateContainerResourcesRequest, context: grpc.ServicerContext
    ) -> pb.UpdateContainerResourcesResponse:
        c = self.sandboxes.container(request.container_id)
        where = f'container "{c.name}"'
        resources = (
            translate.kubernetes_resources(request.kubernetes_resources, where)
            if request.HasField("kubernetes_resources")
            else None
        )
        linux = self.nri.update_container(c.id, translate.linux_resources(request.linux, f"{where}: linux"))
        self.sandboxes.update_container(request.container_id, resources, linux)
        self.containers.update(request.container_id, self.sandboxes.container(request.container_id).linux)
        self.nri.container_updated(c.id)
        return pb.UpdateContainerResourcesResponse()

    @rpc
    def ListContainerStats(
        self, request: pb.ListContainerStatsRequest, context: grpc.ServicerContext
    ) -> pb.ListContainerStatsResponse:
        f = request.filter
        out = []
        for c in self.sandboxes.containers(f.pod_sandbox_id or None):
            if c.state != CONTAINER_RUNNING or (f.id and not c.id.startswith(f.id)):
                continue
            if _labels_match(c.labels, f.label_selector):
                out.append(self._container_stats(c))
        return pb.ListContainerStatsResponse(stats=out)

    @rpc
    def ContainerStats(
        self, request: pb.ContainerStatsRequest, context: grpc.ServicerContext
    ) -> pb.ContainerStatsResponse:
        return pb.ContainerStatsResponse(stats=self._container_stats(self.sandboxes.container(request.container_id)))

    @rpc
    def PodSandboxStats(
        self, request: pb.PodSandboxStatsRequest, context: grpc.ServicerContext
    ) -> pb.PodSandboxStatsResponse:
        return pb.PodSandboxStatsResponse(stats=self._sandbox_stats(self.sandboxes.get(request.pod_sandbox_id)))

    @rpc
    def ExecSync(self, request: pb.ExecSyncRequest, context: grpc.ServicerContext) -> pb.ExecSyncResponse:
        if request.timeout < 0:
            raise InvalidArgument(f"ExecSync timeout is negative ({request.timeout})")
        res = self.containers.exec_sync(
            self.sandboxes.container(request.container_id).id,
            list(request.cmd),
            int(request.timeout),
            _EXEC_OUTPUT_LIMIT,
        )
        if res.timed_out:
            raise DeadlineExceeded(f"command timed out after {request.timeout} s")
        return pb.ExecSyncResponse(stdout=res.stdout, stderr=res.stderr, exit_code=res.exit_code)

    @rpc
    def ReopenContainerLog(
        self, request: pb.ReopenContainerLogRequest, context: grpc.ServicerContext
    ) -> pb.ReopenContainerLogResponse:
        self.containers.reopen_log(self.sandboxes.container(request.container_id).id)
        return pb.ReopenContainerLogResponse()

    @rpc
    def ListPodSandboxStats(
        self, request: pb.ListPodSandboxStatsRequest, context: grpc.ServicerContext
    ) -> pb.ListPodSandboxStatsResponse:
        f = request.filter
        out = []
        for r in self.sandboxes.list_sandboxes():
            if (f.id and not r.id.startswith(f.id)) or not _labels_match(r.labels, f.label_selector):
                continue
            out.append(self._sandbox_stats(r))
        return pb.ListPodSandboxStatsResponse(stats=out)

    def _refreshed(self, c: ContainerRecord) -> ContainerRecord:
        if c.state == CONTAINER_EXITED:
            return c
        try:
            return self.containers.refresh(c.id)
        except VmSandboxError as e:
            log.warning("container %s: status from its guest failed: %s", c.id[:12], e)
            return c

    @rpc
    def UpdateRuntimeConfig(
        self, request: pb.UpdateRuntimeConfigRequest, context: grpc.ServicerContext
    ) -> pb.UpdateRuntimeConfigResponse:
        log.info(
            "runtime config update: pod CIDR %r (guests have no network yet)",
            request.runtime_config.network_config.pod_cidr,
        )
        return pb.UpdateRuntimeConfigResponse()

    @rpc
    def RuntimeConfig(
        self, request: pb.RuntimeConfigRequest, context: grpc.ServicerContext
    ) -> pb.RuntimeConfigResponse:
        return pb.RuntimeConfigResponse(linux=pb.LinuxRuntimeConfiguration(cgroup_driver=pb.CGROUPFS))

    def _streaming(self) -> StreamingServer:
        if self.streaming is None:
            raise InfrastructureError("the streaming server is not running in this shim")
        return self.streaming

    @rpc
    def Exec(self, request: pb.ExecRequest, context: grpc.ServicerContext) -> pb.ExecResponse:
        c = self.sandboxes.container(request.container_id)  # the record: the guest checks again at the start
        req = streaming.check_stream_request(
            "Exec", c.id, list(request.cmd), tty=request.tty, stdin=request.stdin, stdout=request.stdout,
            stderr=request.stderr,
        )  # fmt: skip
        if c.state != CONTAINER_RUNNING:
            raise WrongState(f"container {c.id[:12]} is not running: nothing to exec into")
        return pb.ExecResponse(url=self._streaming().url(Target("exec", c.sandbox_id, req)))

    @rpc
    def PortForward(self, request: pb.PortForwardRequest, context: grpc.ServicerContext) -> pb.PortForwardResponse:
        r = self.sandboxes.get(request.pod_sandbox_id)
        if r.state != SANDBOX_READY:
            raise WrongState(f"sandbox {r.id[:12]} is not ready: nothing to forward to")
        ports = tuple(streaming.parse_port(str(p)) for p in request.port)
        return pb.PortForwardResponse(url=self._streaming().url(Target("portforward", r.id, ports=ports)))

    @rpc
    def Attach(self, request: pb.AttachRequest, context: grpc.ServicerContext) -> pb.AttachResponse:
        c = self.sandboxes.container(request.container_id)  # the record: the guest checks again at the start
        req = streaming.check_stream_request(
            "Attach", c.id, [], tty=request.tty, stdin=request.stdin, stdout=request.stdout, stderr=request.stderr
        )
        if request.tty and not c.tty:
            raise InvalidArgument(
                f"Attach: container {c.id[:12]} was created without a terminal (tty false): attach without tty"
            )
        if c.state != CONTAINER_RUNNING:
            raise WrongState(f"container {c.id[:12]} is not running: nothing to attach to")
        return pb.AttachResponse(url=self._streaming().url(Target("attach", c.sandbox_id, req)))

    # RPCs this build does not serve: UNIMPLEMENTED with the reason
    CheckpointContainer = _not_built("CheckpointContainer", "checkpointing is not supported")
    CheckpointPod = _not_built("CheckpointPod", "checkpointing is not supported")
    RestorePod = _not_built("RestorePod", "checkpointing is not supported")
    GetContainerEvents = _not_built("GetContainerEvents", "container events are not streamed yet")
    ListMetricDescriptors = _not_built("ListMetricDescriptors", "metrics are not exported over CRI yet")
    ListPodSandboxMetrics = _not_built("ListPodSandboxMetrics", "metrics are not exported over CRI yet")
    StreamPodSandboxes = _not_built("StreamPodSandboxes", "streaming list RPCs are not served yet")
    StreamContainers = _not_built("StreamContainers", "streaming list RPCs are not served yet")
    StreamContainerStats = _not_built("StreamContainerStats", "streaming list RPCs are not served yet")
    StreamPodSandboxStats = _not_built("StreamPodSandboxStats", "streaming list RPCs are not served yet")
    StreamPodSandboxMetrics = _not_built("StreamPodSandboxMetrics", "streaming list RPCs are not served yet")
