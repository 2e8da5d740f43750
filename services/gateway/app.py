"""The gateway's HTTP app: /generate, health and readiness, metrics, stats,
and the OpenAI-compatible API (openai_api.py); and the metrics-only app
served on METRICS_PORT when it is set."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware import Middleware

from common.types import Usage
from common.version import package_version
from services.gateway.doors import lora_api
from services.gateway.doors import openai_api
from services.gateway.doors import tokenize_api
from services.gateway.responses import api as responses_api
from services.gateway.requests.backend import BackendError, SchedulerBackend
from services.gateway.drain import Drain, DrainMiddleware
from services.gateway.errors import (
    INVALID_REQUEST,
    ApiError,
    bad_request,
    from_backend,
    method_not_allowed,
    not_found,
    server_error,
    unavailable,
)
from services.gateway.streaming.generation import GenerationService, TextDelta
from services.gateway.models.lora_catalog import with_adapter
from services.gateway.observability.metrics import GatewayMetrics
from services.gateway.observability.request_span import RequestSpanMiddleware
from services.gateway.middleware import (
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    InFlightLimitMiddleware,
    JsonBodyMiddleware,
    RequestContextMiddleware,
)
from services.gateway.requests.schemas import GenerateBody
from services.gateway.settings import GatewaySettings
from services.gateway.requests.spec import RequestFields, TextInput
from services.gateway.tenancy.stats_view import (
    dependencies_view,
    kvcache_view,
    scheduler_view,
    stats_scope,
)
from services.gateway.requests.structured import body_constraint
from services.gateway.doors.sse import event_stream, sse_data
from services.gateway.state import (
    GatewayState,
    prime,
    scheduler_request_id,
    until_disconnected,
)
from services.gateway.tenancy.tenant_quota import TenantQuotas
from services.gateway.tenancy.tenant_trackers import TenantTrackers
from services.gateway.tenancy.tenants import Tenant
from services.gateway.requests.unsupported import reject_unsupported
from services.gateway.requests.validation import SamplingInput

log = logging.getLogger(__name__)
router = APIRouter()
# The checkout's dashboard/, or the copy an installed package carries (setup.py: fairserve.dashboard).
_CHECKOUT_DASHBOARD = Path(__file__).resolve().parents[2] / "dashboard"
DASHBOARD_DIR = (_CHECKOUT_DASHBOARD if _CHECKOUT_DASHBOARD.is_dir()
                 else Path(__file__).resolve().parents[2] / "fairserve" / "dashboard")
STATS_PART_TIMEOUT_S = 3.0
# FastAPI's own OpenTelemetry would continue a client's traceparent and record
# request data; the gateway's spans are request_span.py's and tracing's own.
NO_FASTAPI_TELEMETRY = {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}


def create_app(settings: GatewaySettings, scheduler_client: SchedulerBackend, tokenizer: Any,
               registry: CollectorRegistry | None = None) -> FastAPI:
    registry = registry if registry is not None else CollectorRegistry()
    metrics = GatewayMetrics(registry, settings.model_id)
    quotas = TenantQuotas(settings.tenants.tenants)
    service = GenerationService(scheduler_client, tokenizer, metrics, quotas=quotas,
                                scheduler_recovery_s=settings.scheduler_recovery_s,
                                tenant_trackers=TenantTrackers(
                                    tenant.name for tenant in settings.tenants.tenants))
    drain = Drain()
    app = FastAPI(
        title="fairserve gateway",
        version="1",
        telemetry=NO_FASTAPI_TELEMETRY,
        middleware=[
            Middleware(RequestContextMiddleware, metrics=metrics),
            Middleware(RequestSpanMiddleware),
            Middleware(InFlightLimitMiddleware, limit=settings.max_connections),
            Middleware(DrainMiddleware, drain=drain),
            Middleware(ApiKeyMiddleware, tenants=settings.tenants),
            Middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes,
                       timeout_s=settings.body_timeout_s),
            Middleware(JsonBodyMiddleware),
        ],
    )
    app.state.gateway = GatewayState(settings, scheduler_client, tokenizer, service, metrics, drain,
                                     quotas)
    log.info("prompt length bound", extra={    # both computed once, here
        "longest_token_chars": app.state.gateway.longest_token_chars,
        "prompt_prefixes": app.state.gateway.prompt_prefixes.enabled})
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(openai_api.router)
    app.include_router(responses_api.router)
    app.include_router(tokenize_api.router)
    app.include_router(lora_api.router)
    app.mount("/dashboard", StaticFiles(directory=DASHBOARD_DIR, html=True), name="dashboard")
    return app


def create_metrics_app(state: GatewayState) -> FastAPI:
    """/metrics alone, for METRICS_PORT: the public app then answers 404 there."""
    app = FastAPI(title="fairserve gateway metrics", version="1", openapi_url=None,
                  docs_url=None, redoc_url=None, telemetry=NO_FASTAPI_TELEMETRY)
    app.state.gateway = state
    app.add_api_route("/metrics", prometheus_metrics, methods=["GET"])
    return app


def gateway_state(request: Request) -> GatewayState:
    return request.app.state.gateway


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def on_api_error(_request: Request, error: ApiError) -> Response:
        return api_error_response(error)

    @app.exception_handler(BackendError)
    async def on_backend_error(_request: Request, error: BackendError) -> Response:
        return api_error_response(from_backend(error))

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_request: Request, error: RequestValidationError) -> Response:
        return api_error_response(validation_api_error(error))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, error: StarletteHTTPException) -> Response:
        if error.status_code == 404:
            return api_error_response(not_found(request.url.path))
        if error.status_code == 405:
            api_error = method_not_allowed(request.method, request.url.path)
            api_error.headers = dict(error.headers or {})
            return api_error_response(api_error)
        return api_error_response(ApiError(error.status_code, str(error.detail), INVALID_REQUEST,
                                           headers=dict(error.headers or {})))

    @app.exception_handler(Exception)
    async def on_unexpected(_request: Request, error: Exception) -> Response:
        log.exception("unhandled error")
        return api_error_response(server_error("Internal error."))


def api_error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=dict(error.headers))


def validation_api_error(error: RequestValidationError) -> ApiError:
    problems = error.errors()
    if any(problem.get("type") == "json_invalid" for problem in problems):
        return bad_request("The request body is not valid JSON.", None, "invalid_json")
    first = problems[0] if problems else {}
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    detail = "; ".join(
        f"{'.'.join(str(p) for p in problem.get('loc', ()) if p != 'body') or 'body'}: "
        f"{problem.get('msg', 'invalid')}" for problem in problems[:5])
    return ApiError(422, f"Invalid request: {detail}", INVALID_REQUEST, param, "validation_error")


def request_identity(request: Request) -> tuple[str, bool, Tenant | None]:
    """(request id, whether the client supplied it, the API key's tenant if any)."""
    state = request.state
    return (getattr(state, "request_id", ""), bool(getattr(state, "request_id_supplied", False)),
            getattr(state, "tenant", None))


def usage_dict(usage: Usage) -> dict[str, int]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "cached_tokens": usage.cached_tokens}


@router.get("/health")
async def health(request: Request) -> dict[str, Any]:
    """Alive: always 200. `degraded` names the services behind the gateway that
    did not answer its latest probe (it never waits for one)."""
    return {"status": "ok", "degraded": gateway_state(request).dependencies.degraded_now()}


@router.get("/version")
async def version() -> dict[str, str]:
    """vLLM's /version: the fairserve package's version (behind API keys when they are set)."""
    return {"version": package_version()}


@router.get("/ready", responses={503: {"description": "not ready, with the reason"}})
async def ready(request: Request) -> Response:
    if gateway_state(request).drain.draining:
        return api_error_response(unavailable("the gateway is shutting down"))
    readiness = await gateway_state(request).dependencies.probe()
    if not readiness.ready:
        return api_error_response(unavailable(readiness.reason))
    return JSONResponse({"status": "ready"})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus metrics; with METRICS_PORT set, served there only (404 here)."""
    if gateway_state(request).settings.metrics_port:
        raise not_found(request.url.path)
    return await prometheus_metrics(request)


async def prometheus_metrics(request: Request) -> Response:
    state = gateway_state(request)
    await state.dependencies.recent()     # fresh dependency_up gauges
    await state.metrics.vllm.refresh(lambda: scheduler_details(state.backend))  # vLLM's engine gauges
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/stats")
async def stats(request: Request) -> Response:
    """The live page's feed (schema: docs/metrics.md). A service that does
    not answer gives null for its part; the answer is still 200. With API
    keys a tenant sees only its own and the shared parts (stats_view.py)."""
    state = gateway_state(request)
    scope = stats_scope(request_identity(request)[2], state.settings.tenants.enabled)
    scheduler, kvcache, readiness = await asyncio.gather(
        stats_part("scheduler", scheduler_details(state.backend)),
        stats_part("kvcache", state.backend.kvcache_stats()), state.dependencies.recent())
    gateway = (state.service.tracker.snapshot() if scope.everything
               else state.service.tenant_trackers.snapshot(scope.tenant or ""))
    return JSONResponse({"ts": time.time(), "gateway": gateway,
                         "scheduler": scheduler_view(scheduler, scope),
                         "kvcache": kvcache_view(kvcache, scope),
                         "dependencies": dependencies_view(dict(readiness.dependencies))})


async def scheduler_details(backend: SchedulerBackend) -> dict[str, Any]:
    return (await backend.scheduler_stats()).details


async def stats_part(name: str, part: Awaitable[dict[str, Any]]) -> dict[str, Any] | None:
    try:
        return await asyncio.wait_for(part, STATS_PART_TIMEOUT_S)
    except (BackendError, TimeoutError) as error:
        log.debug("stats part unavailable", extra={"part": name, "error": str(error)})
        return None


@router.get("/", include_in_schema=False)
async def root() -> Response:
    return RedirectResponse("/dashboard/")


def generate_input(body: GenerateBody) -> TextInput:
    """What a /generate body asks for, in the text API's terms."""
    sampling = SamplingInput(
        temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
        repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, seed=body.seed)
    return TextInput(prompt=body.prompt, raw=body.raw, fields=RequestFields(
        sampling=sampling, default_temperature=0.0, max_tokens=body.max_tokens, stop=body.stop,
        ignore_eos=body.ignore_eos, min_tokens=body.min_tokens, priority=body.priority,
        session_id=body.session_id, user=body.user, requested_stop_token_ids=body.stop_token_ids,
        logit_bias=body.logit_bias, kv_policy=body.kv_policy, **body_constraint(body)))


@router.post("/generate", responses={
    200: {"description": "JSON {text, finish_reason, usage}, or with stream an SSE stream of "
                         "{token, token_id} events whose last one carries finish_reason and usage"},
    400: {"description": "bad values"}, 429: {"description": "queue full"},
    503: {"description": "not ready"}})
async def generate(body: GenerateBody, request: Request) -> Response:
    state = gateway_state(request)
    request_id, supplied, tenant = request_identity(request)
    reject_unsupported(body.model_extra)
    adapter = state.adapter_for(body.model, tenant)     # a served name, an adapter, else 404
    spec = with_adapter(await state.text_spec(generate_input(body), tenant), adapter)
    scheduler_id = scheduler_request_id(request_id, 0, supplied)
    try:
        if body.stream:
            stream = state.service.stream(spec, scheduler_id, request_id)
            return event_stream(generate_events(await prime(stream, request)))
        result = await until_disconnected(
            request, state.service.complete(spec, scheduler_id, request_id))
    except BackendError as error:
        raise from_backend(error) from None
    return JSONResponse({"text": result.text, "finish_reason": result.finish_reason,
                         "usage": usage_dict(result.usage)})


async def generate_events(deltas: AsyncIterator[TextDelta]) -> AsyncIterator[bytes]:
    try:
        async for delta in deltas:
            if delta.finish_reason is not None:
                yield sse_data({"token": delta.text, "finish_reason": delta.finish_reason,
                                "usage": usage_dict(delta.usage or Usage(0, 0, 0))})
                return
            for position, token in enumerate(delta.tokens):
                yield sse_data({"token": delta.text if position == 0 else "",
                                "token_id": token.token_id})
    except BackendError as error:
        yield sse_data(from_backend(error).body())

