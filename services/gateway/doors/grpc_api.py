"""The gateway's gRPC text API (fairserve.v1.TextGeneration): text in, text
out, with the same parameters, validation, API keys, tenants and fairness as
the HTTP API. Bytes that are no TextRequest are INVALID_ARGUMENT, not the
UNKNOWN grpc would answer (add_to_server)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError

from common.transport.grpc_server import REQUEST_ID_KEY
from common.observability.logs import request_id_var
from fairserve.v1 import gateway_pb2, gateway_pb2_grpc
from services.gateway import convert
from services.gateway.tenancy.api_keys import metadata_key
from services.gateway.requests.backend import BackendError, GenerationSpec
from services.gateway.errors import ApiError, bad_request, from_backend, unauthorized
from services.gateway.models.lora_catalog import with_adapter
from services.gateway.request_ids import client_request_id
from services.gateway.settings import GatewaySettings
from services.gateway.state import GatewayState, scheduler_request_id
from services.gateway.tenancy.tenants import Tenant

SERVICE_NAME = "fairserve.v1.TextGeneration"
_STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,       # `model` names nothing the caller may use
    413: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}


GRPC_IDLE_CONNECTION_S = 300   # a connection with no call for this long is closed


def public_grpc_limits(settings: GatewaySettings) -> dict[str, Any]:
    """GrpcServer's arguments for the public port's limits: its message size,
    connections, streams per connection and calls at once, and the handshake
    deadline and metadata size of the HTTP door's headers."""
    return {"max_receive_bytes": settings.grpc_max_message_bytes,
            "max_concurrent_rpcs": settings.grpc_max_concurrent_rpcs,
            "options": [
                ("grpc.max_allowed_incoming_connections", settings.grpc_max_connections),
                ("grpc.max_concurrent_streams", settings.grpc_max_streams_per_connection),
                ("grpc.max_connection_idle_ms", GRPC_IDLE_CONNECTION_S * 1000),
                ("grpc.server_handshake_timeout_ms", int(settings.header_timeout_s * 1000)),
                ("grpc.max_metadata_size", settings.max_header_bytes)]}


class TextGenerationServicer(gateway_pb2_grpc.TextGenerationServicer):
    def __init__(self, state: GatewayState) -> None:
        self._state = state

    async def Generate(self, request: gateway_pb2.TextRequest | None,
                       context: grpc.aio.ServicerContext) -> gateway_pb2.TextResponse:
        try:
            with self._state.drain.generation():
                spec, request_id, trace_id = await self._prepare(request, context)
                result = await self._state.service.complete(spec, request_id, trace_id)
        except ApiError as error:
            await _abort(context, error)
        except BackendError as error:
            await _abort(context, from_backend(error))
        return convert.text_response_to_proto(result.text, result.finish_reason, result.usage)

    async def GenerateStream(self, request: gateway_pb2.TextRequest | None,
                             context: grpc.aio.ServicerContext
                             ) -> AsyncIterator[gateway_pb2.TextChunk]:
        try:
            with self._state.drain.generation():
                spec, request_id, trace_id = await self._prepare(request, context)
                deltas = self._state.service.stream(spec, request_id, trace_id)
                async with aclosing(deltas):
                    async for delta in deltas:
                        yield convert.text_chunk_to_proto(
                            delta.text, tuple(token.token_id for token in delta.tokens),
                            delta.finish_reason, delta.usage)
        except ApiError as error:
            await _abort(context, error)
        except BackendError as error:
            await _abort(context, from_backend(error))

    async def _prepare(self, request: gateway_pb2.TextRequest | None,
                       context: grpc.aio.ServicerContext) -> tuple[GenerationSpec, str, str]:
        tenant = self._authenticate(context)
        supplied = _request_id(context)
        trace_id = supplied or uuid.uuid4().hex
        request_id_var.set(trace_id)
        if request is None:
            raise bad_request("The request is not a valid fairserve.v1.TextRequest.", None,
                              "invalid_message")
        adapter = self._state.adapter_for(request.model, tenant)   # a served name, an adapter, else 404
        spec = with_adapter(await self._state.text_spec(convert.text_input_from_proto(request), tenant), adapter)
        return spec, scheduler_request_id(trace_id, 0, supplied is not None), trace_id

    def _authenticate(self, context: grpc.aio.ServicerContext) -> Tenant | None:
        """The key's tenant, as over HTTP (Authorization: Bearer, or x-api-key)."""
        tenants = self._state.settings.tenants
        if not tenants.enabled:
            return None
        tenant = tenants.authenticate(metadata_key(context.invocation_metadata()))
        if tenant is None:
            raise unauthorized()
        return tenant


def _request_id(context: grpc.aio.ServicerContext) -> str | None:
    """The client's x-request-id when it is a valid one (request_ids.py), else None."""
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_KEY:
            return client_request_id(value)
    return None


def _parse_text_request(data: bytes) -> gateway_pb2.TextRequest | None:
    """None for bytes that do not parse (the servicer answers INVALID_ARGUMENT)."""
    try:
        return gateway_pb2.TextRequest.FromString(data)
    except DecodeError:
        return None


def add_to_server(servicer: TextGenerationServicer, server: grpc.aio.Server) -> None:
    """Registers the service like the generated add_TextGenerationServicer_to_server,
    with a request parser that lets the servicer refuse malformed bytes."""
    handlers = {
        "Generate": grpc.unary_unary_rpc_method_handler(
            servicer.Generate, request_deserializer=_parse_text_request,
            response_serializer=gateway_pb2.TextResponse.SerializeToString),
        "GenerateStream": grpc.unary_stream_rpc_method_handler(
            servicer.GenerateStream, request_deserializer=_parse_text_request,
            response_serializer=gateway_pb2.TextChunk.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


async def _abort(context: grpc.aio.ServicerContext, error: ApiError) -> NoReturn:
    retry_after = error.headers.get("Retry-After")
    if retry_after:
        context.set_trailing_metadata((("retry-after", retry_after),))
    await context.abort(_STATUS_CODES.get(error.status, grpc.StatusCode.INTERNAL), error.message)
    raise AssertionError("context.abort returns only by raising")
