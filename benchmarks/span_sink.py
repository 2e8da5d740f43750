"""A tiny OTLP/HTTP trace receiver for benchmarks: the services export their spans
(common/observability/tracing.py) to `SpanSink.endpoint`, and a benchmark reads
them back by trace, to say where a request's time went.

    sink = SpanSink.start()
    env = {**sink.environment(), ...}     # for every service of the stack
    ...                                   # requests
    traces = sink.wait_traces(count=1, root="POST /generate", after_ns=sent)

Only protobuf bodies (the SDK's OTLP/HTTP exporter's default) are read. Spans
keep their name, trace id, start and end (ns since the epoch, the host's clock:
the stack and the benchmark run on one machine) and string/int attributes.
"""

from __future__ import annotations

import gzip
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                       ExportTraceServiceResponse)

# The SDK's batch processor waits 5 s by default before it exports; a benchmark wants them soon.
EXPORT_DELAY_MS = 50


@dataclass(frozen=True)
class Span:
    name: str
    trace_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, str | int]
    events: dict[str, int] = field(default_factory=dict)     # name -> time (ns) of its first event

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


@dataclass
class Trace:
    trace_id: str
    spans: list[Span] = field(default_factory=list)

    def named(self, name: str) -> list[Span]:
        return sorted((span for span in self.spans if span.name == name), key=lambda span: span.start_ns)

    def first(self, name: str) -> Span | None:
        spans = self.named(name)
        return spans[0] if spans else None


def _value(any_value) -> str | int:  # an OTLP AnyValue
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind in ("string_value", "int_value", "bool_value") else str(any_value)


def spans_of(body: bytes) -> list[Span]:
    """The spans of one OTLP/HTTP protobuf export."""
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    return [Span(name=span.name, trace_id=span.trace_id.hex(), start_ns=span.start_time_unix_nano,
                 end_ns=span.end_time_unix_nano,
                 attributes={attr.key: _value(attr.value) for attr in span.attributes},
                 events=_first_events(span.events))
            for resource in request.resource_spans for scope in resource.scope_spans for span in scope.spans]


def _first_events(events) -> dict[str, int]:  # a span's OTLP events
    first: dict[str, int] = {}
    for event in sorted(events, key=lambda event: event.time_unix_nano):
        first.setdefault(event.name, event.time_unix_nano)
    return first


class SpanSink:
    def __init__(self, server: ThreadingHTTPServer) -> None:
        self._server = server
        self._lock = threading.Lock()
        self._traces: dict[str, Trace] = defaultdict(lambda: Trace(""))
        self._thread = threading.Thread(target=server.serve_forever, daemon=True, name="span-sink")

    @classmethod
    def start(cls) -> SpanSink:
        sink: SpanSink | None = None

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                assert sink is not None
                sink.add(spans_of(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        sink = cls(ThreadingHTTPServer(("127.0.0.1", 0), Handler))
        sink._thread.start()
        return sink

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def environment(self) -> dict[str, str]:
        """The variables that make a service export its spans here, soon after they end."""
        return {"OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint, "OTEL_BSP_SCHEDULE_DELAY": str(EXPORT_DELAY_MS),
                "OTEL_TRACES_SAMPLER": "always_on"}

    def add(self, spans: list[Span]) -> None:
        with self._lock:
            for span in spans:
                trace = self._traces[span.trace_id]
                trace.trace_id = span.trace_id
                trace.spans.append(span)

    def traces(self, root: str, after_ns: int) -> list[Trace]:
        """The traces whose span named `root` started after `after_ns`, oldest first."""
        with self._lock:
            found = [trace for trace in self._traces.values()
                     if any(span.name == root and span.start_ns >= after_ns for span in trace.spans)]
        return sorted(found, key=lambda trace: trace.first(root).start_ns)  # type: ignore[union-attr]

    def wait_traces(self, count: int, root: str, after_ns: int, needs: tuple[str, ...] = (),
                    timeout_s: float = 10.0) -> list[Trace]:
        """Waits until `count` such traces hold every span named in `needs` (the services
        export on their own schedules), then returns them."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = [trace for trace in self.traces(root, after_ns)
                     if all(trace.first(name) is not None for name in needs)]
            if len(found) >= count or time.monotonic() > deadline:
                return found
            time.sleep(0.02)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
