"""The DRA kubelet plugin: one gRPC server on two unix sockets (0600), the registration socket the
kubelet's plugin watcher finds in its ``plugins_registry`` directory (``<driver>-reg.sock``: service
``pluginregistration.Registration``) and the plugin's own endpoint (``<plugins_dir>/<driver>/dra.sock``:
``v1.DRAPlugin``, the only DRA service version advertised; a 1.37 kubelet speaks v1 and v1beta1 and
picks the first it knows of the plugin's list).

NodePrepareResources reads each claim from the API server, reduces it to a prepared claim
(``vmsandbox.dra.prepared_claim``: this driver's devices on this node, the pods it is reserved for,
the opaque config) and keeps it in the store before answering its devices; a passthrough device
must not be prepared for another claim nor held by a sandbox (``PciHost``: the one placement
ledger). A claim already prepared is answered from the store. A network device without static
addresses gets them from CNI host-local (``shim.dra.ipam``): the claim's record is kept saying
``adding`` before the first ADD and ``added``, with the addresses, after the last.
NodeUnprepareResources DELetes those (a DEL that fails is the claim's error and its record stays,
so the kubelet's next unprepare runs it again), then forgets the claim; a claim not prepared is not
an error. Each claim's failure is that claim's ``error`` in the reply, as the API asks; the call
itself fails only when it is malformed as a whole (too many claims)."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from concurrent import futures
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import grpc

from gen.kubelet.dra.v1 import api_pb2 as dra_pb
from gen.kubelet.dra.v1 import api_pb2_grpc as dra_grpc
from gen.kubelet.pluginregistration.v1 import api_pb2 as reg_pb
from gen.kubelet.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from shim import faults
from shim.dra.ipam import HostLocal
from shim.dra.store import ClaimStore
from vmsandbox import validation
from vmsandbox.devices import DeviceGroup
from vmsandbox.dra import IPAM_ADDING, DraConfig, PreparedClaim, check_claim_ref, is_pci, prepared_claim
from vmsandbox.dra_ipam import ipam_devices
from vmsandbox.errors import InfrastructureError, VmSandboxError, WrongState

log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"
SERVICE_VERSIONS = ("v1.DRAPlugin",)
MAX_CLAIMS_PER_CALL = 256


class ClaimSource(Protocol):
    def get_claim(self, namespace: str, name: str) -> Any: ...


class PciHost(Protocol):
    """The node's published passthrough devices (by device name) and which sandbox holds a group."""

    def devices(self) -> Mapping[str, DeviceGroup]: ...
    def holder(self, group: DeviceGroup) -> str | None: ...


def registration_socket(config: DraConfig) -> Path:
    return Path(config.plugins_registry_dir) / f"{config.driver_name}-reg.sock"


def plugin_socket(config: DraConfig) -> Path:
    return Path(config.plugins_dir) / config.driver_name / "dra.sock"


class Registration(reg_grpc.RegistrationServicer):
    def __init__(self, config: DraConfig) -> None:
        self._config = config
        self.registered = threading.Event()
        self.error = ""

    def GetInfo(self, request: reg_pb.InfoRequest, context: grpc.ServicerContext) -> reg_pb.PluginInfo:
        return reg_pb.PluginInfo(
            type=PLUGIN_TYPE,
            name=self._config.driver_name,
            endpoint=str(plugin_socket(self._config)),
            supported_versions=list(SERVICE_VERSIONS),
        )

    def NotifyRegistrationStatus(
        self, request: reg_pb.RegistrationStatus, context: grpc.ServicerContext
    ) -> reg_pb.RegistrationStatusResponse:
        if request.plugin_registered:
            log.info("DRA: registered with the kubelet as %s", self._config.driver_name)
            self.error = ""
            self.registered.set()
        else:
            self.error = validation.bound(request.error)
            log.error("DRA: the kubelet refused the plugin: %s", self.error)
        return reg_pb.RegistrationStatusResponse()


class DraService(dra_grpc.DRAPluginServicer):
    def __init__(
        self,
        config: DraConfig,
        node: str,
        store: ClaimStore,
        source: ClaimSource,
        pci: PciHost | None = None,
        ipam: HostLocal | None = None,
    ) -> None:
        self._config, self._node, self._store, self._source = config, node, store, source
        self._ipam = ipam
        self._devices = frozenset(n.name for n in config.networks)
        self._pci = pci
        self._lock = threading.Lock()  # one prepare or unprepare of the store at a time

    def NodePrepareResources(
        self, request: dra_pb.NodePrepareResourcesRequest, context: grpc.ServicerContext
    ) -> dra_pb.NodePrepareResourcesResponse:
        if len(request.claims) > MAX_CLAIMS_PER_CALL:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"more than {MAX_CLAIMS_PER_CALL} claims in one call")
        reply = dra_pb.NodePrepareResourcesResponse()
        for claim in request.claims:
            try:
                prepared = self._prepare(claim)
            except VmSandboxError as exc:
                log.warning("DRA: prepare %s/%s: %s", claim.namespace, claim.name, exc)
                reply.claims[claim.uid].error = validation.bound(str(exc))
                continue
            reply.claims[claim.uid].devices.extend(
                dra_pb.Device(
                    request_names=[d.request],
                    pool_name=d.pool,
                    device_name=d.device,
                    cdi_device_ids=[],
                    share_id=d.share_id or None,
                )
                for d in prepared.devices
            )
        return reply

    def _prepare(self, claim: dra_pb.Claim) -> PreparedClaim:
        check_claim_ref(claim.namespace, claim.name, claim.uid)
        with self._lock:
            known = self._store.get(claim.uid)
        if known is not None and known.ipam != IPAM_ADDING:
            return known
        if known is not None and self._ipam is not None:  # a prepare cut short: what it added goes first
            self._ipam.delete(known)
        got = self._source.get_claim(claim.namespace, claim.name)
        published = self._pci.devices() if self._pci is not None else {}
        prepared = prepared_claim(
            got,
            claim.namespace,
            claim.name,
            claim.uid,
            self._config.driver_name,
            self._node,
            self._devices,
            frozenset(published),
        )
        if ipam_devices(prepared) and self._ipam is not None:
            prepared = replace(prepared, ipam=IPAM_ADDING)
            with self._lock:  # its passthrough devices are this record's from here
                self._check_pci_free(prepared, published)
                self._store.put(prepared)  # before the first ADD: a crash after it is DELeted at start
            faults.checkpoint("dra:after-record")
            try:
                prepared = self._ipam.add(prepared)
            except VmSandboxError:
                with self._lock:
                    self._store.remove(claim.uid)
                raise
            with self._lock:
                self._store.put(prepared)
        else:
            with self._lock:
                self._check_pci_free(prepared, published)
                self._store.put(prepared)
        log.info(
            "DRA: prepared claim %s/%s (%s) for pods %s: %s",
            claim.namespace,
            claim.name,
            claim.uid,
            ",".join(prepared.pod_uids),
            ",".join(d.device for d in prepared.devices),
        )
        return prepared

    def _check_pci_free(self, prepared: PreparedClaim, published: Mapping[str, DeviceGroup]) -> None:
        """A passthrough device is prepared for one claim at a time and not held by a sandbox now (a
        pod that took its IOMMU group through its device pool): WrongState naming who has it."""
        mine = {d.device for d in prepared.devices if is_pci(d)}
        if not mine:
            return
        for other in self._store.all():
            both = sorted(mine & {d.device for d in other.devices if is_pci(d)})
            if both and other.uid != prepared.uid:
                raise WrongState(
                    f"resourceclaim {prepared.namespace}/{prepared.name}: PCI device {both[0]} is prepared for "
                    f"claim {other.namespace}/{other.name} already"
                )
        for name in sorted(mine):
            holder = self._pci.holder(published[name]) if self._pci is not None else None
            if holder is not None:
                raise WrongState(
                    f"resourceclaim {prepared.namespace}/{prepared.name}: PCI device {name} "
                    f"({published[name].describe()}) is held by sandbox {holder[:12]}"
                )

    def NodeUnprepareResources(
        self, request: dra_pb.NodeUnprepareResourcesRequest, context: grpc.ServicerContext
    ) -> dra_pb.NodeUnprepareResourcesResponse:
        if len(request.claims) > MAX_CLAIMS_PER_CALL:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"more than {MAX_CLAIMS_PER_CALL} claims in one call")
        reply = dra_pb.NodeUnprepareResourcesResponse()
        for claim in request.claims:
            try:
                check_claim_ref(claim.namespace, claim.name, claim.uid)
                with self._lock:
                    known = self._store.get(claim.uid)
                if known is not None and known.ipam and self._ipam is not None:
                    self._ipam.delete(known)  # raises: the record stays, the kubelet's next unprepare DELs again
                    faults.checkpoint("dra:after-ipam-del")
                with self._lock:
                    if self._store.remove(claim.uid):
                        log.info("DRA: unprepared claim %s/%s (%s)", claim.namespace, claim.name, claim.uid)
                reply.claims[claim.uid].error = ""
            except (VmSandboxError, OSError) as exc:
                reply.claims[claim.uid].error = validation.bound(str(exc))
        return reply


class DraPlugin:
    """The plugin's server and sockets; ``start`` after the store is loaded, ``stop`` at a clean stop
    (the registration socket goes, so the kubelet forgets the plugin)."""

    def __init__(
        self,
        config: DraConfig,
        node: str,
        store: ClaimStore,
        source: ClaimSource,
        pci: PciHost | None = None,
        ipam: HostLocal | None = None,
    ) -> None:
        self.config = config
        self.registration = Registration(config)
        self.service = DraService(config, node, store, source, pci, ipam)
        self._server: grpc.Server | None = None

    def start(self) -> None:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="dra"))
        reg_grpc.add_RegistrationServicer_to_server(self.registration, server)
        dra_grpc.add_DRAPluginServicer_to_server(self.service, server)
        for path in (plugin_socket(self.config), registration_socket(self.config)):
            path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
            if path.is_socket():
                path.unlink()  # left by a process that did not stop cleanly
            old = os.umask(0o177)
            try:
                port = server.add_insecure_port(f"unix:{path}")
            except RuntimeError:  # grpc's way of saying the bind failed
                port = 0
            finally:
                os.umask(old)
            if not port:
                server.stop(0)
                raise InfrastructureError(f"DRA: cannot listen on unix socket {path}")
        server.start()
        self._server = server
        log.info("DRA: driver %s serving %s, registering at %s", self.config.driver_name,
                 plugin_socket(self.config), registration_socket(self.config))  # fmt: skip

    def stop(self, grace: float = 5.0) -> None:
        registration_socket(self.config).unlink(missing_ok=True)
        if self._server is not None:
            self._server.stop(grace).wait()
        plugin_socket(self.config).unlink(missing_ok=True)
