"""The benchmarks' OTLP/HTTP span receiver (benchmarks/span_sink.py): spans posted as the
SDK's exporter posts them come back by trace, and the prefix benchmark's stages of a
traced request add up to its time to first token."""

from __future__ import annotations

import gzip
import urllib.request

import pytest

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from benchmarks.prefix_cache_bench import STAGES, stages_of
from benchmarks.span_sink import SpanSink, spans_of

TRACE = bytes(range(16))
MS = 1_000_000


def export(spans: list[tuple[str, int, int, dict[str, int]]], trace_id: bytes = TRACE,
           events: dict[str, list[tuple[str, int]]] | None = None) -> bytes:
    """The spans (name, start ms, end ms, attributes) as one export; `events`: a span name's
    events (name, time ms)."""
    request = ExportTraceServiceRequest()
    scope = request.resource_spans.add().scope_spans.add()
    for name, start_ms, end_ms, attributes in spans:
        span = scope.spans.add(name=name, trace_id=trace_id, span_id=bytes(8),
                               start_time_unix_nano=start_ms * MS, end_time_unix_nano=end_ms * MS)
        span.attributes.extend(KeyValue(key=key, value=AnyValue(int_value=value)) for key, value in attributes.items())
        for event, at_ms in (events or {}).get(name, []):
            span.events.add(name=event, time_unix_nano=at_ms * MS)
    return request.SerializeToString()


# A traced request from the gateway's POST to the reply of its one prefill step (times in ms).
REQUEST = [("POST /generate", 2, 40, {}), ("tokenize", 3, 7, {}), ("scheduler.Generate", 8, 40, {}),
           ("scheduler.request", 10, 40, {}), ("queue_wait", 10, 11, {}),
           ("prefill_chunk", 11, 30, {"fairserve.step_id": 7}), ("worker.forward", 13, 27, {"fairserve.step_id": 7}),
           ("decode", 30, 40, {}), ("worker.forward", 31, 38, {"fairserve.step_id": 8})]


def test_spans_posted_come_back_by_trace() -> None:
    sink = SpanSink.start()
    try:
        body = gzip.compress(export(REQUEST))
        request = urllib.request.Request(sink.endpoint + "/v1/traces", data=body, method="POST", headers={
            "Content-Type": "application/x-protobuf", "Content-Encoding": "gzip"})
        with urllib.request.urlopen(request, timeout=5) as reply:
            assert reply.status == 200
        traces = sink.wait_traces(1, "POST /generate", after_ns=0, needs=("worker.forward",), timeout_s=5)
        assert [trace.trace_id for trace in traces] == [TRACE.hex()]
        assert len(traces[0].named("worker.forward")) == 2
        assert sink.traces("POST /generate", after_ns=3 * MS) == []      # it started before that
    finally:
        sink.stop()
    assert sink.environment()["OTEL_EXPORTER_OTLP_ENDPOINT"] == sink.endpoint


# The gateway's span of the call notes when the scheduler's first answer reached it (and a
# later one is not the first).
ANSWERED = {"scheduler.Generate": [("first_event", 32), ("first_event", 35)]}


def test_the_stages_add_up_to_the_time_to_first_token() -> None:
    from benchmarks.span_sink import Trace
    trace = Trace(TRACE.hex(), spans_of(export(REQUEST, events=ANSWERED)))
    assert trace.first("scheduler.Generate").events == {"first_event": 32 * MS}
    stages = stages_of(trace, sent_ns=1 * MS, first_event_ns=33 * MS)
    assert list(stages) == list(STAGES)
    assert stages["worker forward"] == 14           # the prefill step's forward, not the decode's
    assert stages["steps, outside the forward"] == 19 - 14
    assert stages["tokenize"] == 4 and stages["gateway, other"] == 6 - 4
    assert stages["scheduler to gateway"] == 32 - 30 and stages["gateway to the client"] == 33 - 32
    assert abs(sum(stages.values()) - 32) < 1e-9    # send at 1 ms, first event at 33 ms


def test_a_trace_without_the_gateways_first_event_is_refused() -> None:
    from benchmarks.span_sink import Trace
    with pytest.raises(AssertionError, match="first_event"):
        stages_of(Trace(TRACE.hex(), spans_of(export(REQUEST))), sent_ns=1 * MS, first_event_ns=33 * MS)
