"""ASGI middleware: request ids and timing logs, requests in flight, API keys,
body size and time limits.

They are plain ASGI (not BaseHTTPMiddleware) so streaming responses and
disconnect messages pass through untouched.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any, NoReturn

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.observability.logs import request_id_var
from common.observability.tracing import forget_trace
from services.gateway.tenancy.api_keys import presented_key
from services.gateway.errors import (
    ApiError,
    bad_request,
    body_timeout,
    too_large,
    unauthorized,
    unavailable,
)
from services.gateway.observability.metrics import GatewayMetrics
from services.gateway.request_ids import client_request_id
from services.gateway.tenancy.tenants import TenantRegistry

log = logging.getLogger("services.gateway.access")
REQUEST_ID_HEADER = b"x-request-id"
OPEN_PATHS = ("/health", "/ready", "/metrics", "/docs", "/redoc", "/openapi.json")


def header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def scope_state(scope: Scope) -> dict[str, Any]:
    return scope.setdefault("state", {})


async def send_error(send: Send, error: ApiError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(key.lower().encode(), value.encode()) for key, value in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class RequestContextMiddleware:
    """Sets the request id (from a valid X-Request-ID, else new: request_ids.py),
    returns it in the response header, logs one JSON line per request and counts it."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        supplied = client_request_id(header(scope, REQUEST_ID_HEADER))
        request_id = supplied or uuid.uuid4().hex
        state = scope_state(scope)
        state["request_id"] = request_id
        state["request_id_supplied"] = supplied is not None
        token = request_id_var.set(request_id)
        started = time.perf_counter()
        status = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [item for item in message.get("headers", [])
                           if item[0].lower() != REQUEST_ID_HEADER]
                message = {**message, "headers": [*headers, (REQUEST_ID_HEADER, request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            duration = time.perf_counter() - started
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            self.metrics.requests.labels(route=route, method=scope["method"], status=str(status)).inc()
            self.metrics.request_duration.labels(route=route).observe(duration)
            log.info("request", extra={"method": scope["method"], "path": scope["path"],
                                       "status": status, "duration_ms": round(duration * 1000, 3)})
            forget_trace(request_id)   # its trace id stays out of later lines under a reused id
            request_id_var.reset(token)


class InFlightLimitMiddleware:
    """At most `limit` HTTP requests in flight (their headers arrived, their
    response not yet sent); past it, 503 with Retry-After. Connections still
    waiting for headers are capped apart (http_limits.py)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.limit:
            await send_error(send, unavailable(
                f"The gateway is at its limit of {self.limit} requests in flight.", 1))
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


class ApiKeyMiddleware:
    """With API_KEYS set, every API route needs `Authorization: Bearer <key>`
    (or `x-api-key`); health, readiness and metrics stay open. The request's
    state gets the key's tenant (`tenant`), never the key."""

    def __init__(self, app: ASGIApp, tenants: TenantRegistry) -> None:
        self.app = app
        self.tenants = tenants

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.tenants.enabled:
            await self.app(scope, receive, send)
            return
        tenant = self.tenants.authenticate(presented_key(scope.get("headers", ())))
        if tenant is None and scope["path"] not in OPEN_PATHS:
            await send_error(send, unauthorized())
            return
        if tenant is not None:
            scope_state(scope)["tenant"] = tenant
        await self.app(scope, receive, send)


class _BodyRefused(Exception):
    def __init__(self, error: ApiError) -> None:
        super().__init__(error.message)
        self.error = error


class _BodyReader:
    """The app's receive, held to the size limit and the time limit until the
    body is complete; after that (waiting for a disconnect) it is left alone."""

    def __init__(self, receive: Receive, max_bytes: int, timeout_s: float) -> None:
        self._receive = receive
        self._max_bytes = max_bytes
        self._timeout_s = timeout_s
        self._deadline = time.monotonic() + timeout_s
        self._received = 0
        self._complete = False
        self.refusal: ApiError | None = None

    def _refuse(self, error: ApiError) -> NoReturn:
        self.refusal = error
        raise _BodyRefused(error)

    async def __call__(self) -> Message:
        if self._complete:
            return await self._receive()
        try:
            async with asyncio.timeout(self._deadline - time.monotonic()):
                message = await self._receive()
        except TimeoutError:
            self._refuse(body_timeout(self._timeout_s))
        if message["type"] == "http.request":
            self._received += len(message.get("body", b""))
            if self._received > self._max_bytes:
                self._refuse(too_large(self._max_bytes))
            self._complete = not message.get("more_body", False)
        return message


class BodyLimitMiddleware:
    """Refuses bodies over the limit with 413: at once from Content-Length,
    or while reading a chunked body, before any of it is parsed; and bodies
    that take longer than timeout_s to arrive with 408."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float = 30.0) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = header(scope, b"content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                await send_error(send, bad_request("Invalid Content-Length header.", None,
                                                   "invalid_header"))
                return
            if int(declared) > self.max_bytes:
                await send_error(send, too_large(self.max_bytes, int(declared)))
                return
        reader = _BodyReader(receive, self.max_bytes, self.timeout_s)
        response_started = False

        async def guarded_send(message: Message) -> None:
            nonlocal response_started
            if reader.refusal is not None:
                return  # the app's own answer to the aborted read is replaced by ours
            response_started = response_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, reader, guarded_send)
        except _BodyRefused:
            pass
        if reader.refusal is not None and not response_started:
            await send_error(send, reader.refusal)


class JsonBodyMiddleware:
    """Every POST body here is JSON: read it as JSON whatever Content-Type
    says (curl -d sends application/x-www-form-urlencoded)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            content_type = (header(scope, b"content-type") or "").lower()
            if "json" not in content_type:
                headers = [item for item in scope.get("headers", [])
                           if item[0].lower() != b"content-type"]
                scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)
