"""The root span of each generation request (common/observability/tracing.py): one per
POST to /generate, /v1/completions or /v1/chat/completions, covering the
whole answer, streams included. Plain ASGI, like middleware.py.

A client's own `traceparent` header is not continued: every request starts a
trace of its own, so a client can neither add spans to another client's trace
nor force sampling on. Its request id names the trace in the logs until the
access line is written (middleware.py forgets it then)."""

from __future__ import annotations

from opentelemetry import context as otel_context
from opentelemetry import trace
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.observability.logs import request_id_var
from common.observability.tracing import remember_trace, tracer

TRACED_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")


class RequestSpanMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in TRACED_PATHS:
            await self.app(scope, receive, send)
            return
        request_id = request_id_var.get() or ""
        # An empty context: a new trace whatever the client sent.
        with tracer().start_as_current_span(f"POST {scope['path']}", context=otel_context.Context(),
                                            kind=trace.SpanKind.SERVER) as span:
            span.set_attribute("http.request.method", "POST")
            span.set_attribute("url.path", scope["path"])
            span.set_attribute("fairserve.request_id", request_id)
            remember_trace(request_id, span)

            async def send_status(message: Message) -> None:
                if message["type"] == "http.response.start":
                    span.set_attribute("http.response.status_code", message["status"])
                await send(message)

            await self.app(scope, receive, send_status)
