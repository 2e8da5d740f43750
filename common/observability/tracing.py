"""OpenTelemetry tracing for every service: off unless configured, exported
over OTLP/HTTP, configured by the standard OTEL_* variables
(docs/architecture.md, "Tracing").

`setup_tracing` installs the SDK only when OTEL_EXPORTER_OTLP_ENDPOINT or
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set (and OTEL_SDK_DISABLED is not true,
and OTEL_TRACES_EXPORTER is not "none"); otherwise the API's no-op tracer makes
every span here free. The exporter itself reads the endpoint, headers, timeout
and compression variables; the provider reads OTEL_SERVICE_NAME,
OTEL_RESOURCE_ATTRIBUTES and OTEL_TRACES_SAMPLER(_ARG).

Context crosses services as W3C `traceparent` in gRPC metadata (gateway ->
scheduler) and per sequence in the Step request (scheduler -> worker). Each
traced request's trace id is remembered by its request id, so that every JSON
log line of that request carries `trace_id` (common/observability/logs.py).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
TRACER_NAME = "fairserve"
_PROPAGATOR = TraceContextTextMapPropagator()
_MAX_REMEMBERED = 65536          # request ids whose trace id the logs know
_trace_ids: OrderedDict[str, str] = OrderedDict()
_provider: object | None = None


def tracing_configured(environ: Mapping[str, str]) -> bool:
    """Whether the standard variables ask for OTLP trace export."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return False
    return bool(environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
                or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip())


def setup_tracing(service: str, environ: Mapping[str, str]) -> bool:
    """Installs the SDK with an OTLP/HTTP exporter when configured; returns
    whether it did. The service name defaults to fairserve-<service>."""
    global _provider
    if not tracing_configured(environ):
        return False
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({"service.name": environ.get("OTEL_SERVICE_NAME") or f"fairserve-{service}"})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _provider = provider
    log.info("tracing on", extra={"exporter": "otlp/http"})
    return True


def shutdown_tracing() -> None:
    """Exports the spans still buffered (at a service's exit)."""
    if _provider is not None:
        _provider.shutdown()  # type: ignore[attr-defined]


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


def traceparent(span: trace.Span) -> str:
    """The W3C traceparent of a span; "" when it is not recording (tracing off)."""
    if not span.get_span_context().is_valid:
        return ""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get(TRACEPARENT, "")


def context_of(parent: str) -> otel_context.Context | None:
    """The context a traceparent names; None when it is empty or malformed."""
    if not parent:
        return None
    extracted = _PROPAGATOR.extract({TRACEPARENT: parent})
    return extracted if trace.get_current_span(extracted).get_span_context().is_valid else None


def traceparent_metadata(span: trace.Span) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying the span's context (none when tracing is off)."""
    parent = traceparent(span)
    return ((TRACEPARENT, parent),) if parent else ()


def traceparent_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    for key, value in metadata or ():
        if key == TRACEPARENT and isinstance(value, str):
            return value
    return ""


def trace_id_hex(span: trace.Span) -> str:
    span_context = span.get_span_context()
    return format(span_context.trace_id, "032x") if span_context.is_valid else ""


def remember_trace(request_id: str, span: trace.Span) -> None:
    """Every later log line of `request_id` carries this span's trace id."""
    trace_id = trace_id_hex(span)
    if not request_id or not trace_id:
        return
    _trace_ids[request_id] = trace_id
    _trace_ids.move_to_end(request_id)
    while len(_trace_ids) > _MAX_REMEMBERED:
        _trace_ids.popitem(last=False)


def forget_trace(request_id: str) -> None:
    _trace_ids.pop(request_id, None)


def trace_id_for_log(request_id: str | None) -> str:
    """The trace id of the current span, else the one remembered for the request."""
    current = trace_id_hex(trace.get_current_span())
    if current:
        return current
    return _trace_ids.get(request_id, "") if request_id else ""
