"""``runtime.v1.RuntimeService``: a thin servicer over ``Pods`` (ImageService: ``shim.image_service``).

Each method translates the request (``shim.translate``), makes one call — into ``shim.pods.Pods``,
the owner of pods and their containers, or, for an RPC that changes state, into its steps
(``shim.rpc``) — and translates the answer. RPCs this build does not serve answer UNIMPLEMENTED
with a sentence saying so.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

import grpc

from gen.cri.runtime.v1 import api_pb2 as pb
from gen.cri.runtime.v1 import api_pb2_grpc as pb_grpc
from shim.pods import Pods
from shim.rpc.create_container import create_container
from shim.rpc.remove_container import remove_container
from shim.rpc.remove_pod_sandbox import remove_pod_sandbox
from shim.rpc.run_pod_sandbox import run_pod_sandbox
from shim.rpc.start_container import start_container
from shim.rpc.stop_container import stop_container
from shim.rpc.stop_pod_sandbox import stop_pod_sandbox
from shim.rpc.update_container_resources import update_container_resources
from shim.rpc.update_pod_sandbox_resources import update_pod_sandbox_resources
from shim.status import rpc
from shim.streaming.server import StreamingServer, Target
from shim.translate import inbound, outbound, stats
from vmsandbox import __version__
from vmsandbox.errors import InfrastructureError

log = logging.getLogger(__name__)

RUNTIME_NAME = "vmsandbox"
API_VERSION = "v1"


def _not_built(name: str, why: str) -> Callable[..., Any]:
    def handler(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{name} is not implemented by vmsandbox {__version__}: {why}")

    handler.__name__ = name
    return handler


class RuntimeServicer(pb_grpc.RuntimeServiceServicer):
    def __init__(self, pods: Pods, streaming: StreamingServer | None = None) -> None:
        self.pods = pods
        self.streaming = streaming

    def _layer_mountpoint(self) -> str:
        return self.pods.sandboxes.config.state_dir

    @rpc
    def Version(self, request: pb.VersionRequest, context: grpc.ServicerContext) -> pb.VersionResponse:
        return pb.VersionResponse(
            version="0.1.0", runtime_name=RUNTIME_NAME, runtime_version=__version__, runtime_api_version=API_VERSION
        )

    @rpc
    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusResponse:
        conditions, hypervisor_version = self.pods.conditions()
        info = {}
        if request.verbose:
            info["info"] = json.dumps(self.pods.describe(hypervisor_version), sort_keys=True)
        return pb.StatusResponse(
            status=pb.RuntimeStatus(conditions=[outbound.runtime_condition(c) for c in conditions]),
            info=info,
            # recursive read-only mounts: enforced by the host's bind (vmsandbox/adapters/binds.py); user
            # namespaces (hostUsers: false): the guest's crun makes the pod's, its root idmapped (docs/containers.md)
            runtime_handlers=[
                pb.RuntimeHandler(
                    name=h, features=pb.RuntimeHandlerFeatures(recursive_read_only_mounts=True, user_namespaces=True)
                )
                for h in self.pods.handlers()
            ],
        )

    @rpc
    def RunPodSandbox(
        self, request: pb.RunPodSandboxRequest, context: grpc.ServicerContext
    ) -> pb.RunPodSandboxResponse:
        sandbox_id = run_pod_sandbox(self.pods, inbound.run_pod_sandbox(request))
        return pb.RunPodSandboxResponse(pod_sandbox_id=sandbox_id)

    @rpc
    def StopPodSandbox(
        self, request: pb.StopPodSandboxRequest, context: grpc.ServicerContext
    ) -> pb.StopPodSandboxResponse:
        stop_pod_sandbox(self.pods, inbound.stop_pod_sandbox(request))
        return pb.StopPodSandboxResponse()

    @rpc
    def RemovePodSandbox(
        self, request: pb.RemovePodSandboxRequest, context: grpc.ServicerContext
    ) -> pb.RemovePodSandboxResponse:
        remove_pod_sandbox(self.pods, inbound.remove_pod_sandbox(request))
        return pb.RemovePodSandboxResponse()

    @rpc
    def PodSandboxStatus(
        self, request: pb.PodSandboxStatusRequest, context: grpc.ServicerContext
    ) -> pb.PodSandboxStatusResponse:
        record = self.pods.sandbox(request.pod_sandbox_id)
        return pb.PodSandboxStatusResponse(
            status=outbound.pod_sandbox_status(record),
            info=outbound.sandbox_info(record) if request.verbose else {},
            timestamp=time.time_ns(),
        )

    @rpc
    def ListPodSandbox(
        self, request: pb.ListPodSandboxRequest, context: grpc.ServicerContext
    ) -> pb.ListPodSandboxResponse:
        records = self.pods.list_sandboxes(inbound.sandbox_filter(request.filter))
        return pb.ListPodSandboxResponse(items=[outbound.pod_sandbox(r) for r in records])

    @rpc
    def UpdatePodSandboxResources(
        self, request: pb.UpdatePodSandboxResourcesRequest, context: grpc.ServicerContext
    ) -> pb.UpdatePodSandboxResourcesResponse:
        update_pod_sandbox_resources(self.pods, inbound.update_pod_sandbox_resources(request))
        return pb.UpdatePodSandboxResourcesResponse()

    @rpc
    def CreateContainer(
        self, request: pb.CreateContainerRequest, context: grpc.ServicerContext
    ) -> pb.CreateContainerResponse:
        return pb.CreateContainerResponse(container_id=create_container(self.pods, inbound.create_container(request)))

    @rpc
    def StartContainer(
        self, request: pb.StartContainerRequest, context: grpc.ServicerContext
    ) -> pb.StartContainerResponse:
        start_container(self.pods, inbound.start_container(request))
        return pb.StartContainerResponse()

    @rpc
    def StopContainer(
        self, request: pb.StopContainerRequest, context: grpc.ServicerContext
    ) -> pb.StopContainerResponse:
        stop_container(self.pods, inbound.stop_container(request))
        return pb.StopContainerResponse()

    @rpc
    def RemoveContainer(
        self, request: pb.RemoveContainerRequest, context: grpc.ServicerContext
    ) -> pb.RemoveContainerResponse:
        remove_container(self.pods, inbound.remove_container(request))
        return pb.RemoveContainerResponse()

    @rpc
    def ListContainers(
        self, request: pb.ListContainersRequest, context: grpc.ServicerContext
    ) -> pb.ListContainersResponse:
        records = self.pods.list_containers(inbound.container_filter(request.filter))
        return pb.ListContainersResponse(containers=[outbound.container(c) for c in records])

    @rpc
    def ContainerStatus(
        self, request: pb.ContainerStatusRequest, context: grpc.ServicerContext
    ) -> pb.ContainerStatusResponse:
        c = self.pods.container(request.container_id)
        return pb.ContainerStatusResponse(
            status=outbound.container_status(c),
            info=outbound.container_info(c) if request.verbose else {},
        )

    @rpc
    def UpdateContainerResources(
        self, request: pb.UpdateContainerResourcesRequest, context: grpc.ServicerContext
    ) -> pb.UpdateContainerResourcesResponse:
        update_container_resources(self.pods, inbound.update_container_resources(request))
        return pb.UpdateContainerResourcesResponse()

    @rpc
    def ListContainerStats(
        self, request: pb.ListContainerStatsRequest, context: grpc.ServicerContext
    ) -> pb.ListContainerStatsResponse:
        found = self.pods.list_container_stats(inbound.container_filter(request.filter))
        return pb.ListContainerStatsResponse(stats=[stats.container_stats(s, self._layer_mountpoint()) for s in found])

    @rpc
    def ContainerStats(
        self, request: pb.ContainerStatsRequest, context: grpc.ServicerContext
    ) -> pb.ContainerStatsResponse:
        found = self.pods.container_stats(request.container_id)
        return pb.ContainerStatsResponse(stats=stats.container_stats(found, self._layer_mountpoint()))

    @rpc
    def PodSandboxStats(
        self, request: pb.PodSandboxStatsRequest, context: grpc.ServicerContext
    ) -> pb.PodSandboxStatsResponse:
        found = self.pods.sandbox_stats(request.pod_sandbox_id)
        return pb.PodSandboxStatsResponse(stats=stats.pod_sandbox_stats(found, self._layer_mountpoint()))

    @rpc
    def ListPodSandboxStats(
        self, request: pb.ListPodSandboxStatsRequest, context: grpc.ServicerContext
    ) -> pb.ListPodSandboxStatsResponse:
        found = self.pods.list_sandbox_stats(inbound.sandbox_filter(request.filter))
        return pb.ListPodSandboxStatsResponse(
            stats=[stats.pod_sandbox_stats(s, self._layer_mountpoint()) for s in found]
        )

    @rpc
    def ListMetricDescriptors(
        self, request: pb.ListMetricDescriptorsRequest, context: grpc.ServicerContext
    ) -> pb.ListMetricDescriptorsResponse:
        return pb.ListMetricDescriptorsResponse(descriptors=stats.metric_descriptors())

    @rpc
    def ListPodSandboxMetrics(
        self, request: pb.ListPodSandboxMetricsRequest, context: grpc.ServicerContext
    ) -> pb.ListPodSandboxMetricsResponse:
        metrics = self.pods.list_sandbox_metrics(time.time_ns)
        return pb.ListPodSandboxMetricsResponse(pod_metrics=[stats.pod_sandbox_metrics(m) for m in metrics])

    @rpc
    def ExecSync(self, request: pb.ExecSyncRequest, context: grpc.ServicerContext) -> pb.ExecSyncResponse:
        res = self.pods.exec_sync(request.container_id, request.cmd, int(request.timeout))
        return pb.ExecSyncResponse(stdout=res.stdout, stderr=res.stderr, exit_code=res.exit_code)

    @rpc
    def ReopenContainerLog(
        self, request: pb.ReopenContainerLogRequest, context: grpc.ServicerContext
    ) -> pb.ReopenContainerLogResponse:
        self.pods.reopen_log(request.container_id)
        return pb.ReopenContainerLogResponse()

    @rpc
    def UpdateRuntimeConfig(
        self, request: pb.UpdateRuntimeConfigRequest, context: grpc.ServicerContext
    ) -> pb.UpdateRuntimeConfigResponse:
        # each pod's network comes from CNI's own IPAM configuration, not from the node's pod CIDR
        log.info("runtime config update: pod CIDR %r", request.runtime_config.network_config.pod_cidr[:64])
        return pb.UpdateRuntimeConfigResponse()

    @rpc
    def RuntimeConfig(
        self, request: pb.RuntimeConfigRequest, context: grpc.ServicerContext
    ) -> pb.RuntimeConfigResponse:
        return pb.RuntimeConfigResponse(linux=pb.LinuxRuntimeConfiguration(cgroup_driver=pb.CGROUPFS))

    def _url(self, target: Target) -> str:
        if self.streaming is None:
            raise InfrastructureError("the streaming server is not running in this shim")
        return self.streaming.url(target)

    @rpc
    def Exec(self, request: pb.ExecRequest, context: grpc.ServicerContext) -> pb.ExecResponse:
        target = self.pods.exec_target(
            request.container_id, request.cmd, tty=request.tty, stdin=request.stdin, stdout=request.stdout,
            stderr=request.stderr,
        )  # fmt: skip
        return pb.ExecResponse(url=self._url(target))

    @rpc
    def PortForward(self, request: pb.PortForwardRequest, context: grpc.ServicerContext) -> pb.PortForwardResponse:
        target = self.pods.port_forward_target(request.pod_sandbox_id, [str(p) for p in request.port])
        return pb.PortForwardResponse(url=self._url(target))

    @rpc
    def Attach(self, request: pb.AttachRequest, context: grpc.ServicerContext) -> pb.AttachResponse:
        target = self.pods.attach_target(
            request.container_id, tty=request.tty, stdin=request.stdin, stdout=request.stdout, stderr=request.stderr
        )
        return pb.AttachResponse(url=self._url(target))

    # RPCs this build does not serve: UNIMPLEMENTED with the reason
    CheckpointContainer = _not_built("CheckpointContainer", "checkpointing is not supported")
    CheckpointPod = _not_built("CheckpointPod", "checkpointing is not supported")
    RestorePod = _not_built("RestorePod", "checkpointing is not supported")
    GetContainerEvents = _not_built("GetContainerEvents", "container events are not streamed yet")
    StreamPodSandboxes = _not_built("StreamPodSandboxes", "streaming list RPCs are not served yet")
    StreamContainers = _not_built("StreamContainers", "streaming list RPCs are not served yet")
    StreamContainerStats = _not_built("StreamContainerStats", "streaming list RPCs are not served yet")
    StreamPodSandboxStats = _not_built("StreamPodSandboxStats", "streaming list RPCs are not served yet")
    StreamPodSandboxMetrics = _not_built("StreamPodSandboxMetrics", "streaming list RPCs are not served yet")
