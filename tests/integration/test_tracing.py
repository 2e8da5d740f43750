"""OpenTelemetry tracing across the stack (common/observability/tracing.py): with
OTEL_EXPORTER_OTLP_ENDPOINT set, one request gives one trace whose spans come
from the gateway, the scheduler and the worker (tokenize, queue wait, each
prefill chunk, the decode, the worker's forwards), and every log line of the
request carries its trace id. The collector is a tiny OTLP/HTTP receiver here
that decodes the protobuf exports. A client's own traceparent is not
continued (it could graft spans onto another client's trace)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from fairserve.launcher.stack import Stack
from tests.integration.conftest import start_stack
from tests.integration.helpers import sse_events

FOREIGN_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str


class Receiver(ThreadingHTTPServer):
    """POST /v1/traces: an ExportTraceServiceRequest, kept as ReceivedSpans."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.spans: list[ReceivedSpan] = []
        self.lock = threading.Lock()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def of_trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self.lock:
            return [span for span in self.spans if span.trace_id == trace_id]


class _Handler(BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:  # noqa: N802 - the http.server API
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        export = ExportTraceServiceRequest.FromString(body)
        received = []
        for resource_spans in export.resource_spans:
            attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                received += [ReceivedSpan(attributes.get("service.name", ""), span.name, span.trace_id.hex(),
                                          span.span_id.hex(), span.parent_span_id.hex())
                             for span in scope_spans.spans]
        with self.server.lock:
            self.server.spans.extend(received)
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.end_headers()
        self.wfile.write(b"")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()


@pytest.fixture(scope="module")
def traced_stack(tiny_model_dir: Path, receiver: Receiver,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = start_stack(tmp_path_factory.mktemp("traced"), tiny_model_dir, extra_env={
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200"})
    yield stack
    stack.stop()


def generate(stack: Stack, request_id: str, headers: dict[str, str] | None = None) -> None:
    # Over 16 tokens: two prefill chunks at the tiny stack's PREFILL_CHUNK_SIZE.
    prompt = "Trace this request through every service of the stack, " * 3
    with httpx.stream("POST", f"{stack.url}/generate", timeout=60, headers={
            "X-Request-ID": request_id, **(headers or {})},
            json={"prompt": prompt, "max_tokens": 4, "raw": True, "ignore_eos": True, "stream": True}) as reply:
        reply.read()
    assert reply.status_code == 200, reply.text
    assert sse_events(reply)[-1]["finish_reason"] == "length"


def log_lines(stack: Stack, service: str, request_id: str) -> list[dict]:
    path = stack.log_dir / f"{service}.log"
    text = path.read_text(errors="replace") if path.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.startswith("{") and request_id in line]


def wait_for(check, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return check()
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


def test_one_request_is_one_trace_across_gateway_scheduler_and_worker(traced_stack: Stack,
                                                                       receiver: Receiver) -> None:
    request_id = "trace-me-1"
    generate(traced_stack, request_id)
    gateway_lines = wait_for(lambda: _nonempty(log_lines(traced_stack, "gateway", request_id)))
    trace_id = gateway_lines[0]["trace_id"]

    def whole_trace() -> list[ReceivedSpan]:
        spans = receiver.of_trace(trace_id)
        names = [span.name for span in spans]
        assert {"POST /generate", "tokenize", "scheduler.Generate", "scheduler.request", "queue_wait",
                "decode", "worker.forward"} <= set(names), names
        assert names.count("prefill_chunk") >= 2, names
        return spans

    spans = wait_for(whole_trace)
    services = {span.service for span in spans}
    assert services == {"fairserve-gateway", "fairserve-scheduler", "fairserve-worker"}
    by_id = {span.span_id: span for span in spans}
    roots = [span for span in spans if not span.parent_id]
    assert [root.name for root in roots] == ["POST /generate"]
    assert all(span.parent_id in by_id for span in spans if span.parent_id)   # one connected tree
    for span in spans:
        if span.name == "worker.forward":
            assert by_id[span.parent_id].name in ("prefill_chunk", "decode")
        if span.name == "scheduler.request":
            assert by_id[span.parent_id].name == "scheduler.Generate"

    def every_line_has_the_trace_id() -> None:
        for service in ("gateway", "scheduler", "worker-0"):
            lines = log_lines(traced_stack, service, request_id)
            assert lines, service
            assert {line.get("trace_id") for line in lines} == {trace_id}, (service, lines)

    wait_for(every_line_has_the_trace_id)


def test_a_clients_traceparent_is_not_continued(traced_stack: Stack, receiver: Receiver) -> None:
    request_id = "trace-me-2"
    generate(traced_stack, request_id, headers={"traceparent": f"00-{FOREIGN_TRACE}-00f067aa0ba902b7-01"})
    lines = wait_for(lambda: _nonempty(log_lines(traced_stack, "gateway", request_id)))
    assert lines[0]["trace_id"] != FOREIGN_TRACE
    time.sleep(1.0)
    assert receiver.of_trace(FOREIGN_TRACE) == []


def _nonempty(lines: list[dict]) -> list[dict]:
    assert lines and "trace_id" in lines[0], lines
    return lines
