"""``NriPlugin``: vmsandbox as an external NRI plugin of the node's containerd, so that ordinary
(runc) pods get their claimed network devices (``shim.dra.runc_nics``), as SIG Network's dranet
pairs a DRA driver with an NRI plugin.

It owns one connection to containerd's NRI socket (``dra.nri_socket``): ttrpc both ways over NRI's
multiplexer (``shim.nri.conn.PluginConn`` with the roles turned round: we serve the Plugin service
and call the Runtime service). It registers (RegisterPlugin, name ``vmsandbox-dra``, index
``NRI_INDEX``), answers Configure subscribing to RunPodSandbox, StopPodSandbox and
RemovePodSandbox, and at Synchronize (every pod containerd has, in one or more parts) removes what
was made for sandboxes containerd no longer has. RunPodSandbox makes the pod's devices; an error
is answered as the call's status, which fails the pod's RunPodSandbox in containerd with our
message. Pod events come as their own calls (NRI 0.10 and later) or as StateChange (before);
both are served. When the connection closes (containerd restarted, or dropped us for a missed
deadline) it is made again every ``retry_s``; meanwhile an ordinary pod with a claimed device runs
without it (containerd does not wait for a plugin that is not there: the documented limit).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from typing import TypeVar

import grpc
from google.protobuf.message import Message

from gen.nri import api_pb2 as api
from shim.dra.driver import DraDriver
from shim.dra.runc_nics import RuncNics, runc_dir
from shim.nri import codec
from shim.nri.conn import PluginCallError, PluginConn, PluginGone, parse_request
from shim.status import code_for
from vmsandbox import nri_rules, ttrpc
from vmsandbox.dra import DraConfig
from vmsandbox.errors import VmSandboxError

log = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)

NRI_NAME = "vmsandbox-dra"
NRI_INDEX = "50"
EVENTS = (api.RUN_POD_SANDBOX, api.STOP_POD_SANDBOX, api.REMOVE_POD_SANDBOX)
REGISTER_TIMEOUT_S = 5.0


def event_mask() -> int:
    return sum(1 << (e - 1) for e in EVENTS)


def status_code(exc: VmSandboxError) -> int:
    """The gRPC code of a typed error (``shim.status``'s one mapping), as ttrpc's status carries it;
    but never UNIMPLEMENTED: NRI's runtime side reads that answer to a pod event as a plugin without
    the method, calls StateChange instead (the refusal twice) and keeps to StateChange from then on.
    A device we do not support (no static addresses) is FAILED_PRECONDITION here."""
    code = code_for(exc)
    if code == grpc.StatusCode.UNIMPLEMENTED:
        code = grpc.StatusCode.FAILED_PRECONDITION
    return int(code.value[0])


class NriPlugin:
    def __init__(self, socket_path: str, nics: RuncNics, retry_s: float = 5.0) -> None:
        self._path = socket_path
        self._nics = nics
        self._retry_s = retry_s
        self._stopping = threading.Event()
        self._conn: PluginConn | None = None
        self._closed = threading.Event()
        self._synced: set[str] = set()  # sandbox ids of a Synchronize in parts
        self.registered = threading.Event()  # set while registered (tests wait on it)
        self._thread = threading.Thread(target=self._run, name="dra-nri", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        conn = self._conn
        if conn is not None:
            conn.close("the driver is stopping")
        if self._thread.is_alive():
            self._thread.join(5)

    # -- the connection -----------------------------------------------------------------------
    def _run(self) -> None:
        logged = False
        while not self._stopping.is_set():
            try:
                self._connect()
                logged = False
            except (OSError, PluginGone, PluginCallError) as exc:
                why = exc.message if isinstance(exc, PluginCallError) else str(exc)
                if not logged:  # once per outage, not every retry
                    log.warning("DRA: NRI socket %s: not connected (%s); retrying", self._path, nri_rules.bounded(why))
                    logged = True
            self._stopping.wait(self._retry_s)

    def _connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self._closed.clear()
        conn = PluginConn(sock, NRI_NAME, self._serve, self._closed.set, plugin_side=True)
        self._conn = conn
        conn.start()
        try:
            conn.call(
                "RegisterPlugin",
                api.RegisterPluginRequest(
                    plugin_name=NRI_NAME, plugin_idx=NRI_INDEX, NRI_version=nri_rules.NRI_VERSION
                ),
                api.Empty,
                REGISTER_TIMEOUT_S,
            )
        except (PluginGone, PluginCallError):
            conn.close("registration failed")
            raise
        self.registered.set()
        log.info("DRA: registered as NRI plugin %s-%s on %s", NRI_INDEX, NRI_NAME, self._path)
        self._closed.wait()
        self.registered.clear()
        if not self._stopping.is_set():
            log.warning("DRA: NRI connection closed: %s", nri_rules.bounded(conn.close_reason))

    # -- what containerd calls ----------------------------------------------------------------
    def _serve(self, method: str, payload: bytes) -> bytes:
        if method == "Configure":
            parse_request(api.ConfigureRequest, payload)
            return api.ConfigureResponse(events=event_mask()).SerializeToString()
        if method == "Synchronize":
            sync = parse_request(api.SynchronizeRequest, payload)
            self._synced.update(p.id for p in sync.pods)
            if not sync.more:
                live, self._synced = self._synced, set()
                self._nics.reconcile(live)
            return api.SynchronizeResponse(more=sync.more).SerializeToString()
        if method == "RunPodSandbox":
            self._run_pod(parse_request(api.RunPodSandboxRequest, payload).pod)
            return api.RunPodSandboxResponse().SerializeToString()
        if method == "StopPodSandbox":
            self._gone(parse_request(api.StopPodSandboxRequest, payload).pod)
            return api.StopPodSandboxResponse().SerializeToString()
        if method == "RemovePodSandbox":
            self._gone(parse_request(api.RemovePodSandboxRequest, payload).pod)
            return api.RemovePodSandboxResponse().SerializeToString()
        if method == "StateChange":
            event = parse_request(api.StateChangeEvent, payload)
            if event.event == api.RUN_POD_SANDBOX:
                self._run_pod(event.pod)
            elif event.event in (api.STOP_POD_SANDBOX, api.REMOVE_POD_SANDBOX):
                self._gone(event.pod)
            return api.Empty().SerializeToString()
        if method == "Shutdown":
            return api.Empty().SerializeToString()
        raise PluginCallError(ttrpc.UNIMPLEMENTED, f"method {method[:64]} is not served by {NRI_NAME}")

    def _run_pod(self, pod: api.PodSandbox) -> None:
        runc = codec.runc_pod(pod)
        try:
            self._nics.attach(runc)
        except VmSandboxError as exc:
            log.error("DRA: pod %s refused: %s", runc.full_name, exc)
            raise PluginCallError(status_code(exc), f"{NRI_NAME}: {exc}") from None

    def _gone(self, pod: api.PodSandbox) -> None:
        with contextlib.suppress(VmSandboxError):  # logged there; containerd goes on
            self._nics.detach(pod.id[:128])


def start_runc_nics(driver: DraDriver, config: DraConfig, state_dir: str, vm_handlers: frozenset[str]) -> NriPlugin:
    """The NRI plugin on ``config.nri_socket`` over the driver's prepared claims, started: pods of
    ``vm_handlers`` (vmsandbox's own, in shim mode) are left alone."""
    nics = RuncNics(driver.store, config.networks, vm_handlers, runc_dir(state_dir), driver.write_status)
    plugin = NriPlugin(config.nri_socket, nics)
    plugin.start()
    return plugin
