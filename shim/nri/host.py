"""``NriHost``: the runtime side of NRI (containerd/nri's adaptation) for vmsandbox.

It owns the NRI socket, the plugins it starts from ``plugin_path`` and every registered
plugin's connection. A plugin registers (RegisterPlugin within the registration timeout), is
configured (its ``plugin_config_path`` drop-in for plugins we start), synchronized with every
pod and container, and from then on called for the events it subscribed to, in ascending
index order (then name), each call within the request timeout. A plugin's error fails
RunPodSandbox, CreateContainer and UpdateContainerResources with its message (bounded), and so
does any answer but acceptance from a plugin validating adjustments (ValidateContainerAdjustment:
NRI fails closed there); on every other event it is logged and the runtime carries on. A plugin
that closes its connection, breaks the protocol or misses a deadline is dropped (a plugin we
started is killed) and logged; the runtime carries on without it. Events are dispatched one at a time,
as the adaptation does, so a plugin sees them in the order they happened.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from google.protobuf.message import Message

from gen.nri import api_pb2 as api
from shim.nri import codec
from shim.nri.conn import PluginCallError, PluginConn, PluginGone, parse_request
from vmsandbox import nri_rules, ttrpc
from vmsandbox.errors import InvalidArgument, PermissionDenied

log = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)

Snapshot = Callable[[], tuple[list[api.PodSandbox], list[api.Container]]]
Updater = Callable[[str, list[api.ContainerUpdate]], list[api.ContainerUpdate]]  # (plugin, updates) -> failed
_SYNC_CHUNK = 256  # pods + containers per Synchronize message (NRI's "more" protocol beyond that)


@dataclass
class Plugin:
    conn: PluginConn
    idx: str = ""
    base: str = ""
    config: str = ""
    events: int = 0
    pid: int | None = None  # of a plugin we started
    registered: threading.Event = field(default_factory=threading.Event)

    @property
    def name(self) -> str:
        return f"{self.idx}-{self.base}"


class NriHost:
    def __init__(
        self, config: nri_rules.NriConfig, runtime_name: str, runtime_version: str, snapshot: Snapshot, update: Updater
    ) -> None:
        self.config = config
        self._runtime = (runtime_name, runtime_version)
        self._snapshot = snapshot
        self._update = update
        self._lock = threading.Lock()  # the plugin list
        self._events = threading.RLock()  # one event (or one synchronization) at a time
        self._plugins: list[Plugin] = []
        self._listener: socket.socket | None = None
        self._closing = False

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Listen on the NRI socket and start the plugins of ``plugin_path`` (waiting for them)."""
        if self.config.socket_path:
            self._listen(Path(self.config.socket_path))
        starting = [t for t in self._launch_all()]
        for t in starting:
            t.join(self.config.registration_timeout_s + self.config.request_timeout_s * 2 + 1)

    def _listen(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(path.lstat().st_mode):
                path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(str(path))
        finally:
            os.umask(old)
        sock.listen(16)
        self._listener = sock
        threading.Thread(target=self._accept_loop, args=(sock,), name="nri-accept", daemon=True).start()
        log.info("NRI: listening for plugins on %s", path)

    def _accept_loop(self, sock: socket.socket) -> None:
        while not self._closing:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            threading.Thread(target=self._admit, args=(conn, None, "", "", ""), daemon=True).start()

    def _launch_all(self) -> list[threading.Thread]:
        directory = Path(self.config.plugin_path) if self.config.plugin_path else None
        if directory is None or not directory.is_dir():
            return []
        threads = []
        for entry in sorted(directory.iterdir()):
            parsed = nri_rules.split_plugin_file(entry.name)
            if parsed is None or not entry.is_file() or not os.access(entry, os.X_OK):
                if parsed is None:
                    log.warning("NRI: ignoring %s in %s: not named NN-name", entry.name[:128], directory)
                continue
            idx, base = parsed
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                pid = _spawn(entry, base, idx, theirs)
            except OSError as exc:
                ours.close()
                log.error("NRI: cannot start plugin %s: %s", entry, exc.strerror or exc)
                continue
            finally:
                theirs.close()
            config = self._plugin_config(idx, base)
            t = threading.Thread(target=self._admit, args=(ours, pid, idx, base, config), daemon=True)
            t.start()
            threads.append(t)
        return threads

    def _plugin_config(self, idx: str, base: str) -> str:
        if not self.config.plugin_config_path:
            return ""
        for name in (f"{idx}-{base}.conf", f"{base}.conf"):
            path = Path(self.config.plugin_config_path) / name
            try:
                return path.read_text(errors="replace")[: 1 << 20]
            except FileNotFoundError:
                continue
            except OSError as exc:
                log.error("NRI: cannot read %s: %s", path, exc.strerror or exc)
                return ""
        return ""

    def close(self) -> None:
        self._closing = True
        if self._listener is not None:
            self._listener.close()
            with contextlib.suppress(OSError):
                Path(self.config.socket_path).unlink()
        with self._lock:
            plugins = list(self._plugins)
        for p in plugins:
            with contextlib.suppress(PluginGone, PluginCallError):
                p.conn.call("Shutdown", api.Empty(), api.Empty, min(self.config.request_timeout_s, 1.0))
            p.conn.close("the runtime is shutting down")

    def registered(self) -> list[str]:
        """The plugins taking events, in calling order ("10-logger")."""
        with self._lock:
            return [p.name for p in self._plugins]

    # -- registration -------------------------------------------------------------------------
    def _admit(self, sock: socket.socket, pid: int | None, idx: str, base: str, config: str) -> None:
        plugin: Plugin

        def on_close() -> None:
            self._dropped(plugin)

        plugin = Plugin(
            PluginConn(sock, f"{idx}-{base}" if base else "external", lambda m, b: self._serve(plugin, m, b), on_close),
            idx=idx,
            base=base,
            config=config,
            pid=pid,
        )
        plugin.conn.start()
        timeout = self.config.registration_timeout_s
        if not plugin.registered.wait(timeout) or plugin.conn.closed:
            why = plugin.conn.close_reason or f"did not register within {timeout:g}s"
            log.error("NRI: plugin %s not registered: %s", plugin.conn.name, nri_rules.bounded(why))
            plugin.conn.close(why)
            return
        try:
            reply = plugin.conn.call(
                "Configure",
                api.ConfigureRequest(
                    config=plugin.config,
                    runtime_name=self._runtime[0],
                    runtime_version=self._runtime[1],
                    registration_timeout=int(timeout * 1000),
                    request_timeout=int(self.config.request_timeout_s * 1000),
                    NRI_version=nri_rules.NRI_VERSION,
                ),
                api.ConfigureResponse,
                self.config.request_timeout_s,
            )
            plugin.events = nri_rules.event_mask(reply.events)
            with self._events:
                failed = self._synchronize(plugin)
                with self._lock:
                    self._plugins.append(plugin)
                    self._plugins.sort(key=lambda p: (p.idx, p.base))
        except Exception as exc:
            why = exc.message if isinstance(exc, PluginCallError) else str(exc)
            log.error("NRI: plugin %s failed to configure or synchronize: %s", plugin.conn.name, nri_rules.bounded(why))
            plugin.conn.close(f"configuration failed: {why}")
            return
        log.info("NRI: plugin %s registered (events 0x%x)", plugin.name, plugin.events)
        if failed:
            log.warning("NRI: plugin %s: %d container update(s) of its synchronization failed", plugin.name, failed)

    def _synchronize(self, plugin: Plugin) -> int:
        pods, containers = self._snapshot()
        items: list[tuple[str, Message]] = [("pod", p) for p in pods] + [("container", c) for c in containers]
        for at in range(0, max(len(items), 1), _SYNC_CHUNK):
            chunk = items[at : at + _SYNC_CHUNK]
            more = at + _SYNC_CHUNK < len(items)
            req = api.SynchronizeRequest(more=more)
            for kind, m in chunk:
                (req.pods if kind == "pod" else req.containers).append(m)  # type: ignore[arg-type]
            reply = plugin.conn.call("Synchronize", req, api.SynchronizeResponse, self.config.request_timeout_s)
            if more and (reply.update or reply.more != more):
                raise PluginGone("plugin does not handle split sync requests")
            if not more:
                return len(self._update(plugin.name, list(reply.update))) if reply.update else 0
        return 0

    def _serve(self, plugin: Plugin, method: str, payload: bytes) -> bytes:
        if method == "RegisterPlugin":
            req = parse_request(api.RegisterPluginRequest, payload)
            if plugin.registered.is_set():
                raise PluginCallError(ttrpc.FAILED_PRECONDITION, "plugin already registered")
            try:
                if plugin.pid is None:  # an external plugin names itself
                    plugin.base = nri_rules.check_plugin_name(req.plugin_name)
                    plugin.idx = nri_rules.check_plugin_index(req.plugin_idx)
                    plugin.conn.name = plugin.name
            except InvalidArgument as exc:
                raise PluginCallError(ttrpc.INVALID_ARGUMENT, str(exc), fatal=True) from None
            with self._lock:
                taken = any(p.name == plugin.name for p in self._plugins)
            if taken:
                raise PluginCallError(ttrpc.ALREADY_EXISTS, f"a plugin {plugin.name} is registered already", fatal=True)
            log.info(
                "NRI: plugin %s registering (NRI version %s)",
                plugin.name,
                nri_rules.bounded(req.NRI_version or "unknown"),
            )
            plugin.registered.set()
            return api.Empty().SerializeToString()
        if method == "UpdateContainers":
            if plugin not in self._active():
                raise PluginCallError(ttrpc.FAILED_PRECONDITION, "plugin is not registered")
            req2 = parse_request(api.UpdateContainersRequest, payload)
            if req2.evict:
                log.warning("NRI: plugin %s asked to evict %d container(s); ignored", plugin.name, len(req2.evict))
            failed = self._update(plugin.name, list(req2.update))
            return api.UpdateContainersResponse(failed=failed).SerializeToString()
        raise PluginCallError(ttrpc.UNIMPLEMENTED, f"method {method[:64]} is not served")

    def _active(self) -> list[Plugin]:
        with self._lock:
            return list(self._plugins)

    def _dropped(self, plugin: Plugin) -> None:
        with self._lock:
            was = plugin in self._plugins
            if was:
                self._plugins.remove(plugin)
        if was and not self._closing:
            log.error("NRI: plugin %s dropped: %s", plugin.name, plugin.conn.close_reason)
        if plugin.pid is not None:
            _reap(plugin.pid)
        plugin.registered.set()

    # -- events -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _dispatch(self) -> Iterator[list[Plugin]]:
        with self._events:
            yield self._active()

    def _call(self, plugin: Plugin, event: int, method: str, req: Message, reply: type[Message]) -> Message | None:
        """One event to one plugin: its answer, or None when it is not subscribed or was dropped."""
        if not nri_rules.subscribed(plugin.events, event):
            return None
        started = time.monotonic()
        try:
            out = plugin.conn.call(method, req, reply, self.config.request_timeout_s)
        except PluginGone as exc:
            log.error("NRI: plugin %s dropped during %s: %s", plugin.name, method, exc)
            return None
        finally:
            log.debug("NRI: %s %s took %.1f ms", plugin.name, method, (time.monotonic() - started) * 1e3)
        return out

    def _refusal(self, plugin: Plugin, method: str, exc: PluginCallError) -> PermissionDenied:
        return PermissionDenied(f'NRI plugin "{plugin.name}" refused {method}: {nri_rules.bounded(exc.message)}')

    def _notify(self, event: int, method: str, req: Message, reply: type[Message], *, fail: bool) -> None:
        with self._dispatch() as plugins:
            for p in plugins:
                try:
                    self._call(p, event, method, req, reply)
                except PluginCallError as exc:
                    if fail:
                        raise self._refusal(p, method, exc) from None
                    log.warning("NRI: plugin %s failed %s: %s", p.name, method, nri_rules.bounded(exc.message))

    def run_pod_sandbox(self, pod: api.PodSandbox) -> None:
        req = api.RunPodSandboxRequest(pod=pod)
        self._notify(api.RUN_POD_SANDBOX, "RunPodSandbox", req, api.RunPodSandboxResponse, fail=True)

    def stop_pod_sandbox(self, pod: api.PodSandbox) -> None:
        req = api.StopPodSandboxRequest(pod=pod)
        self._notify(api.STOP_POD_SANDBOX, "StopPodSandbox", req, api.StopPodSandboxResponse, fail=False)

    def remove_pod_sandbox(self, pod: api.PodSandbox) -> None:
        req = api.RemovePodSandboxRequest(pod=pod)
        self._notify(api.REMOVE_POD_SANDBOX, "RemovePodSandbox", req, api.RemovePodSandboxResponse, fail=False)

    def update_pod_sandbox(
        self, pod: api.PodSandbox, overhead: api.LinuxResources, resources: api.LinuxResources
    ) -> None:
        req = api.UpdatePodSandboxRequest(pod=pod, overhead_linux_resources=overhead, linux_resources=resources)
        # told after the update took effect (the VM cannot change at this call), so never refused
        self._notify(api.UPDATE_POD_SANDBOX, "UpdatePodSandbox", req, api.UpdatePodSandboxResponse, fail=False)

    def post_update_pod_sandbox(self, pod: api.PodSandbox) -> None:
        req = api.PostUpdatePodSandboxRequest(pod=pod)
        self._notify(
            api.POST_UPDATE_POD_SANDBOX, "PostUpdatePodSandbox", req, api.PostUpdatePodSandboxResponse, fail=False
        )

    def create_container(
        self, pod: api.PodSandbox, container: api.Container, target: nri_rules.Target
    ) -> tuple[nri_rules.Target, list[tuple[str, api.ContainerUpdate]]]:
        """Every subscribed plugin's adjustment applied to ``target``, and the updates they ask
        for other containers (each with the plugin that asked)."""
        req = api.CreateContainerRequest(pod=pod, container=container)
        updates: list[tuple[str, api.ContainerUpdate]] = []
        merged = api.ContainerAdjustment()
        with self._dispatch() as plugins:
            for p in plugins:
                try:
                    reply = self._call(p, api.CREATE_CONTAINER, "CreateContainer", req, api.CreateContainerResponse)
                except PluginCallError as exc:
                    raise self._refusal(p, "CreateContainer", exc) from None
                if not isinstance(reply, api.CreateContainerResponse):
                    continue
                if reply.HasField("adjust"):
                    target = nri_rules.apply_adjustment(target, p.name, codec.adjustment(reply.adjust))
                    merged.MergeFrom(reply.adjust)
                updates += [(p.name, u) for u in reply.update]
                if reply.evict:
                    log.warning("NRI: plugin %s asked to evict %d container(s); ignored", p.name, len(reply.evict))
            self._validate(plugins, pod, container, merged, [u for _, u in updates])
        return target, updates

    def _validate(
        self,
        plugins: list[Plugin],
        pod: api.PodSandbox,
        container: api.Container,
        adjust: api.ContainerAdjustment,
        updates: list[api.ContainerUpdate],
    ) -> None:
        """Ask the validating plugins (those subscribed to ValidateContainerAdjustment) about the
        adjustments; any rejection, error or missed deadline fails the container, as NRI fails
        closed on validation."""
        plugins = [p for p in plugins if not p.conn.closed]  # those dropped during this event are gone
        validators = [p for p in plugins if nri_rules.subscribed(p.events, nri_rules.VALIDATE_CONTAINER_ADJUSTMENT)]
        if not validators:
            return
        req = api.ValidateContainerAdjustmentRequest(
            pod=pod,
            container=container,
            adjust=adjust,
            update=updates,
            plugins=[api.PluginInstance(name=p.base, index=p.idx) for p in plugins],
        )
        for v in validators:
            method = "ValidateContainerAdjustment"
            try:
                reply = v.conn.call(method, req, api.ValidateContainerAdjustmentResponse, self.config.request_timeout_s)
            except PluginCallError as exc:
                raise self._refusal(v, method, exc) from None
            except PluginGone as exc:
                log.error("NRI: plugin %s dropped during %s: %s", v.name, method, exc)
                raise PermissionDenied(
                    f'NRI validator plugin "{v.name}" failed: {nri_rules.bounded(str(exc))}'
                ) from None
            if reply.reject:
                raise PermissionDenied(
                    f'NRI plugin "{v.name}" rejected the adjustments of container "{container.name}": '
                    f"{nri_rules.bounded(reply.reason)}"
                )

    def post_create_container(self, pod: api.PodSandbox, container: api.Container) -> None:
        req = api.PostCreateContainerRequest(pod=pod, container=container)
        self._notify(api.POST_CREATE_CONTAINER, "PostCreateContainer", req, api.PostCreateContainerResponse, fail=False)

    def start_container(self, pod: api.PodSandbox, container: api.Container) -> None:
        req = api.StartContainerRequest(pod=pod, container=container)
        self._notify(api.START_CONTAINER, "StartContainer", req, api.StartContainerResponse, fail=False)

    def post_start_container(self, pod: api.PodSandbox, container: api.Container) -> None:
        req = api.PostStartContainerRequest(pod=pod, container=container)
        self._notify(api.POST_START_CONTAINER, "PostStartContainer", req, api.PostStartContainerResponse, fail=False)

    def update_container(
        self, pod: api.PodSandbox, container: api.Container, resources: api.LinuxResources
    ) -> list[tuple[str, api.ContainerUpdate]]:
        req = api.UpdateContainerRequest(pod=pod, container=container, linux_resources=resources)
        updates: list[tuple[str, api.ContainerUpdate]] = []
        with self._dispatch() as plugins:
            for p in plugins:
                try:
                    reply = self._call(p, api.UPDATE_CONTAINER, "UpdateContainer", req, api.UpdateContainerResponse)
                except PluginCallError as exc:
                    raise self._refusal(p, "UpdateContainer", exc) from None
                if isinstance(reply, api.UpdateContainerResponse):
                    updates += [(p.name, u) for u in reply.update]
        return updates

    def post_update_container(self, pod: api.PodSandbox, container: api.Container) -> None:
        req = api.PostUpdateContainerRequest(pod=pod, container=container)
        self._notify(api.POST_UPDATE_CONTAINER, "PostUpdateContainer", req, api.PostUpdateContainerResponse, fail=False)

    def stop_container(self, pod: api.PodSandbox, container: api.Container) -> list[tuple[str, api.ContainerUpdate]]:
        req = api.StopContainerRequest(pod=pod, container=container)
        updates: list[tuple[str, api.ContainerUpdate]] = []
        with self._dispatch() as plugins:
            for p in plugins:
                try:
                    reply = self._call(p, api.STOP_CONTAINER, "StopContainer", req, api.StopContainerResponse)
                except PluginCallError as exc:
                    log.warning("NRI: plugin %s failed StopContainer: %s", p.name, nri_rules.bounded(exc.message))
                    continue
                if isinstance(reply, api.StopContainerResponse):
                    updates += [(p.name, u) for u in reply.update]
        return updates

    def remove_container(self, pod: api.PodSandbox, container: api.Container) -> None:
        req = api.RemoveContainerRequest(pod=pod, container=container)
        self._notify(api.REMOVE_CONTAINER, "RemoveContainer", req, api.RemoveContainerResponse, fail=False)


def _spawn(path: Path, base: str, idx: str, sock: socket.socket) -> int:
    """Start a plugin as NRI does: its end of the socket pair as fd 3 (NRI_PLUGIN_SOCKET=3), its
    name and index in the environment, nothing else; its own session. posix_spawn's dup2 puts the
    socket at fd 3 without running code of ours in the child of this threaded process."""
    fd = sock.fileno()
    spare = os.dup(fd) if fd == 3 else -1  # dup2(3, 3) would leave close-on-exec set
    try:
        return os.posix_spawn(
            str(path),
            [str(path)],
            {"NRI_PLUGIN_NAME": base, "NRI_PLUGIN_IDX": idx, "NRI_PLUGIN_SOCKET": "3"},
            file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
                (os.POSIX_SPAWN_DUP2, spare if spare >= 0 else fd, 3),
            ],
            setsid=True,
        )
    finally:
        if spare >= 0:
            os.close(spare)


def _reap(pid: int) -> None:
    """Kill a plugin we started and collect it (it is dropped; it may already have exited)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done:
            return
        time.sleep(0.01)
    log.warning("NRI: plugin process %d did not exit after SIGKILL", pid)
