"""gRPC server bootstrap shared by every service: health, reflection, the
internal token and TLS (`common.transport.internal_auth`), the one builder of internal
channels, and request-id propagation through metadata."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.transport.internal_auth import (
    InternalAuth, TokenCheck, channel_credentials, channel_options, server_credentials, token_interceptors,
)
from common.observability.logs import request_id_var

REQUEST_ID_KEY = "x-request-id"
# Trailing metadata on the scheduler's refusals of a request (its value: the gate):
# an UNAVAILABLE status without it is a lost connection, not a refusal.
REJECTION_KEY = "x-fairserve-rejection"
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
MAX_RECONNECT_BACKOFF_MS = 2000
# gRPC core holds the calls that arrived before the server's loop picked them up, and past
# 1,000 of them (3,000 for certain) it cancels new ones at random: a burst of 4,096 Generate
# streams lost two thirds with a bare CANCELLED before the scheduler saw them. An internal
# service admits its calls itself (the scheduler's queue limits answer 429-like refusals
# that name their gate), so its servers take every call that arrives; only the gateway's
# public port, capped by max_concurrent_rpcs, keeps core's limits.
PENDING_CALLS = 1 << 20
INTERNAL_SERVER_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.server.max_pending_requests", PENDING_CALLS),
    ("grpc.server.max_pending_requests_hard_limit", PENDING_CALLS),
]
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # A service that restarts is dialled again within this (gRPC's default
    # backoff grows to two minutes, far longer than a restart takes).
    ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
]

log = logging.getLogger(__name__)

Registration = tuple[Callable[[Any, grpc.aio.Server], None], Any]


class GrpcServer:
    """An aio server with the standard health service and reflection. With
    `auth` (the internal services), calls need its token (health excepted) and
    the port serves its TLS; without (the gateway's public API), neither.
    max_receive_bytes lowers the largest request message it takes, `options`
    add the channel arguments and max_concurrent_rpcs caps the calls at once
    (past it, RESOURCE_EXHAUSTED) of the gateway's public port; without it every call that
    arrives is taken (INTERNAL_SERVER_OPTIONS). `interceptors`
    run after the token's check (a role's token: common/transport/worker_auth.py)."""

    def __init__(self, registrations: Iterable[Registration], service_names: Sequence[str],
                 host: str, port: int, auth: InternalAuth | None = None,
                 max_receive_bytes: int | None = None,
                 interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                 options: Sequence[tuple[str, Any]] = (),
                 max_concurrent_rpcs: int | None = None) -> None:
        interceptors = [*([TokenCheck(auth.token)] if auth is not None and auth.token else []),
                        *interceptors]
        server_options = CHANNEL_OPTIONS if max_receive_bytes is None else [
            *(option for option in CHANNEL_OPTIONS if option[0] != "grpc.max_receive_message_length"),
            ("grpc.max_receive_message_length", max_receive_bytes)]
        if max_concurrent_rpcs is None:
            server_options = [*server_options, *INTERNAL_SERVER_OPTIONS]
        self.server = grpc.aio.server(options=[*server_options, *options], interceptors=interceptors,
                                      maximum_concurrent_rpcs=max_concurrent_rpcs)
        for add, servicer in registrations:
            add(servicer, self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._service_names = list(service_names)
        reflection.enable_server_reflection(
            [*self._service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )
        credentials = server_credentials(auth) if auth is not None else None
        if credentials is None:
            self.port = self.server.add_insecure_port(f"{host}:{port}")
        else:
            self.port = self.server.add_secure_port(f"{host}:{port}", credentials)
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


def internal_channel(address: str, auth: InternalAuth = InternalAuth(),
                     interceptors: Sequence[grpc.aio.ClientInterceptor] = ()) -> grpc.aio.Channel:
    """The one way to dial a scheduler, worker or kvcache service: TLS when
    configured, and the internal token on every call (and what `interceptors`
    add: a worker's own token, common/transport/worker_auth.py)."""
    interceptors = [*token_interceptors(auth.token), *interceptors]
    credentials = channel_credentials(auth)
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS, interceptors=interceptors)
    return grpc.aio.secure_channel(address, credentials, options=[*CHANNEL_OPTIONS, *channel_options(auth)],
                                   interceptors=interceptors)


def insecure_channel(address: str) -> grpc.aio.Channel:
    """A plaintext channel without the token (tests, and servers built without auth)."""
    return internal_channel(address)


def blocking_channel(address: str, auth: InternalAuth = InternalAuth()) -> grpc.Channel:
    """A synchronous channel with the internal TLS but without the token, for
    health probes (the health service is open)."""
    credentials = channel_credentials(auth)
    if credentials is None:
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.secure_channel(address, credentials, options=[*CHANNEL_OPTIONS, *channel_options(auth)])


async def check_health(channel: grpc.aio.Channel, service: str = "", timeout_s: float = 1.0) -> bool:
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    except grpc.aio.AioRpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING
