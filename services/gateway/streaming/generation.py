"""The text generation core shared by /generate, the OpenAI endpoints and
the gRPC text API: sends token ids to the scheduler and turns its token
events into text deltas, with stop strings and cancellation."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field

from services.gateway.observability.latency_tracker import LatencyTracker, RequestRecord
from common.types import TokenLogprob, Usage
from services.gateway.requests.backend import (
    BackendError,
    Finish,
    GenerationEvent,
    GenerationSpec,
    SchedulerBackend,
    TokenOutput,
)
from services.gateway.streaming.continuation import ResumableGeneration
from services.gateway.text.detokenizer import IncrementalDetokenizer
from services.gateway.observability.metrics import GatewayMetrics
from services.gateway.text.stop_strings import StopStringMatcher
from services.gateway.tenancy.tenant_quota import TenantQuotas, Ticket
from services.gateway.tenancy.tenant_trackers import TenantTrackers
from services.gateway.tool_parsers.base import ToolCall
from services.gateway.observability.vllm_metrics import RequestTimes

log = logging.getLogger(__name__)
STOP_DRAIN_TIMEOUT_S = 2.0


class GenerationFailed(BackendError):
    """The scheduler ended the request with finish_reason "error"."""


@dataclass(frozen=True)
class TextDelta:
    """Text made by the tokens of one scheduler event; the last one finishes."""
    text: str
    tokens: tuple[TokenOutput, ...] = ()
    finish_reason: str | None = None
    usage: Usage | None = None
    tool_calls: tuple[ToolCall, ...] = ()   # chat with tools: calls parsed out of the text (tool_stream.py)
    prompt_logprobs: tuple[TokenLogprob, ...] = ()   # sampling.prompt_logprobs: once, before any token


@dataclass
class CompletedText:
    text: str = ""
    finish_reason: str = ""
    usage: Usage = Usage(0, 0, 0)
    tokens: list[TokenOutput] = field(default_factory=list)


class _Progress:
    """What one stream has seen so far (for usage, metrics and cancel)."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.inter_token_s: list[float] = []
        self.completion_tokens = 0
        self.queue_wait_s: float | None = None
        self.cached_tokens = 0
        self.finished = False  # the scheduler is done with the request
        self.concluded = False  # counted in the metrics and the tracker

    def note_finish(self, finish: Finish | None) -> None:
        if finish is not None and finish.queue_wait_s is not None:
            self.queue_wait_s = finish.queue_wait_s
        if finish is not None:
            self.cached_tokens = max(self.cached_tokens, finish.usage.cached_tokens)


class GenerationService:
    def __init__(self, backend: SchedulerBackend, tokenizer: object, metrics: GatewayMetrics,
                 clock: Callable[[], float] = time.monotonic,
                 stop_drain_timeout_s: float = STOP_DRAIN_TIMEOUT_S,
                 tracker: LatencyTracker | None = None,
                 quotas: TenantQuotas | None = None, scheduler_recovery_s: float = 30.0,
                 tenant_trackers: TenantTrackers | None = None) -> None:
        self._backend = backend
        self._recovery_s = scheduler_recovery_s   # a lost scheduler's requests wait this long (continuation.py)
        # With API keys a spec's client id is its tenant's name, whose limits apply.
        self._quotas = quotas if quotas is not None else TenantQuotas(())
        self._tokenizer = tokenizer
        self._metrics = metrics
        self.tracker = tracker if tracker is not None else LatencyTracker(clock=clock)
        # With API keys, each tenant's own requests too (its private /stats).
        self.tenant_trackers = (tenant_trackers if tenant_trackers is not None
                                else TenantTrackers(clock=clock))
        self._clock = clock
        self._stop_drain_timeout_s = stop_drain_timeout_s
        self._background: set[asyncio.Task[bool]] = set()
        self._special_ids = frozenset(getattr(tokenizer, "all_special_ids", ()))

    async def stream(self, spec: GenerationSpec, request_id: str,
                     trace_id: str = "") -> AsyncIterator[TextDelta]:
        """Yields one TextDelta per token, then a finishing one. Raises
        BackendError when the scheduler rejects or fails the request."""
        detokenizer = IncrementalDetokenizer(self._tokenizer, spec.prompt_token_ids)
        stops = StopStringMatcher(spec.stop)
        progress = _Progress(self._clock())
        generation = ResumableGeneration(self._backend, spec, request_id, trace_id, self._recovery_s, self._clock)
        self._metrics.in_flight.inc()
        ticket: Ticket | None = None
        try:
            ticket = self._quotas.admit(spec.client_id)  # QuotaExceeded: a 429 for this tenant
            async with aclosing(generation.events()) as events:
                async for event in events:
                    if event.prompt_logprobs:
                        yield TextDelta("", prompt_logprobs=event.prompt_logprobs)
                    for position, token in enumerate(event.tokens):
                        self._note_token(progress, ticket)
                        if self._is_final_stop_token(event, position, spec):
                            continue
                        check = stops.feed(detokenizer.push(token.token_id))
                        if check.stopped:
                            if check.text:
                                yield TextDelta(check.text, (token,))
                            usage = await self._cancel_and_drain(events, generation, spec, progress)
                            yield self._finished(progress, spec, TextDelta("", (), "stop", usage))
                            return
                        yield TextDelta(check.text, (token,))
                    if event.finish is not None:
                        progress.note_finish(event.finish)
                        yield self._finished(progress, spec, self._final_delta(
                            event.finish, detokenizer, stops, spec, progress))
                        return
            raise BackendError("the scheduler stream ended without a finish event")
        except BackendError as error:
            progress.finished = True  # refused or ended by the scheduler: nothing to cancel
            refused = progress.first_token_at is None and not isinstance(error, GenerationFailed)
            self._conclude(progress, spec, "rejected" if refused else "error")
            raise
        finally:
            if ticket is not None:
                ticket.release()
            self._metrics.in_flight.dec()
            if not progress.finished:
                self._cancel_in_background(generation.request_id)
            self._conclude(progress, spec, "cancelled")  # abandoned: the client left

    async def complete(self, spec: GenerationSpec, request_id: str,
                       trace_id: str = "") -> CompletedText:
        result = CompletedText()
        parts: list[str] = []
        async with aclosing(self.stream(spec, request_id, trace_id)) as deltas:
            async for delta in deltas:
                parts.append(delta.text)
                result.tokens.extend(delta.tokens)
                if delta.finish_reason is not None:
                    result.finish_reason = delta.finish_reason
                    result.usage = delta.usage or result.usage
        result.text = "".join(parts)
        return result

    def token_text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False,  # type: ignore[attr-defined]
                                      clean_up_tokenization_spaces=False)

    def _is_final_stop_token(self, event: GenerationEvent, position: int,
                             spec: GenerationSpec) -> bool:
        """The EOS or stop token that ends a generation is not part of the
        output (it is still counted in usage)."""
        if event.finish is None or event.finish.reason != "stop" or position != len(event.tokens) - 1:
            return False
        token_id = event.tokens[position].token_id
        return token_id in spec.stop_token_ids or token_id in self._special_ids

    def _note_token(self, progress: _Progress, ticket: Ticket | None) -> None:
        now = self._clock()
        if progress.last_token_at is None:
            if ticket is not None:
                ticket.started()
            progress.first_token_at = now
            self._metrics.ttft.observe(now - progress.started)
            self._metrics.vllm.first_token(now - progress.started)
            gap = None
        else:
            gap = now - progress.last_token_at
            progress.inter_token_s.append(gap)
            self._metrics.inter_token.observe(gap)
        progress.last_token_at = now
        progress.completion_tokens += 1
        self._metrics.output_tokens.inc()
        self._metrics.vllm.token(gap)

    def _final_delta(self, finish: Finish, detokenizer: IncrementalDetokenizer,
                     stops: StopStringMatcher, spec: GenerationSpec,
                     progress: _Progress) -> TextDelta:
        if finish.reason == "error":
            raise GenerationFailed(finish.message or "generation failed")
        check = stops.feed(detokenizer.flush())
        if check.stopped:
            return TextDelta(check.text, (), "stop", self._usage(finish, spec, progress))
        return TextDelta(check.text + stops.flush(), (), finish.reason, finish.usage)

    async def _cancel_and_drain(self, events: AsyncIterator[GenerationEvent], generation: ResumableGeneration,
                                spec: GenerationSpec, progress: _Progress) -> Usage:
        """Cancels the rest after a stop string; waits briefly for the finish
        event, which carries the cached-token count."""
        await generation.cancel()
        finish: Finish | None = None
        try:
            async with asyncio.timeout(self._stop_drain_timeout_s):
                async for event in events:
                    if event.finish is not None:
                        finish = event.finish
                        break
        except (TimeoutError, BackendError):
            pass
        progress.note_finish(finish)
        return self._usage(finish, spec, progress)

    @staticmethod
    def _usage(finish: Finish | None, spec: GenerationSpec, progress: _Progress) -> Usage:
        cached = finish.usage.cached_tokens if finish is not None else 0
        return Usage(prompt_tokens=len(spec.prompt_token_ids),
                     completion_tokens=progress.completion_tokens, cached_tokens=cached)

    def _finished(self, progress: _Progress, spec: GenerationSpec, delta: TextDelta) -> TextDelta:
        progress.finished = True
        self._conclude(progress, spec, delta.finish_reason or "stop")
        return delta

    def _conclude(self, progress: _Progress, spec: GenerationSpec, outcome: str) -> None:
        """Counts a request once, when it ends whichever way: its outcome, and
        unless it was refused, its latencies in the histograms and the tracker."""
        if progress.concluded:
            return
        progress.concluded = True
        self._metrics.count_outcome(outcome)
        if outcome == "rejected":
            return
        ttft = (progress.first_token_at - progress.started
                if progress.first_token_at is not None else None)
        record = RequestRecord(
            session_id=spec.session_id or spec.client_id, input_tokens=len(spec.prompt_token_ids),
            output_tokens=progress.completion_tokens, e2e_s=self._clock() - progress.started,
            ttft_s=ttft, queue_wait_s=progress.queue_wait_s,
            inter_token_s=tuple(progress.inter_token_s), finish_reason=outcome)
        self._metrics.e2e.observe(record.e2e_s)
        if record.tpot_s is not None:
            self._metrics.tpot.observe(record.tpot_s)
        self._metrics.input_tokens.inc(record.input_tokens)
        self._metrics.vllm.ended(outcome, _request_times(record, progress, spec))
        self.tracker.record(record)
        self.tenant_trackers.record(spec.client_id, record)

    def _cancel_in_background(self, request_id: str) -> None:
        """The stream was abandoned (client gone, error): make sure the
        scheduler drops the request even if it missed the stream's end."""
        try:
            task = asyncio.get_running_loop().create_task(self._backend.cancel(request_id))
        except RuntimeError:
            return
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def _request_times(record: RequestRecord, progress: _Progress, spec: GenerationSpec) -> RequestTimes:
    decode = (progress.last_token_at - progress.first_token_at
              if progress.first_token_at is not None and progress.last_token_at is not None else None)
    return RequestTimes(prompt_tokens=record.input_tokens, generation_tokens=record.output_tokens,
                        cached_tokens=progress.cached_tokens, max_tokens=spec.max_tokens,
                        e2e_s=record.e2e_s, ttft_s=record.ttft_s, decode_s=decode,
                        queue_s=record.queue_wait_s)


async def merge_streams(streams: Sequence[AsyncIterator[TextDelta]]
                        ) -> AsyncIterator[tuple[int, TextDelta]]:
    """Interleaves several streams as (index, item); the first error raised by
    any of them is raised here, and closing the merge closes all of them."""
    queue: asyncio.Queue[tuple[int, TextDelta | None, BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[TextDelta]) -> None:
        try:
            async with aclosing(stream):  # type: ignore[type-var]
                async for item in stream:
                    await queue.put((index, item, None))
        except Exception as error:
            await queue.put((index, None, error))
            return
        await queue.put((index, None, None))

    tasks = [asyncio.create_task(pump(index, stream)) for index, stream in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            index, item, error = await queue.get()
            if error is not None:
                raise error
            if item is None:
                remaining -= 1
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
