"""containerd's Sandbox service (``containerd.runtime.sandbox.v1.Sandbox``) for one runtime
handler: a VM pod per sandbox, made by the same RunPodSandbox as on the CRI socket.

containerd's CRI plugin, as the sandbox controller's client, sends ``CreateSandbox`` with the
kubelet's whole ``PodSandboxConfig`` (``options``, KEP-4112's ``pod_resources`` included when the
kubelet sends them) and the network namespace it made and ran CNI in; the pod is sized, admitted,
placed and booted there (``shim.rpc.run_pod_sandbox`` with containerd's id and namespace).
``StartSandbox`` then only answers what was made: QEMU's pid and the creation time. ``StopSandbox``
and ``ShutdownSandbox`` are StopPodSandbox and RemovePodSandbox; ``WaitSandbox`` returns once the
pod is no longer ready (stopped, or its guest died). Each handler answers only for its own pods.
"""

from __future__ import annotations

import logging
import os
import time

from google.protobuf import any_pb2
from google.protobuf.message import DecodeError

from gen.containerd.runtime.sandbox.v1 import sandbox_pb2 as sb
from gen.containerd.types import metrics_pb2, platform_pb2
from gen.cri.runtime.v1 import api_pb2 as cri
from shim.containerd.lookup import handler_sandbox, qemu_pid
from shim.containerd.tasks import Tasks
from shim.containerd.wire import Handler, cgroup_metrics, handler, timestamp
from shim.model import SANDBOX_NOTREADY, SANDBOX_READY, RemovePodSandbox, RunPodSandbox, SandboxRecord, StopPodSandbox
from shim.pods import Pods
from shim.rpc.remove_pod_sandbox import remove_pod_sandbox
from shim.rpc.run_pod_sandbox import run_pod_sandbox
from shim.rpc.stop_pod_sandbox import stop_pod_sandbox
from shim.translate import inbound, outbound
from vmsandbox import validation
from vmsandbox.errors import InvalidArgument, NotFound, Unsupported

log = logging.getLogger(__name__)

SERVICE = "containerd.runtime.sandbox.v1.Sandbox"
POD_SANDBOX_CONFIG = "runtime.v1.PodSandboxConfig"
WAIT_POLL_S = 0.5


def pod_sandbox_config(options: any_pb2.Any) -> cri.PodSandboxConfig:
    """The kubelet's config of the pod, as containerd's CRI plugin passes it."""
    if not options.type_url.endswith(POD_SANDBOX_CONFIG):
        raise InvalidArgument(
            f"CreateSandboxRequest.options is {validation.quote(options.type_url[:128])}, not a {POD_SANDBOX_CONFIG}: "
            "a VM pod is made from the kubelet's pod config, which containerd's CRI plugin passes"
        )
    config = cri.PodSandboxConfig()
    try:
        config.ParseFromString(options.value)
    except DecodeError as exc:
        raise InvalidArgument(f"CreateSandboxRequest.options: not a PodSandboxConfig: {exc}") from None
    return config


class SandboxService:
    def __init__(self, pods: Pods, runtime_handler: str, tasks: Tasks) -> None:
        self.pods = pods
        self.runtime_handler = runtime_handler
        self.tasks = tasks

    def handlers(self) -> dict[str, Handler]:
        return {
            "CreateSandbox": handler(sb.CreateSandboxRequest, self.create),
            "StartSandbox": handler(sb.StartSandboxRequest, self.start),
            "Platform": handler(sb.PlatformRequest, self.platform),
            "StopSandbox": handler(sb.StopSandboxRequest, self.stop),
            "WaitSandbox": handler(sb.WaitSandboxRequest, self.wait),
            "SandboxStatus": handler(sb.SandboxStatusRequest, self.status),
            "PingSandbox": handler(sb.PingRequest, self.ping),
            "ShutdownSandbox": handler(sb.ShutdownSandboxRequest, self.shutdown),
            "SandboxMetrics": handler(sb.SandboxMetricsRequest, self.metrics),
            "UpdateSandbox": handler(sb.UpdateSandboxRequest, self.update),
        }

    def _mine(self, sandbox_id: str) -> SandboxRecord:
        """The sandbox of this handler that ``sandbox_id`` names (NOT_FOUND otherwise)."""
        if not validation.is_full_id(sandbox_id):
            raise InvalidArgument(f"sandbox_id {validation.quote(sandbox_id[:80])} is not 64 hex digits")
        record = handler_sandbox(self.pods, self.runtime_handler, sandbox_id)
        if record is None:
            raise NotFound(f"sandbox {sandbox_id} does not exist (runtime handler {self.runtime_handler})")
        return record

    # -- RPCs --------------------------------------------------------------------------------------
    def create(self, req: sb.CreateSandboxRequest) -> sb.CreateSandboxResponse:
        if not validation.is_full_id(req.sandbox_id):
            raise InvalidArgument(f"sandbox_id {validation.quote(req.sandbox_id[:80])} is not 64 hex digits")
        if req.rootfs:
            raise Unsupported("CreateSandboxRequest.rootfs: a VM pod has no sandbox container, so no root file system")
        config = pod_sandbox_config(req.options)
        spec = inbound.sandbox_spec(config, self.runtime_handler)
        if req.netns_path:
            validation.absolute_path(req.netns_path, "CreateSandboxRequest.netns_path")
        elif not spec.namespaces.host_network:
            raise InvalidArgument(
                "CreateSandboxRequest.netns_path is empty for a pod that is not host-network: containerd's CRI "
                "plugin makes the pod's network namespace for a shim sandboxer"
            )
        self.tasks.add_sandbox(req.sandbox_id)
        try:
            run_pod_sandbox(self.pods, RunPodSandbox(spec, req.sandbox_id, given_netns=req.netns_path or None))
        except BaseException:
            self.tasks.forget_sandbox(req.sandbox_id)
            raise
        return sb.CreateSandboxResponse()

    def start(self, req: sb.StartSandboxRequest) -> sb.StartSandboxResponse:
        record = self._mine(req.sandbox_id)
        if record.state != SANDBOX_READY:
            raise NotFound(f"sandbox {req.sandbox_id} is not running (it was stopped)")
        return sb.StartSandboxResponse(pid=qemu_pid(self.pods, record), created_at=timestamp(record.created_ns))

    def platform(self, req: sb.PlatformRequest) -> sb.PlatformResponse:
        self._mine(req.sandbox_id)
        return sb.PlatformResponse(platform=platform_pb2.Platform(os="linux", architecture="amd64"))

    def stop(self, req: sb.StopSandboxRequest) -> sb.StopSandboxResponse:
        try:
            self._mine(req.sandbox_id)
        except NotFound:
            return sb.StopSandboxResponse()  # stopping what is not there succeeds, as for the CRI
        stop_pod_sandbox(self.pods, StopPodSandbox(req.sandbox_id))
        return sb.StopSandboxResponse()

    def wait(self, req: sb.WaitSandboxRequest) -> sb.WaitSandboxResponse:
        """Returns once the pod is not ready (stopped, or its guest died: exit status 0) or gone
        (255), checking every ``WAIT_POLL_S``."""
        self._mine(req.sandbox_id)
        while True:
            record = self.pods.records.find(req.sandbox_id)
            if record is None or record.id != req.sandbox_id:
                return sb.WaitSandboxResponse(exit_status=255, exited_at=timestamp(time.time_ns()))
            if record.state != SANDBOX_READY:
                return sb.WaitSandboxResponse(exit_status=0, exited_at=timestamp(time.time_ns()))
            time.sleep(WAIT_POLL_S)

    def status(self, req: sb.SandboxStatusRequest) -> sb.SandboxStatusResponse:
        record = self._mine(req.sandbox_id)
        ready = record.state == SANDBOX_READY
        reply = sb.SandboxStatusResponse(
            sandbox_id=record.id,
            pid=qemu_pid(self.pods, record) if ready else 0,
            state=SANDBOX_READY if ready else SANDBOX_NOTREADY,  # the CRI's names, which containerd's plugin takes
            created_at=timestamp(record.created_ns),
        )
        if req.verbose:
            reply.info.update(outbound.sandbox_info(record))
        return reply

    def ping(self, req: sb.PingRequest) -> sb.PingResponse:
        self._mine(req.sandbox_id)
        return sb.PingResponse()

    def shutdown(self, req: sb.ShutdownSandboxRequest) -> sb.ShutdownSandboxResponse:
        try:
            self._mine(req.sandbox_id)
        except NotFound:
            return sb.ShutdownSandboxResponse()
        remove_pod_sandbox(self.pods, RemovePodSandbox(req.sandbox_id))
        self.tasks.forget_sandbox(req.sandbox_id)
        log.info("sandbox %s shut down for containerd (pid %d)", req.sandbox_id[:12], os.getpid())
        return sb.ShutdownSandboxResponse()

    def metrics(self, req: sb.SandboxMetricsRequest) -> sb.SandboxMetricsResponse:
        """The pod's usage as PodSandboxStats reports it (its VM on the host, else its guest)."""
        record = self._mine(req.sandbox_id)
        sample = self.pods.sandbox_stats(record.id).sample
        metric = metrics_pb2.Metric(timestamp=timestamp(time.time_ns()), id=record.id, data=cgroup_metrics(sample))
        return sb.SandboxMetricsResponse(metrics=metric)

    def update(self, req: sb.UpdateSandboxRequest) -> sb.UpdateSandboxResponse:
        self._mine(req.sandbox_id)
        raise Unsupported(
            "UpdateSandbox is not implemented by vmsandbox's shim mode: a VM pod's resources are resized "
            "through its containers (UpdateContainerResources), within its resize headroom"
        )
