"""gRPC server bootstrap shared by every service: health, reflection, and
request-id propagation through metadata."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.logs import request_id_var

REQUEST_ID_KEY = "x-request-id"
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]

log = logging.getLogger(__name__)

Registration = tuple[Callable[[Any, grpc.aio.Server], None], Any]


class GrpcServer:
    """An aio server with the standard health service and reflection."""

    def __init__(self, registrations: Iterable[Registration], service_names: Sequence[str],
                 host: str, port: int) -> None:
        self.server = grpc.aio.server(options=CHANNEL_OPTIONS)
        for add, servicer in registrations:
            add(servicer, self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._service_names = list(service_names)
        reflection.enable_server_reflection(
            [*self._service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"could not bind gRPC server to {host}:{port}")

    async def start(self) -> None:
        await self.server.start()

    async def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ["", *self._service_names]:
            await self.health.set(name, status)

    async def stop(self, grace_s: float = 2.0) -> None:
        await self.set_serving(False)
        await self.server.stop(grace_s)

    async def wait(self) -> None:
        await self.server.wait_for_termination()


def request_id_from(context: grpc.aio.ServicerContext) -> str | None:
    """Reads the request id from incoming metadata and binds it to the logs."""
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_KEY:
            request_id_var.set(value)
            return value
    return None


def request_metadata(request_id: str | None) -> tuple[tuple[str, str], ...]:
    return ((REQUEST_ID_KEY, request_id),) if request_id else ()


def insecure_channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


async def check_health(channel: grpc.aio.Channel, service: str = "", timeout_s: float = 1.0) -> bool:
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    except grpc.aio.AioRpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING
