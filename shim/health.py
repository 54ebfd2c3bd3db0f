"""The standard gRPC health checking service (``grpc.health.v1.Health``) on the CRI socket.

Overall health ("") and each CRI service report SERVING once the server has started, and
NOT_SERVING from the moment it begins shutting down.
"""

from __future__ import annotations

from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

SERVICES = ("", "runtime.v1.RuntimeService", "runtime.v1.ImageService")


class Health:
    def __init__(self, server: grpc.Server) -> None:
        self._servicer: Any = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)

    def serving(self) -> None:
        for name in SERVICES:
            self._servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    def shutting_down(self) -> None:
        self._servicer.enter_graceful_shutdown()
