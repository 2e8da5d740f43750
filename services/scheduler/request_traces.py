"""The scheduler's spans of traced requests (common/observability/tracing.py), made at the
transport edge from what the core plans and applies; the core knows nothing
of tracing.

Per request, under the gateway's span (its traceparent in the Generate
metadata): `scheduler.request` for its whole life, `queue_wait` from arrival
to its first step, one `prefill_chunk` per step that computes prompt tokens
(planned to reply), and one `decode` from its first decode step to its end.
A step serves many requests at once; each traced work item carries the
traceparent of its own chunk or decode span to the worker (StepRequest.
trace_context), whose forward becomes a child there, with the step id and
batch size as attributes that tie a batch's spans together. A request that
came without a traceparent (tracing off) costs a dictionary lookup per item.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from opentelemetry import trace

from common.sequence_ids import request_id_of
from common.step import StepBatch, StepOutput
from common.observability.tracing import context_of, forget_trace, remember_trace, traceparent, tracer


@dataclass
class _Traced:
    request: trace.Span
    queue_wait: trace.Span | None
    decode: trace.Span | None = None
    first_token_seen: bool = False
    aliases: tuple[str, ...] = ()


@dataclass
class RequestTraces:
    _requests: dict[str, _Traced] = field(default_factory=dict)
    _chunks: dict[int, dict[str, trace.Span]] = field(default_factory=dict)   # step id -> seq id -> span

    def start(self, request_id: str, parent: str, log_ids: tuple[str, ...] = ()) -> None:
        """A request arrived with the gateway's traceparent ("" : not traced)."""
        context = context_of(parent)
        if context is None:
            return
        span = tracer().start_span("scheduler.request", context=context, kind=trace.SpanKind.SERVER,
                                   attributes={"fairserve.request_id": request_id})
        queue_wait = tracer().start_span("queue_wait", context=trace.set_span_in_context(span))
        aliases = tuple(dict.fromkeys((request_id, *log_ids)))
        for alias in aliases:
            remember_trace(alias, span)
        self._requests[request_id] = _Traced(span, queue_wait, aliases=aliases)

    def planned(self, worker_id: str, plan: StepBatch) -> dict[str, str]:
        """Spans for the plan's traced work; returns seq id -> traceparent for the worker."""
        contexts: dict[str, str] = {}
        for item in plan.work:
            traced = self._requests.get(request_id_of(item.seq_id))
            if traced is None:
                continue
            if traced.queue_wait is not None:
                traced.queue_wait.end()
                traced.queue_wait = None
            parent = trace.set_span_in_context(traced.request)
            attributes = {"fairserve.step_id": plan.step_id, "fairserve.worker_id": worker_id,
                          "fairserve.batch_sequences": len(plan.work), "fairserve.batch_tokens": plan.num_tokens,
                          "fairserve.num_tokens": item.num_tokens}
            if traced.first_token_seen:
                if traced.decode is None:
                    traced.decode = tracer().start_span("decode", context=parent,
                                                        attributes={"fairserve.worker_id": worker_id})
                contexts[item.seq_id] = traceparent(traced.decode)
                continue
            chunk = tracer().start_span("prefill_chunk", context=parent, attributes=attributes)
            self._chunks.setdefault(plan.step_id, {})[item.seq_id] = chunk
            contexts[item.seq_id] = traceparent(chunk)
        return contexts

    def applied(self, output: StepOutput) -> None:
        """A step's reply: its prefill chunks end; a sampled token starts decoding."""
        chunks = self._chunks.pop(output.step_id, {})
        for result in output.results:
            chunk = chunks.pop(result.seq_id, None)
            if chunk is not None:
                chunk.set_attribute("fairserve.cached_tokens", result.num_cached_tokens)
                if result.error:
                    chunk.set_attribute("fairserve.step_error", str(result.error))
                chunk.end()
            traced = self._requests.get(request_id_of(result.seq_id))
            if traced is not None and result.sampled:
                traced.first_token_seen = True
        for chunk in chunks.values():   # no result came for them
            chunk.end()

    def finished(self, request_id: str, reason: str) -> None:
        traced = self._requests.pop(request_id, None)
        if traced is None:
            return
        for chunks in self._chunks.values():   # a step that never replied (its worker failed)
            for seq_id in [seq for seq in chunks if request_id_of(seq) == request_id]:
                chunks.pop(seq_id).end()
        for span in (traced.queue_wait, traced.decode):
            if span is not None:
                span.end()
        traced.request.set_attribute("fairserve.finish_reason", reason)
        traced.request.end()
        for alias in traced.aliases:
            forget_trace(alias)
