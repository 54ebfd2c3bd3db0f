"""``runtime.v1.RuntimeService``: a thin servicer over ``Sandboxes`` (ImageService: ``shim.image_service``).

Each method translates the request (``shim.translate``), calls the orchestrator, translates the
answer. RPCs this build does not serve answer UNIMPLEMENTED with a sentence saying so.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import grpc

from shim import translate
from shim.cri.runtime.v1 import api_pb2 as pb
from shim.cri.runtime.v1 import api_pb2_grpc as pb_grpc
from shim.model import SandboxRecord
from shim.sandboxes import Sandboxes
from shim.status import rpc
from vmsandbox import __version__
from vmsandbox.errors import InvalidArgument, VmSandboxError

log = logging.getLogger(__name__)

RUNTIME_NAME = "vmsandbox"
API_VERSION = "v1"


def _labels_match(labels: dict[str, str], selector: Any) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _not_built(name: str, why: str) -> Callable[..., Any]:
    def handler(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{name} is not implemented by vmsandbox {__version__}: {why}")

    handler.__name__ = name
    return handler


class RuntimeServicer(pb_grpc.RuntimeServiceServicer):
    def __init__(self, sandboxes: Sandboxes) -> None:
        self.sandboxes = sandboxes

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
        network = pb.RuntimeCondition(type="NetworkReady", status=True)
        info = {}
        if request.verbose:
            import json

            info["info"] = json.dumps(
                {
                    "libvirt_uri": self.sandboxes.hypervisor.uri,
                    "libvirt_version": libvirt_version,
                    "owned_cpus": sorted(self.sandboxes.policy.owned_cpus),
                    "handlers": sorted(self.sandboxes.profiles),
                },
                sort_keys=True,
            )
        return pb.StatusResponse(
            status=pb.RuntimeStatus(conditions=[runtime, network]),
            info=info,
            runtime_handlers=[pb.RuntimeHandler(name=h) for h in sorted(self.sandboxes.profiles)],
        )

    @rpc
    def RunPodSandbox(
        self, request: pb.RunPodSandboxRequest, context: grpc.ServicerContext
    ) -> pb.RunPodSandboxResponse:
        if not request.HasField("config"):
            raise InvalidArgument("RunPodSandboxRequest.config is missing")
        spec = translate.sandbox_spec(request.config, request.runtime_handler)
        return pb.RunPodSandboxResponse(pod_sandbox_id=self.sandboxes.run(spec))

    @rpc
    def StopPodSandbox(
        self, request: pb.StopPodSandboxRequest, context: grpc.ServicerContext
    ) -> pb.StopPodSandboxResponse:
        self.sandboxes.stop(request.pod_sandbox_id)
        return pb.StopPodSandboxResponse()

    @rpc
    def RemovePodSandbox(
        self, request: pb.RemovePodSandboxRequest, context: grpc.ServicerContext
    ) -> pb.RemovePodSandboxResponse:
        self.sandboxes.remove(request.pod_sandbox_id)
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
        self.sandboxes.update_sandbox(request.pod_sandbox_id, translate.linux_resources(request.resources, "resources"))
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
        return pb.CreateContainerResponse(container_id=self.sandboxes.create_container(request.pod_sandbox_id, spec))

    @rpc
    def StartContainer(
        self, request: pb.StartContainerRequest, context: grpc.ServicerContext
    ) -> pb.StartContainerResponse:
        self.sandboxes.start_container(request.container_id)
        return pb.StartContainerResponse()

    @rpc
    def StopContainer(
        self, request: pb.StopContainerRequest, context: grpc.ServicerContext
    ) -> pb.StopContainerResponse:
        self.sandboxes.stop_container(request.container_id)
        return pb.StopContainerResponse()

    @rpc
    def RemoveContainer(
        self, request: pb.RemoveContainerRequest, context: grpc.ServicerContext
    ) -> pb.RemoveContainerResponse:
        self.sandboxes.remove_container(request.container_id)
        return pb.RemoveContainerResponse()

    @rpc
    def ListContainers(
        self, request: pb.ListContainersRequest, context: grpc.ServicerContext
    ) -> pb.ListContainersResponse:
        f = request.filter
        out = []
        for c in self.sandboxes.containers(f.pod_sandbox_id or None):
            if f.id and not c.id.startswith(f.id):
                continue
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
        c = self.sandboxes.container(request.container_id)
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
        linux = translate.linux_resources(request.linux, f"{where}: linux")
        self.sandboxes.update_container(request.container_id, resources, linux)
        return pb.UpdateContainerResourcesResponse()

    @rpc
    def ListContainerStats(
        self, request: pb.ListContainerStatsRequest, context: grpc.ServicerContext
    ) -> pb.ListContainerStatsResponse:
        return pb.ListContainerStatsResponse(stats=[])  # no container runs in a guest yet: nothing to measure

    @rpc
    def ListPodSandboxStats(
        self, request: pb.ListPodSandboxStatsRequest, context: grpc.ServicerContext
    ) -> pb.ListPodSandboxStatsResponse:
        return pb.ListPodSandboxStatsResponse(stats=[])

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

    # RPCs this build does not serve: UNIMPLEMENTED with the reason
    ExecSync = _not_built("ExecSync", "container processes do not run in the guest yet")
    Exec = _not_built("Exec", "container processes do not run in the guest yet")
    Attach = _not_built("Attach", "container processes do not run in the guest yet")
    PortForward = _not_built("PortForward", "guests have no pod network yet")
    ReopenContainerLog = _not_built("ReopenContainerLog", "containers write no logs yet")
    ContainerStats = _not_built("ContainerStats", "container processes do not run in the guest yet")
    PodSandboxStats = _not_built("PodSandboxStats", "per-pod statistics are not collected yet")
    CheckpointContainer = _not_built("CheckpointContainer", "checkpointing is not supported")
    GetContainerEvents = _not_built("GetContainerEvents", "container events are not streamed yet")
    ListMetricDescriptors = _not_built("ListMetricDescriptors", "metrics are not exported over CRI yet")
    ListPodSandboxMetrics = _not_built("ListPodSandboxMetrics", "metrics are not exported over CRI yet")
    StreamPodSandboxes = _not_built("StreamPodSandboxes", "streaming list RPCs are not served yet")
    StreamContainers = _not_built("StreamContainers", "streaming list RPCs are not served yet")
    StreamContainerStats = _not_built("StreamContainerStats", "streaming list RPCs are not served yet")
    StreamPodSandboxStats = _not_built("StreamPodSandboxStats", "streaming list RPCs are not served yet")
    StreamPodSandboxMetrics = _not_built("StreamPodSandboxMetrics", "streaming list RPCs are not served yet")
