"""The gRPC handlers of the CRI proxy: each call to vmsandbox's local servicers or to the downstream.

Requests arrive as bytes (generic handlers without a deserializer). Only what routing needs is
parsed (``vmsandbox.routing.METHODS`` says what); a call for the downstream is sent on as the
bytes that came in, and its reply returned as the bytes that came back. Calls for vmsandbox are
decoded and served by its own servicers as without a downstream. List replies are merged by
concatenating the two sides' serialised replies, which protobuf defines as appending their
repeated fields: each side has already applied the filter, and nothing of the downstream's reply
is re-encoded. While the downstream cannot be reached, ``ListPodSandbox`` and ``ListContainers``
answer its side as it last listed it (``DownstreamIds.last_listed``), so the kubelet neither sees
its pods vanish nor its PLEG stop. ``Status`` and the image calls are merged message by message
(python protobuf keeps fields it does not know when it re-serialises).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from typing import Any

import grpc
from google.protobuf import message_factory

from gen.cri.runtime.v1 import api_pb2 as pb
from shim import status
from shim.proxy import front_headers
from shim.proxy.downstream import Downstream, DownstreamUnavailable, Forwarded
from shim.proxy.ids import LISTS, DownstreamIds, list_filter
from shim.proxy.split_images import ImageRouter
from shim.records import Records
from vmsandbox import routing, validation
from vmsandbox.errors import InvalidArgument, VmSandboxError
from vmsandbox.routing import Kind, Side

log = logging.getLogger(__name__)

RUNTIME = "runtime.v1.RuntimeService"
IMAGES = "runtime.v1.ImageService"
STATUS_CAP_S = 5.0  # Status is what the kubelet polls for node readiness: a hung downstream costs it this at most


def _abort_for(context: grpc.ServicerContext, exc: BaseException) -> None:
    if isinstance(exc, Forwarded):
        context.abort(exc.code, exc.details)
    code = status.code_for(exc)
    context.abort(code, validation.bound(str(exc) or type(exc).__name__))


def guarded(name: str, fn: Callable[[bytes, grpc.ServicerContext], bytes]) -> Callable[[bytes, Any], bytes]:
    """Errors of the proxy itself to their gRPC codes (a local servicer aborts by itself)."""

    def handler(request: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            return fn(request, context)
        except (VmSandboxError, Forwarded) as exc:
            log.info("%s -> %s", name, exc)
            _abort_for(context, exc)
            raise  # abort raises; for the type checker
        except Exception as exc:
            if getattr(context, "code", lambda: None)() is not None:
                raise  # a local servicer's abort (context.abort raises a bare Exception) on its way out
            log.exception("%s failed", name)
            context.abort(grpc.StatusCode.INTERNAL, validation.bound(f"{name}: internal error: {exc}"))
            raise

    return handler


def _parse(cls: Any, data: bytes) -> Any:
    try:
        return cls.FromString(data)
    except Exception as exc:  # DecodeError, UnicodeDecodeError: bad client bytes
        raise InvalidArgument(f"the request is not a valid {cls.DESCRIPTOR.full_name}: {exc}") from None


class Proxy:
    """Routes RuntimeService and ImageService between the local servicers and the downstream."""

    def __init__(
        self,
        runtime: Any,
        images: Any,
        records: Records,
        downstream: Downstream,
        ids: DownstreamIds,
        local_handlers: Iterable[str],
        fronted: bool = False,
    ) -> None:
        self.runtime = runtime
        self.records = records
        self.downstream = downstream
        self.ids = ids
        self.local_handlers = frozenset(local_handlers)
        self.fronted = fronted  # the front (front/) reads the CRI socket: its headers are honoured
        self.images = ImageRouter(images, downstream, self.side_of_pod)
        self._service = pb.DESCRIPTOR.services_by_name["RuntimeService"]

    # -- registration ---------------------------------------------------------------------------
    def generic_handlers(self) -> list[Any]:
        runtime: dict[str, Any] = {}
        for method in self._service.methods:
            kind = routing.METHODS.get(method.name, Kind.LOCAL)
            if method.server_streaming:
                runtime[method.name] = self._local_stream(method)
                continue
            fn = self._route(method, kind)
            runtime[method.name] = grpc.unary_unary_rpc_method_handler(guarded(method.name, fn))
        images: dict[str, Any] = {}
        for method in pb.DESCRIPTOR.services_by_name["ImageService"].methods:
            if method.server_streaming:
                images[method.name] = self._local_stream(method, self.images.local)
                continue
            images[method.name] = grpc.unary_unary_rpc_method_handler(
                guarded(method.name, self.images.handler(method.name))
            )
        handlers = [
            grpc.method_handlers_generic_handler(RUNTIME, runtime),
            grpc.method_handlers_generic_handler(IMAGES, images),
        ]
        if self.fronted:
            saw = grpc.unary_unary_rpc_method_handler(guarded("SawList", self._saw_list))
            handlers.append(grpc.method_handlers_generic_handler(front_headers.SERVICE, {"SawList": saw}))
        return handlers

    def _local_stream(self, method: Any, servicer: Any = None) -> Any:
        request = message_factory.GetMessageClass(method.input_type)
        response = message_factory.GetMessageClass(method.output_type)
        return grpc.unary_stream_rpc_method_handler(
            getattr(servicer or self.runtime, method.name),
            request_deserializer=status.lenient(request),
            response_serializer=response.SerializeToString,
        )

    def local(self, name: str, data: bytes, context: grpc.ServicerContext) -> Any:
        """The local servicer's reply message (it aborts the call by itself on an error)."""
        method = self._service.methods_by_name[name]
        request = status.lenient(message_factory.GetMessageClass(method.input_type))(data)
        return getattr(self.runtime, name)(request, context)

    def local_list(self, name: str, data: bytes, context: Any) -> tuple[bytes, int | None]:
        """vmsandbox's own side of a list, for the front's list channel (``shim/front.py``), and the
        records' generation it holds for, unless a container's state waits on its guest's word."""
        generation = self.records.generation  # before the records are read
        reply: bytes = self.local(name, data, context).SerializeToString()
        settled = name == "ListPodSandbox" or self.runtime.pods.lists_settled()
        return reply, generation if settled else None

    def forward(self, name: str, data: bytes, context: grpc.ServicerContext, cap_s: float | None = None) -> bytes:
        failed = self._front_header(context, front_headers.DOWNSTREAM)
        if failed is not None:  # the front has just asked the downstream itself, and it failed
            raise DownstreamUnavailable(failed)
        return self.downstream.call(f"/{RUNTIME}/{name}", data, context, cap_s)

    def _front_header(self, context: grpc.ServicerContext, key: str) -> str | None:
        if not self.fronted:
            return None
        return front_headers.value(context.invocation_metadata(), key)

    def _tell_front_owner(self, context: grpc.ServicerContext, exact_id: str, downstream_ids: list[str]) -> None:
        """The front sends later calls naming this id straight to the downstream."""
        if self.fronted and downstream_ids == [exact_id]:
            context.send_initial_metadata(((front_headers.OWNER, "downstream"),))

    def _saw_list(self, data: bytes, context: grpc.ServicerContext) -> bytes:
        name = front_headers.value(context.invocation_metadata(), front_headers.LIST)
        if name not in LISTS:
            raise InvalidArgument(f"SawList: not a list the proxy keeps: {validation.quote(name or '')}")
        self.ids.saw_list(name, data)
        return b""

    def _route(self, method: Any, kind: Kind) -> Callable[[bytes, grpc.ServicerContext], bytes]:
        name = method.name
        request_cls = message_factory.GetMessageClass(method.input_type)

        def local(data: bytes, context: grpc.ServicerContext) -> bytes:
            reply: bytes = self.local(name, data, context).SerializeToString()
            return reply

        if kind == Kind.LOCAL:
            return local
        if kind == Kind.DOWNSTREAM:
            return lambda data, context: self.forward(name, data, context)
        if kind == Kind.HANDLER:
            return lambda data, context: self._by_handler(name, request_cls, data, context)
        if kind in (Kind.SANDBOX, Kind.CREATE):
            return lambda data, context: self._by_sandbox(name, request_cls, data, context)
        if kind == Kind.CONTAINER:
            return lambda data, context: self._by_container(name, request_cls, data, context)
        if kind == Kind.MERGE:
            return lambda data, context: self._merged(name, request_cls, data, context)
        if kind == Kind.BOTH:
            return lambda data, context: self._both(name, data, context)
        if kind == Kind.STATUS:
            return self._status
        raise AssertionError(f"no route for {name}")

    # -- routing ------------------------------------------------------------------------------
    def side_of_sandbox(self, prefix: str) -> Side | None:
        local = self.records.ids_with_prefix(prefix)
        routed = routing.route_id(prefix, local, self.ids.sandboxes_with_prefix(prefix), "pod sandbox")
        if routed.side is None or (routed.side == Side.LOCAL and prefix not in local):
            self._relist_for_miss(bool(local))
            routed = routing.route_id(prefix, local, self.ids.sandboxes_with_prefix(prefix), "pod sandbox")
        return routed.side

    def side_of_container(self, prefix: str) -> Side | None:
        local = self.records.container_ids_with_prefix(prefix)
        routed = routing.route_id(prefix, local, self.ids.containers_with_prefix(prefix), "container")
        if routed.side is None or (routed.side == Side.LOCAL and prefix not in local):
            self._relist_for_miss(bool(local))
            routed = routing.route_id(prefix, local, self.ids.containers_with_prefix(prefix), "container")
        return routed.side

    def _relist_for_miss(self, have_local: bool) -> None:
        """List the downstream once for an id the map does not hold: a downstream that cannot be
        listed makes an id unknown here its business (UNAVAILABLE), unless vmsandbox has it."""
        try:
            self.ids.relist()
        except DownstreamUnavailable:
            if not have_local:
                raise

    def side_of_pod(self, uid: str) -> Side | None:
        """The side whose sandbox belongs to the pod with this uid (PullImage's sandbox_config)."""
        if not uid:
            return None
        if any(r.meta.uid == uid for r in self.records.list_sandboxes()):
            return Side.LOCAL
        if self.ids.has_uid(uid):
            return Side.DOWNSTREAM
        try:
            self.ids.relist()
        except DownstreamUnavailable:
            return None
        return Side.DOWNSTREAM if self.ids.has_uid(uid) else None

    def _by_handler(self, name: str, cls: Any, data: bytes, context: grpc.ServicerContext) -> bytes:
        request = _parse(cls, data)
        if routing.side_for_handler(request.runtime_handler, self.local_handlers) == Side.LOCAL:
            reply: bytes = self.local(name, data, context).SerializeToString()
            return reply
        answer = self.forward(name, data, context)
        if name == "RunPodSandbox":
            sandbox_id = pb.RunPodSandboxResponse.FromString(answer).pod_sandbox_id
            self.ids.learn_sandbox(sandbox_id, request.config.metadata.uid)
        return answer

    def _by_sandbox(self, name: str, cls: Any, data: bytes, context: grpc.ServicerContext) -> bytes:
        request = _parse(cls, data)
        sandbox_id = request.pod_sandbox_id
        side = self.side_of_sandbox(sandbox_id) if sandbox_id else Side.LOCAL
        if name == "CreateContainer" and side is not None:
            self.images.ensure(side, request, context)  # its image in its own side's store
        if side != Side.DOWNSTREAM:  # an id neither side knows: vmsandbox answers as it always has
            reply: bytes = self.local(name, data, context).SerializeToString()
            return reply
        self._tell_front_owner(context, sandbox_id, self.ids.sandboxes_with_prefix(sandbox_id))
        answer = self.forward(name, data, context)
        if name == "CreateContainer":
            self.ids.learn_container(pb.CreateContainerResponse.FromString(answer).container_id, sandbox_id)
        elif name == "RemovePodSandbox":
            self.ids.forget_sandbox(sandbox_id)
        return answer

    def _by_container(self, name: str, cls: Any, data: bytes, context: grpc.ServicerContext) -> bytes:
        container_id = _parse(cls, data).container_id
        side = self.side_of_container(container_id) if container_id else Side.LOCAL
        if side != Side.DOWNSTREAM:
            reply: bytes = self.local(name, data, context).SerializeToString()
            return reply
        self._tell_front_owner(context, container_id, self.ids.containers_with_prefix(container_id))
        answer = self.forward(name, data, context)
        if name == "RemoveContainer":
            self.ids.forget_container(container_id)
        return answer

    def _list_side(self, name: str, f: Any) -> Side | None:
        """The one side a list's filter can match, when it names an id (prefix) only that side has."""
        if name in ("ListPodSandbox", "ListPodSandboxStats"):
            if f.id:
                return routing.filter_side(
                    f.id, self.records.ids_with_prefix(f.id), self.ids.sandboxes_with_prefix(f.id)
                )
        else:  # ListContainers, ListContainerStats: by container id, else by sandbox id
            if f.id:
                return routing.filter_side(
                    f.id, self.records.container_ids_with_prefix(f.id), self.ids.containers_with_prefix(f.id)
                )
            elif f.pod_sandbox_id:
                return routing.filter_side(
                    f.pod_sandbox_id,
                    self.records.ids_with_prefix(f.pod_sandbox_id),
                    self.ids.sandboxes_with_prefix(f.pod_sandbox_id),
                )
        return None

    def _merged(self, name: str, cls: Any, data: bytes, context: grpc.ServicerContext) -> bytes:
        request = _parse(cls, data)
        # ListPodSandboxMetrics has no filter: both sides' pods
        f = request.filter if "filter" in cls.DESCRIPTOR.fields_by_name else None
        side = self._list_side(name, f) if f is not None else None
        if side == Side.LOCAL or self._front_header(context, front_headers.SIDE) == Side.LOCAL.value:
            reply: bytes = self.local(name, data, context).SerializeToString()
            return reply
        if side == Side.DOWNSTREAM:
            return self.forward(name, data, context)
        mine: bytes = self.local(name, data, context).SerializeToString()
        if name not in LISTS or f is None:
            return self.forward(name, data, context) + mine  # concatenated messages: repeated fields appended
        try:
            theirs = self.forward(name, data, context)
        except DownstreamUnavailable as exc:
            # the downstream's pods as it last listed them: leaving them out would tell the kubelet
            # they are gone, and failing the list would stop its PLEG (the node NotReady in 3 min)
            last = self.ids.last_listed(name, list_filter(f))
            if last is None:
                raise
            log.warning("%s: %s; its side as it last listed it", name, exc)
            return last + mine
        if f.ByteSize() == 0:  # what the kubelet's PLEG asks every second: the whole list
            self.ids.saw_list(name, theirs)
        return theirs + mine

    def _both(self, name: str, data: bytes, context: grpc.ServicerContext) -> bytes:
        self.local(name, data, context)
        return self.forward(name, data, context)

    def _status(self, data: bytes, context: grpc.ServicerContext) -> bytes:
        mine = self.local("Status", data, context)
        merged = pb.StatusResponse()
        merged.CopyFrom(mine)
        try:
            theirs = pb.StatusResponse.FromString(self.forward("Status", data, context, STATUS_CAP_S))
        except (DownstreamUnavailable, Forwarded) as exc:
            for kind in ("RuntimeReady", "NetworkReady"):
                merged.status.conditions.add(
                    type=f"Downstream{kind}",
                    status=False,
                    reason="DownstreamUnavailable",
                    message=validation.bound(str(exc)),
                )
            merged.info["downstream"] = json.dumps({"endpoint": self.downstream.endpoint, "ready": False})
            out: bytes = merged.SerializeToString()
            return out
        # RuntimeReady and NetworkReady stay vmsandbox's (what the kubelet acts on for the node);
        # the downstream's conditions follow under their own names
        for c in theirs.status.conditions:
            merged.status.conditions.add(
                type=f"Downstream{c.type}", status=c.status, reason=c.reason, message=c.message
            )
        for key, value in theirs.info.items():
            if key not in merged.info:
                merged.info[key] = value
        known = {h.name for h in merged.runtime_handlers}
        for h in theirs.runtime_handlers:
            if h.name not in known:
                merged.runtime_handlers.add().CopyFrom(h)
        if not any(h.name == "" for h in theirs.runtime_handlers) and "" not in known:
            merged.runtime_handlers.add(name="")  # the default handler is the downstream's
        ready = all(c.status for c in theirs.status.conditions if c.type in ("RuntimeReady", "NetworkReady"))
        merged.info["downstream"] = json.dumps({"endpoint": self.downstream.endpoint, "ready": ready})
        out = merged.SerializeToString()
        return out
