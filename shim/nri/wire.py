"""ttrpc's request and response messages (``gen.nri.ttrpc_pb2``) in and out of frames.

``vmsandbox.ttrpc`` frames bytes; this module is where ttrpc's protobufs meet them. A unary
call's request carries no flags, as ttrpc's Client.Call sends it (FLAG_REMOTE_* are for
streams); an error travels as google.rpc.Status with a gRPC code.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.message import DecodeError

from gen.nri import rpc_status_pb2, ttrpc_pb2
from vmsandbox import ttrpc


@dataclass(frozen=True)
class Request:
    service: str
    method: str
    payload: bytes
    timeout_ns: int = 0


@dataclass(frozen=True)
class Response:
    code: int
    message: str
    payload: bytes


def request_frame(stream_id: int, request: Request) -> ttrpc.Frame:
    msg = ttrpc_pb2.Request(
        service=request.service, method=request.method, payload=request.payload, timeout_nano=request.timeout_ns
    )
    return ttrpc.Frame(stream_id, ttrpc.TYPE_REQUEST, 0, msg.SerializeToString())


def response_frame(stream_id: int, response: Response) -> ttrpc.Frame:
    msg = ttrpc_pb2.Response(payload=response.payload)
    if response.code != ttrpc.OK:
        msg.status.CopyFrom(rpc_status_pb2.Status(code=response.code, message=response.message))
    return ttrpc.Frame(stream_id, ttrpc.TYPE_RESPONSE, 0, msg.SerializeToString())


def parse_request(frame: ttrpc.Frame) -> Request:
    if frame.type != ttrpc.TYPE_REQUEST:
        raise ttrpc.ProtocolError(f"expected a ttrpc request, got message type {frame.type}")
    msg = ttrpc_pb2.Request()
    try:
        msg.ParseFromString(frame.payload)
    except DecodeError as e:
        raise ttrpc.ProtocolError(f"malformed ttrpc request: {e}") from None
    return Request(msg.service, msg.method, msg.payload, msg.timeout_nano)


def parse_response(frame: ttrpc.Frame) -> Response:
    if frame.type != ttrpc.TYPE_RESPONSE:
        raise ttrpc.ProtocolError(f"expected a ttrpc response, got message type {frame.type}")
    msg = ttrpc_pb2.Response()
    try:
        msg.ParseFromString(frame.payload)
    except DecodeError as e:
        raise ttrpc.ProtocolError(f"malformed ttrpc response: {e}") from None
    return Response(msg.status.code, msg.status.message, msg.payload)
