"""``ContainerdFront``: vmsandbox as containerd's runtime shim (shim mode), beside its CRI socket.

For each runtime handler (a profile's) it serves containerd's Sandbox and Task services on a ttrpc
socket of its own, ``<containerd_shim_dir>/<handler>.sock`` (0600, root's): the address
``containerd-shim-vmsandbox-v1 start`` answers containerd with for that handler
(``shim.containerd.launch``). Both services sit on the one core every RPC of the CRI socket uses
(``shim.rpc``), so a pod is sized, admitted, placed and booted the same way either way. Task
events go back to containerd's ttrpc socket (``shim.containerd.events``). The containers shim mode
made write their output to containerd's fifos (``Containers.stdio_sink``). At start, the pods
containerd made through an earlier vmsandbox process are removed (containerd lost them with that
process's connections), and the exits of the containers still running are watched again. Every
``containerd_image_prune_s`` the disks of images containerd removed are removed (``ContainerdImages.prune``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from shim.config import ShimConfig
from shim.containerd.events import EventPublisher
from shim.containerd.rootfs import ContainerdImages
from shim.containerd.sandbox_service import SERVICE as SANDBOX_SERVICE
from shim.containerd.sandbox_service import SandboxService
from shim.containerd.task_service import SERVICE as TASK_SERVICE
from shim.containerd.task_service import TaskService
from shim.containerd.tasks import Tasks
from shim.containerd.ttrpc_server import TtrpcServer
from shim.containerd.wire import handler_socket
from shim.log_copy import Sink
from shim.model import CONTAINER_EXITED, ContainerRecord, RemovePodSandbox, StopPodSandbox
from shim.periodic import Periodic
from shim.pods import Pods
from shim.rpc.remove_pod_sandbox import remove_pod_sandbox
from shim.rpc.stop_pod_sandbox import stop_pod_sandbox
from vmsandbox.errors import VmSandboxError

log = logging.getLogger(__name__)

CONTENT_STORE = "io.containerd.content.v1.content"


class ContainerdFront:
    def __init__(self, config: ShimConfig, pods: Pods) -> None:
        self.config = config
        self.pods = pods
        self.tasks = Tasks(config.state_dir)
        self.images = ContainerdImages(
            config.containerd_address, str(Path(config.containerd_root) / CONTENT_STORE), pods.containers.images
        )
        self.events = EventPublisher(config.containerd_address + ".ttrpc", config.containerd_namespace)
        self.services = {
            h: (SandboxService(pods, h, self.tasks), TaskService(pods, h, self.tasks, self.images, self.events))
            for h in pods.handlers()
        }
        self.servers: list[TtrpcServer] = []
        self.pruning = Periodic(config.containerd_image_prune_s, self.images.prune, name="containerd-image-prune")
        pods.containers.stdio_sink = self._sink

    def _sink(self, c: ContainerRecord) -> Sink | None:
        sandbox = self.pods.records.find(c.sandbox_id)
        if sandbox is None or sandbox.runtime_handler not in self.services:
            return None
        return self.services[sandbox.runtime_handler][1].sink(c)

    def start(self) -> None:
        """Listen for containerd on every handler's socket; watch again the containers it runs."""
        shim_dir = Path(self.config.containerd_shim_dir)
        shim_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(shim_dir, 0o700)
        for handler, (sandboxes, tasks) in self.services.items():
            server = TtrpcServer(
                handler_socket(str(shim_dir), handler),
                {SANDBOX_SERVICE: sandboxes.handlers(), TASK_SERVICE: tasks.handlers()},
                name=f"containerd-{handler}",
            )
            server.start()
            self.servers.append(server)
        self._remove_orphans()
        self.pruning.start()
        watched = 0
        for cid in self.tasks.known():
            c = self.pods.records.find_container(cid)
            if c is None or c.id != cid:
                self.tasks.forget(cid)
                continue
            sandbox = self.pods.records.find(c.sandbox_id)
            if sandbox is not None and sandbox.runtime_handler in self.services and c.state != CONTAINER_EXITED:
                self.services[sandbox.runtime_handler][1].watch(cid)
                watched += 1
        log.info(
            "shim mode: serving containerd (%s) for %s in %s; %d running containers watched again",
            self.config.containerd_address,
            ", ".join(self.services),
            shim_dir,
            watched,
        )

    def _remove_orphans(self) -> None:
        """The pods containerd made through an earlier vmsandbox process are removed: containerd
        lost that process's connections, took their containers for exited and the pods for not
        ready, and never asks this process about them again (it does not load a shim it lost)."""
        for sid in self.tasks.known_sandboxes():
            record = self.pods.records.find(sid)
            if record is not None and record.id == sid:
                try:
                    stop_pod_sandbox(self.pods, StopPodSandbox(sid))
                    remove_pod_sandbox(self.pods, RemovePodSandbox(sid))
                except VmSandboxError as exc:
                    log.error("shim mode: the pod %s containerd lost was not removed yet: %s", sid[:12], exc)
                    continue
                log.warning("shim mode: removed pod %s, which containerd lost with the vmsandbox that ran it", sid[:12])
            self.tasks.forget_sandbox(sid)

    def close(self) -> None:
        self.pruning.stop()
        for server in self.servers:
            server.close()
        self.events.close()
        self.images.close()
