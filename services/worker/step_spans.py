"""The worker's spans of traced requests (common/observability/tracing.py): for each work
item the scheduler sent a traceparent for (StepRequest.trace_context), one
`worker.forward` span, a child of that request's prefill-chunk or decode span,
covering the step's forward. One forward serves the whole batch, so the spans
of one step share their times and carry the step id and batch size. Nothing is
made when tracing is off (the map is empty)."""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import trace

from common.sequence_ids import request_id_of
from common.step import StepBatch, StepOutput
from common.observability.tracing import context_of, remember_trace, tracer


def record_step_spans(contexts: Mapping[str, str], batch: StepBatch, output: StepOutput,
                      started_ns: int, ended_ns: int, worker_id: str) -> None:
    if not contexts:
        return
    tokens = {item.seq_id: item.num_tokens for item in batch.work}
    results = {result.seq_id: result for result in output.results}
    for seq_id, parent in contexts.items():
        context = context_of(parent)
        if context is None or seq_id not in tokens:
            continue
        span = tracer().start_span("worker.forward", context=context, start_time=started_ns,
                                   kind=trace.SpanKind.INTERNAL, attributes={
                                       "fairserve.worker_id": worker_id, "fairserve.step_id": batch.step_id,
                                       "fairserve.num_tokens": tokens[seq_id],
                                       "fairserve.batch_sequences": len(batch.work),
                                       "fairserve.batch_tokens": output.batch_tokens,
                                       "fairserve.forward_ms": output.forward_ms})
        result = results.get(seq_id)
        if result is not None and result.error:
            span.set_attribute("fairserve.step_error", str(result.error))
        remember_trace(request_id_of(seq_id), span)
        span.end(end_time=ended_ns)
