"""The gateway's gRPC text API (fairserve.v1.TextGeneration): text in, text
out, with the same parameters, validation, API keys, tenants and fairness as
the HTTP API."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import NoReturn

import grpc

from common.grpc_server import request_id_from
from common.logs import request_id_var
from fairserve.v1 import gateway_pb2, gateway_pb2_grpc
from services.gateway import convert
from services.gateway.api_keys import metadata_key
from services.gateway.backend import BackendError, GenerationSpec
from services.gateway.errors import ApiError, from_backend, unauthorized
from services.gateway.state import GatewayState, scheduler_request_id
from services.gateway.tenants import Tenant

SERVICE_NAME = "fairserve.v1.TextGeneration"
_STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}


class TextGenerationServicer(gateway_pb2_grpc.TextGenerationServicer):
    def __init__(self, state: GatewayState) -> None:
        self._state = state

    async def Generate(self, request: gateway_pb2.TextRequest,
                       context: grpc.aio.ServicerContext) -> gateway_pb2.TextResponse:
        try:
            spec, request_id, trace_id = await self._prepare(request, context)
            result = await self._state.service.complete(spec, request_id, trace_id)
        except ApiError as error:
            await _abort(context, error)
        except BackendError as error:
            await _abort(context, from_backend(error))
        return convert.text_response_to_proto(result.text, result.finish_reason, result.usage)

    async def GenerateStream(self, request: gateway_pb2.TextRequest,
                             context: grpc.aio.ServicerContext
                             ) -> AsyncIterator[gateway_pb2.TextChunk]:
        try:
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

    async def _prepare(self, request: gateway_pb2.TextRequest,
                       context: grpc.aio.ServicerContext) -> tuple[GenerationSpec, str, str]:
        tenant = self._authenticate(context)
        supplied = request_id_from(context)
        trace_id = supplied or uuid.uuid4().hex
        request_id_var.set(trace_id)
        spec = await self._state.text_spec(convert.text_input_from_proto(request), tenant)
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


async def _abort(context: grpc.aio.ServicerContext, error: ApiError) -> NoReturn:
    retry_after = error.headers.get("Retry-After")
    if retry_after:
        context.set_trailing_metadata((("retry-after", retry_after),))
    await context.abort(_STATUS_CODES.get(error.status, grpc.StatusCode.INTERNAL), error.message)
    raise AssertionError("context.abort returns only by raising")
