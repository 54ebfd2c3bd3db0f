"""containerd's Task service (``containerd.task.v3.Task``) for one runtime handler: the containers
and exec processes of its VM pods.

A task is a container of a pod this handler runs (its id containerd's container id). ``Create``
reads the OCI spec containerd's CRI plugin wrote into the bundle back as the CRI config it was
made from (``shim.translate.containerd_spec``; the task's options, none or runc's with only the
task API's endpoint and the fifos' owner, are checked there too), takes the image's disk from
containerd's snapshot (``shim.containerd.rootfs``) and makes the container by the same
CreateContainer as on the CRI socket: the same checks, the same admission against the pod's
declaration and VM (a container that diverges is refused with the same message, which containerd
hands the kubelet as the container's CreateContainerError event). ``Start``/``Kill``/``Delete`` are StartContainer, the
guest's kill, and RemoveContainer; a waiter per started container reports its exit
(``Tasks.exited`` and containerd's ``/tasks/exit`` event, after ``/tasks/oom`` when the guest's
kernel killed it for memory). The container's output reaches
containerd's fifos through the log copy (``shim.containerd.stdio``), whole lines; a container
with a stdin or a terminal's from its own attach session instead, as it comes. ``Exec`` and ``Start`` of an
exec id run a process in the container (the agent's stream session), its stdio on its fifos.

Not served, each refused precisely: Pause, Resume, Checkpoint (a VM pod is not frozen or
checkpointed per container). A container with a stdin or a terminal keeps a session on its own
stdio in the guest for its output, ``CloseIO`` and ``ResizePty``, as an exec's session serves them.
``Stats`` is the guest's sample of the container's cgroup, as ContainerStats reports it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from google.protobuf import any_pb2, empty_pb2

from gen.containerd.events import task_pb2 as events_pb
from gen.containerd.runtime.task.v3 import shim_pb2 as task
from gen.containerd.types.task import task_pb2 as task_types
from gen.cri.runtime.v1 import api_pb2 as cri
from shim.containerd.events import EventPublisher
from shim.containerd.lookup import handler_sandbox, qemu_pid
from shim.containerd.rootfs import ContainerdImages
from shim.containerd.stdio import FifoSink, StdinFeed, pump_attached, pump_exec
from shim.containerd.tasks import ExecProcess, TaskIO, Tasks, check_io
from shim.containerd.wire import Handler, cgroup_metrics, handler, timestamp
from shim.containers import OOM_KILLED
from shim.model import (
    CONTAINER_CREATED,
    CONTAINER_EXITED,
    CONTAINER_RUNNING,
    ContainerRecord,
    RemoveContainer,
    StartContainer,
    UpdateContainerResources,
)
from shim.pods import Pods
from shim.rpc.create_container import create_container
from shim.rpc.remove_container import remove_container
from shim.rpc.start_container import start_container
from shim.rpc.update_container_resources import update_container_resources
from shim.translate import containerd_spec, inbound
from vmsandbox import validation
from vmsandbox.adapters.agent_streams import AgentStream
from vmsandbox.containerd_image_volume import image_volume_at
from vmsandbox.containerd_rootfs import RootfsMount
from vmsandbox.errors import InvalidArgument, NotFound, Unsupported, VmSandboxError, WrongState

log = logging.getLogger(__name__)

SERVICE = "containerd.task.v3.Task"
WAIT_SLICE_S = 30
OCI_PROCESS = "opencontainers/runtime-spec/1/Process"
OCI_RESOURCES = "opencontainers/runtime-spec/1/LinuxResources"

_STATUS = {
    CONTAINER_CREATED: task_types.CREATED,
    CONTAINER_RUNNING: task_types.RUNNING,
    CONTAINER_EXITED: task_types.STOPPED,
}


def read_spec(bundle: str) -> dict[str, Any]:
    """The bundle's config.json (containerd's; at most ``MAX_SPEC_BYTES``, never through a symlink)."""
    validation.absolute_path(bundle, "CreateTaskRequest.bundle")
    if not bundle:
        raise InvalidArgument("CreateTaskRequest.bundle is empty: containerd names the task's bundle directory")
    try:
        fd = os.open(Path(bundle) / "config.json", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        shown = validation.quote(bundle[:256])
        raise InvalidArgument(f"the task's bundle {shown}: config.json cannot be read: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        data = f.read(containerd_spec.MAX_SPEC_BYTES + 1)
    if len(data) > containerd_spec.MAX_SPEC_BYTES:
        raise InvalidArgument(f"the task's config.json is larger than {containerd_spec.MAX_SPEC_BYTES} bytes")
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise InvalidArgument(f"the task's config.json is not JSON: {str(exc)[:200]}") from None
    if not isinstance(doc, dict):
        raise InvalidArgument("the task's config.json is not an object")
    return doc


def oci_document(value: any_pb2.Any, kind: str, where: str) -> dict[str, Any]:
    """The OCI runtime-spec JSON object an ``Any`` of containerd's carries (``kind``: the end of its
    type URL, e.g. ``opencontainers/runtime-spec/1/Process``); INVALID_ARGUMENT otherwise."""
    if not value.type_url.endswith(kind):
        raise InvalidArgument(f"{where} is {validation.quote(value.type_url[:128])}, not {kind.rsplit('/', 1)[-1]}")
    try:
        doc = json.loads(value.value)
    except ValueError as exc:
        raise InvalidArgument(f"{where} is not JSON: {str(exc)[:200]}") from None
    if not isinstance(doc, dict):
        raise InvalidArgument(f"{where} is not an object")
    return doc


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name.removeprefix("SIG")
    except ValueError:
        raise InvalidArgument(f"signal {number} is not a Linux signal") from None


class TaskService:
    def __init__(
        self,
        pods: Pods,
        runtime_handler: str,
        tasks: Tasks,
        images: ContainerdImages,
        events: EventPublisher,
    ) -> None:
        self.pods = pods
        self.runtime_handler = runtime_handler
        self.tasks = tasks
        self.images = images
        self.events = events

    def handlers(self) -> dict[str, Handler]:
        return {
            "State": handler(task.StateRequest, self.state),
            "Create": handler(task.CreateTaskRequest, self.create),
            "Start": handler(task.StartRequest, self.start),
            "Delete": handler(task.DeleteRequest, self.delete),
            "Pids": handler(task.PidsRequest, self.pids),
            "Pause": handler(task.PauseRequest, self.refused("Pause", "a VM pod's containers are not frozen")),
            "Resume": handler(task.ResumeRequest, self.refused("Resume", "a VM pod's containers are not frozen")),
            "Checkpoint": handler(
                task.CheckpointTaskRequest, self.refused("Checkpoint", "containers of VM pods are not checkpointed")
            ),
            "Kill": handler(task.KillRequest, self.kill),
            "Exec": handler(task.ExecProcessRequest, self.exec),
            "ResizePty": handler(task.ResizePtyRequest, self.resize_pty),
            "CloseIO": handler(task.CloseIORequest, self.close_io),
            "Update": handler(task.UpdateTaskRequest, self.update),
            "Wait": handler(task.WaitRequest, self.wait),
            "Stats": handler(task.StatsRequest, self.stats),
            "Connect": handler(task.ConnectRequest, self.connect),
            "Shutdown": handler(task.ShutdownRequest, self.shutdown),
        }

    @staticmethod
    def refused(name: str, why: str) -> Any:
        def method(_: object) -> empty_pb2.Empty:
            raise Unsupported(f"Task.{name} is not implemented by vmsandbox's shim mode: {why}")

        return method

    # -- lookups -----------------------------------------------------------------------------------
    def _container(self, cid: str) -> ContainerRecord:
        """The container of this handler's pods that ``cid`` names exactly (NOT_FOUND otherwise)."""
        if not validation.is_full_id(cid):
            raise NotFound(f"task {validation.quote(cid[:80])} does not exist (not a container id)")
        c = self.pods.records.find_container(cid)
        if c is None or c.id != cid:
            raise NotFound(f"task {cid} does not exist")
        if handler_sandbox(self.pods, self.runtime_handler, c.sandbox_id) is None:
            raise NotFound(f"task {cid} does not exist (runtime handler {self.runtime_handler})")
        return c

    def _pid(self, c: ContainerRecord) -> int:
        sandbox = self.pods.records.find(c.sandbox_id)
        return qemu_pid(self.pods, sandbox) if sandbox is not None else 0

    # -- containers --------------------------------------------------------------------------------
    def create(self, req: task.CreateTaskRequest) -> task.CreateTaskResponse:
        try:
            return self._create(req)
        except Unsupported as exc:
            # containerd reads UNIMPLEMENTED from Create as "this shim does not serve task v3" and
            # retries with v2: a request refused for what it asks is a failed precondition here
            raise WrongState(str(exc)) from None

    def _create(self, req: task.CreateTaskRequest) -> task.CreateTaskResponse:
        if req.checkpoint or req.parent_checkpoint:
            raise Unsupported("CreateTaskRequest.checkpoint: containers of VM pods are not restored from checkpoints")
        if not validation.is_full_id(req.id):
            raise InvalidArgument(f"task id {validation.quote(req.id[:80])} is not 64 hex digits")
        containerd_spec.task_options(req.options)
        io = check_io(TaskIO(req.stdin, req.stdout, req.stderr, req.terminal), "CreateTaskRequest")
        asked = containerd_spec.container_config(read_spec(req.bundle), stdin=bool(req.stdin))
        sandbox = handler_sandbox(self.pods, self.runtime_handler, asked.sandbox_id)
        if sandbox is None:
            raise NotFound(f"the task's sandbox {asked.sandbox_id} does not exist (handler {self.runtime_handler})")
        rootfs = [RootfsMount(m.type, m.source, tuple(m.options)) for m in req.rootfs]
        config = cri.ContainerConfig()
        config.CopyFrom(asked.config)
        config.image.image = self.images.adopt(asked.config.image.image, rootfs)
        self._image_volumes(config, asked.sandbox_id)
        made = inbound.create_container(cri.CreateContainerRequest(pod_sandbox_id=sandbox.id, config=config))
        run = replace(
            made.run,
            # containerd decides when the stdin ends (it closes the fifo, or CloseIO after the first
            # attach of a StdinOnce container); the guest closes the container's on that word
            stdin_once=made.run.stdin,
            # containerd gives the pod's sysctls to its sandbox container only (which a VM pod has
            # not): they are the pod's config's, as CreateSandbox had it, and the spec's own on top
            sysctls={**sandbox.sysctls, **asked.sysctls},
            rlimits=asked.rlimits,
            seccomp="localhost/containerd" if asked.seccomp is not None else "unconfined",
            seccomp_profile=asked.seccomp,
        )
        self.tasks.add(req.id, io)
        try:
            create_container(self.pods, replace(made, run=run, container_id=req.id))
        except BaseException:
            self.tasks.forget(req.id)
            raise
        c = self._container(req.id)
        io_ = events_pb.TaskIO(stdin=req.stdin, stdout=req.stdout, stderr=req.stderr, terminal=req.terminal)
        self.events.publish(
            "/tasks/create", events_pb.TaskCreate(container_id=req.id, bundle=req.bundle, io=io_, pid=self._pid(c))
        )
        return task.CreateTaskResponse(pid=self._pid(c))

    def _image_volumes(self, config: cri.ContainerConfig, sandbox_id: str) -> None:
        """The binds of image volumes containerd mounted on the host become the image volumes they
        were (the image's disk in the guest), each image adopted into vmsandbox's store."""
        for i, m in enumerate(config.mounts):
            at = image_volume_at(m.host_path, sandbox_id)
            image_id = self.images.adopt_volume(at) if at is not None else None
            if at is None or image_id is None:
                continue
            log.info(
                "image volume at %s: image %s%s",
                m.container_path[:256],
                image_id,
                f" ({at.sub_path[:256]})" if at.sub_path else "",
            )
            config.mounts[i].CopyFrom(
                cri.Mount(
                    container_path=m.container_path,
                    image=cri.ImageSpec(image=image_id),
                    image_sub_path=at.sub_path,
                    readonly=True,
                    propagation=cri.PROPAGATION_PRIVATE,
                )
            )

    def sink(self, c: ContainerRecord) -> FifoSink | None:
        """Where the log copy of ``c`` writes (``Containers.stdio_sink``): its fifos when shim mode
        made it, unless its own attach session feeds them (a stdin or a terminal: ``start``); then
        the copy only drains the guest's log."""
        io = self.tasks.io(c.id)
        if io is None or io.stdin or io.terminal:
            return None
        return FifoSink(io.stdout, io.stderr)

    def start(self, req: task.StartRequest) -> task.StartResponse:
        c = self._container(req.id)
        if req.exec_id:
            return self._start_exec(c, req.exec_id)
        start_container(self.pods, StartContainer(c.id))
        io = self.tasks.io(c.id)
        if io is not None and (io.stdin or io.terminal):
            # the container's own session: its output to the fifos as it comes (containerd's attach
            # reads them: an interactive shell's answer need not end with a newline), its stdin
            # (kubectl attach -i) and its terminal's size
            stream, stop = self.pods.containers.attach_start(c.id), threading.Event()
            pump_attached(stream, io.stdout, io.stderr, stop)
            self.tasks.attach(c.id, stream, StdinFeed(stream, io.stdin, stop) if io.stdin else None)
        self.watch(c.id)
        pid = self._pid(c)
        self.events.publish("/tasks/start", events_pb.TaskStart(container_id=c.id, pid=pid))
        return task.StartResponse(pid=pid)

    def watch(self, cid: str) -> None:
        """A thread that reports the container's exit: recorded, then containerd told."""
        threading.Thread(target=self._watch, args=(cid,), name=f"task-{cid[:12]}", daemon=True).start()

    def _watch(self, cid: str) -> None:
        while True:
            try:
                c = self.pods.records.find_container(cid)
                if c is None:
                    return
                if c.state != CONTAINER_EXITED:
                    try:
                        self.pods.containers.pool.call(c.sandbox_id, "wait", cid, timeout_s=WAIT_SLICE_S)
                    except VmSandboxError:
                        time.sleep(1.0)
                    c = self.pods.containers.refresh(self.pods.records.resolve_container(cid))
                if c.state == CONTAINER_EXITED:
                    self._report_exit(c)
                    return
            except NotFound:
                return
            except Exception:
                log.exception("task %s: watching its exit failed; trying again", cid[:12])
                time.sleep(1.0)

    def _report_exit(self, c: ContainerRecord) -> None:
        code = c.exit_code if c.exit_code is not None else 255
        at = c.finished_ns or time.time_ns()
        if self.tasks.exited(c.id, code, at):
            if c.reason == OOM_KILLED:  # containerd's CRI plugin takes the reason from this event
                self.events.publish("/tasks/oom", events_pb.TaskOOM(container_id=c.id))
            exit_ = events_pb.TaskExit(
                container_id=c.id, id=c.id, pid=self._pid(c), exit_status=code, exited_at=timestamp(at)
            )
            self.events.publish("/tasks/exit", exit_)

    def kill(self, req: task.KillRequest) -> empty_pb2.Empty:
        c = self._container(req.id)
        name = _signal_name(req.signal)
        if req.exec_id:
            p = self.tasks.exec(c.id, req.exec_id)
            if p.exit.done.is_set():
                raise NotFound(f"exec {req.exec_id} of task {c.id[:12]}: process already finished")
            if p.stream is not None:
                p.stream.release()  # the agent ends the session's process (HUP, then KILL)
            return empty_pb2.Empty()
        c = self.pods.containers.refresh(c)
        if c.state != CONTAINER_RUNNING:
            raise NotFound(f"task {c.id[:12]}: process already finished")
        try:
            self.pods.containers.pool.call(c.sandbox_id, "kill", c.id, name)
        except VmSandboxError as exc:
            if self.pods.containers.refresh(c).state == CONTAINER_EXITED:
                raise NotFound(f"task {c.id[:12]}: process already finished") from None
            raise WrongState(f"task {c.id[:12]}: its guest did not deliver SIG{name}: {exc}") from None
        return empty_pb2.Empty()

    def delete(self, req: task.DeleteRequest) -> task.DeleteResponse:
        c = self._container(req.id)
        if req.exec_id:
            p = self.tasks.drop_exec(c.id, req.exec_id)
            if p.stream is not None and not p.exit.done.is_set():
                p.stream.release()
            return task.DeleteResponse(pid=self._pid(c), exit_status=p.exit.code, exited_at=timestamp(p.exit.at_ns))
        c = self.pods.containers.refresh(c)
        if c.state == CONTAINER_RUNNING:
            raise WrongState(f"task {c.id[:12]} is running: kill it first")
        pid = self._pid(c)
        remove_container(self.pods, RemoveContainer(c.id))
        code = c.exit_code if c.exit_code is not None else 0
        at = c.finished_ns or time.time_ns()
        self.tasks.forget(c.id)
        deleted = events_pb.TaskDelete(container_id=c.id, id=c.id, pid=pid, exit_status=code, exited_at=timestamp(at))
        self.events.publish("/tasks/delete", deleted)
        return task.DeleteResponse(pid=pid, exit_status=code, exited_at=timestamp(at))

    def wait(self, req: task.WaitRequest) -> task.WaitResponse:
        c = self._container(req.id)
        exit_ = self.tasks.exec(c.id, req.exec_id).exit if req.exec_id else self.tasks.exit_of(c.id)
        while not exit_.done.wait(WAIT_SLICE_S):
            if not req.exec_id:
                now = self.pods.records.find_container(c.id)
                if now is None:
                    raise NotFound(f"task {c.id[:12]} was removed")
                if now.state == CONTAINER_EXITED:
                    self._report_exit(now)
        return task.WaitResponse(exit_status=exit_.code, exited_at=timestamp(exit_.at_ns))

    def state(self, req: task.StateRequest) -> task.StateResponse:
        c = self._container(req.id)
        if req.exec_id:
            p = self.tasks.exec(c.id, req.exec_id)
            done = p.exit.done.is_set()
            status = task_types.STOPPED if done else (task_types.RUNNING if p.stream else task_types.CREATED)
            reply = task.StateResponse(
                id=c.id,
                exec_id=p.exec_id,
                pid=self._pid(c),
                status=status,
                stdin=p.io.stdin,
                stdout=p.io.stdout,
                stderr=p.io.stderr,
                terminal=p.io.terminal,
            )
            if done:
                reply.exit_status = p.exit.code
                reply.exited_at.CopyFrom(timestamp(p.exit.at_ns))
            return reply
        c = self.pods.containers.refresh(c)
        io = self.tasks.io(c.id) or TaskIO()
        reply = task.StateResponse(
            id=c.id,
            pid=self._pid(c),
            status=_STATUS.get(c.state, task_types.UNKNOWN),
            stdin=io.stdin,
            stdout=io.stdout,
            stderr=io.stderr,
            terminal=io.terminal,
        )
        if c.state == CONTAINER_EXITED:
            reply.exit_status = c.exit_code if c.exit_code is not None else 255
            reply.exited_at.CopyFrom(timestamp(c.finished_ns or time.time_ns()))
        return reply

    def stats(self, req: task.StatsRequest) -> task.StatsResponse:
        """The container's usage as its guest measures it (the same sample as ContainerStats)."""
        c = self._container(req.id)
        return task.StatsResponse(stats=cgroup_metrics(self.pods.container_stats(c.id).sample))

    def _task_pid(self, task_id: str) -> int:
        """QEMU's pid for a task of this handler: a container, or its sandbox (containerd asks the Task
        service about a sandbox's shim too, with ``Connect`` and ``Pids``, when it loads its shims
        again after a restart)."""
        sandbox = handler_sandbox(self.pods, self.runtime_handler, task_id)
        return qemu_pid(self.pods, sandbox) if sandbox is not None else self._pid(self._container(task_id))

    def pids(self, req: task.PidsRequest) -> task.PidsResponse:
        return task.PidsResponse(processes=[task_types.ProcessInfo(pid=self._task_pid(req.id))])

    def update(self, req: task.UpdateTaskRequest) -> empty_pb2.Empty:
        c = self._container(req.id)
        doc = oci_document(req.resources, OCI_RESOURCES, "UpdateTaskRequest.resources")
        linux = containerd_spec.linux_resources(doc)
        update_container_resources(
            self.pods,
            UpdateContainerResources(c.id, None, inbound.linux_resources(linux, "UpdateTaskRequest.resources")),
        )
        return empty_pb2.Empty()

    def connect(self, req: task.ConnectRequest) -> task.ConnectResponse:
        return task.ConnectResponse(shim_pid=os.getpid(), task_pid=self._task_pid(req.id), version="3")

    def shutdown(self, req: task.ShutdownRequest) -> empty_pb2.Empty:
        """Nothing to do: every task of this handler is served by the one vmsandbox process."""
        return empty_pb2.Empty()

    # -- exec processes ----------------------------------------------------------------------------
    def exec(self, req: task.ExecProcessRequest) -> empty_pb2.Empty:
        c = self._container(req.id)
        validation.text(req.exec_id, "ExecProcessRequest.exec_id")
        if not req.exec_id or len(req.exec_id) > 76:
            raise InvalidArgument("ExecProcessRequest.exec_id is empty or longer than 76 characters")
        argv = oci_document(req.spec, OCI_PROCESS, "ExecProcessRequest.spec").get("args")
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            raise InvalidArgument("ExecProcessRequest.spec.args is not a non-empty list of strings")
        io = check_io(TaskIO(req.stdin, req.stdout, req.stderr, req.terminal), "ExecProcessRequest")
        self.tasks.add_exec(ExecProcess(c.id, req.exec_id, io, tuple(argv)))
        self.events.publish("/tasks/exec-added", events_pb.TaskExecAdded(container_id=c.id, exec_id=req.exec_id))
        return empty_pb2.Empty()

    def _start_exec(self, c: ContainerRecord, exec_id: str) -> task.StartResponse:
        p = self.tasks.exec(c.id, exec_id)
        if p.stream is not None:
            raise WrongState(f"exec {exec_id} of task {c.id[:12]} was started already")
        p.stream = self.pods.containers.proc_start(c.id, list(p.argv), tty=p.io.terminal, stdin=bool(p.io.stdin))
        pid = self._pid(c)

        def exited(code: int) -> None:
            if p.exit.set(code):
                ended = events_pb.TaskExit(
                    container_id=c.id, id=exec_id, pid=pid, exit_status=code, exited_at=timestamp(p.exit.at_ns)
                )
                self.events.publish("/tasks/exit", ended)

        p.feed = pump_exec(p.stream, p.io.stdin, p.io.stdout, p.io.stderr, exited)
        started = events_pb.TaskExecStarted(container_id=c.id, exec_id=exec_id, pid=pid)
        self.events.publish("/tasks/exec-started", started)
        return task.StartResponse(pid=pid)

    def _session(self, c: ContainerRecord, exec_id: str) -> AgentStream | None:
        """The stream session of an exec, or of the container's own stdin and terminal."""
        if exec_id:
            p = self.tasks.exec(c.id, exec_id)
            if p.stream is None:
                raise WrongState(f"exec {exec_id} of task {c.id[:12]} was not started")
            return p.stream
        return self.tasks.attached(c.id)

    def resize_pty(self, req: task.ResizePtyRequest) -> empty_pb2.Empty:
        stream = self._session(self._container(req.id), req.exec_id)
        if stream is None:
            raise WrongState(f"task {req.id[:12]} has no terminal")
        stream.resize(req.height, req.width)
        return empty_pb2.Empty()

    def close_io(self, req: task.CloseIORequest) -> empty_pb2.Empty:
        """The end of the process's stdin (containerd's StdinOnce after the first attach, or the
        end of an exec's stdin stream), after what containerd wrote to its fifo before it."""
        c = self._container(req.id)
        stream = self._session(c, req.exec_id)
        if req.stdin and stream is not None:
            feed = self.tasks.exec(c.id, req.exec_id).feed if req.exec_id else self.tasks.attached_feed(c.id)
            try:
                if feed is not None:
                    feed.finish()
                else:
                    stream.close_input()
            except VmSandboxError as exc:
                if self.pods.containers.refresh(self._container(req.id)).state != CONTAINER_EXITED:
                    raise WrongState(f"task {req.id[:12]}: its stdin was not closed: {exc}") from None
        return empty_pb2.Empty()
