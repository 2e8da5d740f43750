"""common/observability/tracing.py: on only when the standard variables ask for OTLP export;
traceparents round-trip; log lines of a remembered request carry its trace
id; the scheduler's spans follow a request through its steps."""

from __future__ import annotations

import json
import logging

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from common.observability import tracing
from common.observability.logs import JsonFormatter
from common.sequence_ids import sequence_id
from common.step import PoolStats, SeqResult, StepBatch, StepOutput, WorkItem
from services.scheduler.request_traces import RequestTraces

ENDPOINT = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}


@pytest.mark.parametrize(("environ", "on"), [
    ({}, False),
    (ENDPOINT, True),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
    ({**ENDPOINT, "OTEL_SDK_DISABLED": "true"}, False),
    ({**ENDPOINT, "OTEL_TRACES_EXPORTER": "none"}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "  "}, False),
])
def test_tracing_is_off_unless_configured(environ, on) -> None:
    assert tracing.tracing_configured(environ) is on


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return exporter


def test_a_traceparent_round_trips_and_junk_is_no_context(exporter) -> None:
    with tracing.tracer().start_as_current_span("root") as span:
        parent = tracing.traceparent(span)
        assert tracing.traceparent_from_metadata(tracing.traceparent_metadata(span)) == parent
    context = tracing.context_of(parent)
    assert trace.get_current_span(context).get_span_context().trace_id == span.get_span_context().trace_id
    assert tracing.context_of("") is None
    assert tracing.context_of("00-zz-yy-01") is None


def test_log_lines_of_a_remembered_request_carry_its_trace_id(exporter) -> None:
    span = tracing.tracer().start_span("request")
    tracing.remember_trace("req-1", span)
    formatter = JsonFormatter("test")

    def line(request_id: str) -> dict:
        record = logging.LogRecord("t", logging.INFO, __file__, 1, "hello", (), None)
        record.request_id = request_id
        return json.loads(formatter.format(record))

    assert line("req-1")["trace_id"] == tracing.trace_id_hex(span)
    assert "trace_id" not in line("req-2")
    tracing.forget_trace("req-1")
    assert "trace_id" not in line("req-1")
    span.end()


def _output(step_id: int, seq_id: str, sampled: bool) -> StepOutput:
    pool = PoolStats(total_blocks=8, free_blocks=8, cached_blocks=0, used_blocks=0, evictions=0,
                     prefix_hit_tokens=0, prefix_query_tokens=0)
    return StepOutput(results=(SeqResult(seq_id, sampled=sampled, token_id=1 if sampled else -1),),
                      pool=pool, step_id=step_id)


def test_the_scheduler_spans_follow_a_request_through_its_steps(exporter) -> None:
    exporter.clear()
    with tracing.tracer().start_as_current_span("gateway") as gateway:
        parent = tracing.traceparent(gateway)
    traces = RequestTraces()
    traces.start("r1.0", parent)
    traces.start("untraced.0", "")
    seq = sequence_id("r1.0", "0")
    for step_id, sampled in ((1, False), (2, True), (3, True), (4, True)):
        work = (WorkItem(seq, 16 if step_id < 3 else 1), WorkItem(sequence_id("untraced.0", "0"), 1))
        contexts = traces.planned("w0", StepBatch(step_id=step_id, work=work))
        assert set(contexts) == {seq}
        traces.applied(_output(step_id, seq, sampled))
    traces.finished("r1.0", "length")
    traces.finished("untraced.0", "length")
    names = [span.name for span in exporter.get_finished_spans()]
    assert names.count("prefill_chunk") == 2
    assert names.count("queue_wait") == names.count("decode") == names.count("scheduler.request") == 1
    trace_ids = {span.context.trace_id for span in exporter.get_finished_spans()}
    assert trace_ids == {gateway.get_span_context().trace_id}
