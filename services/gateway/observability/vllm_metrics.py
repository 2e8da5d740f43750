"""vLLM-compatible metric families on the gateway's /metrics (docs/metrics.md,
"vLLM-compatible families"): vLLM v1's names, meanings, buckets and the
`model_name` label, so vLLM's Grafana dashboard, the production-stack router
and KEDA recipes written for vLLM read fairserve unchanged.

Per-request families are fed by the generation core (generation.py) as a
request ends; the engine-state gauges (running, waiting, KV usage) come from
the scheduler's Stats, fetched at most once per REFRESH_S however often
/metrics is scraped. The families carry no tenant, client or request label.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

log = logging.getLogger(__name__)

LABEL = "model_name"
REFRESH_S = 1.0          # a scrape younger than this reuses the last scheduler Stats
STATS_TIMEOUT_S = 2.0

# vLLM v1's buckets (vllm/v1/metrics/loggers.py), so quantiles compare like for like.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                  5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_GAP_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                       2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                     50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# vLLM builds 1-2-5 buckets up to max_model_len; the gateway does not know that
# at start, so up to a million tokens.
TOKEN_COUNT_BUCKETS = tuple(float(m * 10 ** e) for e in range(7) for m in (1, 2, 5)
                            if m * 10 ** e <= 1_000_000)

# fairserve outcome -> vLLM finished_reason; "rejected" (never admitted) is not counted.
FINISHED_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort", "error": "error"}


@dataclass(frozen=True)
class RequestTimes:
    """What one ended request measured, in seconds and tokens (generation.py)."""
    prompt_tokens: int
    generation_tokens: int
    cached_tokens: int
    max_tokens: int
    e2e_s: float
    ttft_s: float | None          # None: no token came
    decode_s: float | None        # first token to last; None: no token came
    queue_s: float | None         # arrival to admission at the scheduler; None: not reported


@dataclass(frozen=True)
class EngineState:
    """The scheduler-side gauges at one moment."""
    running: int
    waiting: int
    kv_usage: float               # used / total KV blocks over the healthy workers, 0..1


def engine_state(details: Mapping[str, Any]) -> EngineState:
    """The gauges from the scheduler's Stats (the dict of convert.scheduler_stats_to_dict)."""
    listed = details.get("workers")
    workers = [w for w in (listed if isinstance(listed, list) else ())
               if isinstance(w, Mapping) and w.get("healthy")]
    total = sum(int(w.get("total_blocks", 0)) for w in workers)
    used = sum(int(w.get("used_blocks", 0)) for w in workers)
    return EngineState(running=int(details.get("prefilling", 0)) + int(details.get("active", 0)),
                       waiting=int(details.get("pending", 0)),
                       kv_usage=used / total if total > 0 else 0.0)


class VllmMetrics:
    """The vLLM families, labelled with the served model's name."""

    def __init__(self, registry: CollectorRegistry, model_name: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.model_name = model_name
        self._clock = clock
        self._refreshed_at: float | None = None
        self._refresh: asyncio.Future[None] | None = None
        labels = [LABEL]

        def counter(name: str, help_text: str) -> Counter:
            return Counter(name, help_text, labels, registry=registry)

        def gauge(name: str, help_text: str) -> Gauge:
            return Gauge(name, help_text, labels, registry=registry)

        def histogram(name: str, help_text: str, buckets: Iterable[float]) -> Histogram:
            return Histogram(name, help_text, labels, buckets=tuple(buckets), registry=registry)

        self.running = gauge("vllm:num_requests_running", "Requests admitted and not finished (prefilling or decoding)")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests queued at the scheduler, not admitted yet")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage: used blocks / total blocks, 1 means full")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of ended requests")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens")
        self.success = Counter("vllm:request_success", "Finished requests by finished_reason",
                               [LABEL, "finished_reason"], registry=registry)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS_S)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Gap between consecutive tokens",
                             TOKEN_GAP_BUCKETS_S)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Per request: (e2e - ttft) / (generated tokens - 1)", TOKEN_GAP_BUCKETS_S)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Request received to last token",
                             REQUEST_BUCKETS_S)
        self.queue = histogram("vllm:request_queue_time_seconds", "Time queued at the scheduler",
                               REQUEST_BUCKETS_S)
        self.prefill = histogram("vllm:request_prefill_time_seconds", "Admission to first token",
                                 REQUEST_BUCKETS_S)
        self.decode = histogram("vllm:request_decode_time_seconds", "First token to last token",
                                REQUEST_BUCKETS_S)
        self.inference = histogram("vllm:request_inference_time_seconds", "Admission to last token",
                                   REQUEST_BUCKETS_S)
        self.prompt_lengths = histogram("vllm:request_prompt_tokens", "Prompt tokens per request",
                                        TOKEN_COUNT_BUCKETS)
        self.generation_lengths = histogram("vllm:request_generation_tokens",
                                            "Generated tokens per request", TOKEN_COUNT_BUCKETS)
        self.max_tokens = histogram("vllm:request_max_num_generation_tokens",
                                    "The max_tokens each request asked for", TOKEN_COUNT_BUCKETS)
        for metric in (self.running, self.waiting, self.kv_usage, self.prefix_queries, self.prefix_hits,
                       self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.tpot,
                       self.e2e, self.queue, self.prefill, self.decode, self.inference,
                       self.prompt_lengths, self.generation_lengths, self.max_tokens):
            metric.labels(model_name)   # exported from the start, at 0
        for reason in sorted(set(FINISHED_REASONS.values())):
            self.success.labels(model_name, reason)

    def token(self, gap_s: float | None) -> None:
        """One token sent; gap_s since the previous one (None for the first)."""
        self.generation_tokens.labels(self.model_name).inc()
        if gap_s is not None:
            self.itl.labels(self.model_name).observe(gap_s)

    def first_token(self, ttft_s: float) -> None:
        self.ttft.labels(self.model_name).observe(ttft_s)

    def ended(self, outcome: str, times: RequestTimes) -> None:
        """A request ended with fairserve's outcome; a refused one counts nowhere."""
        reason = FINISHED_REASONS.get(outcome)
        if reason is None:
            return
        name = self.model_name
        self.success.labels(name, reason).inc()
        self.prompt_tokens.labels(name).inc(times.prompt_tokens)
        self.prefix_queries.labels(name).inc(times.prompt_tokens)
        self.prefix_hits.labels(name).inc(min(times.cached_tokens, times.prompt_tokens))
        self.e2e.labels(name).observe(times.e2e_s)
        self.prompt_lengths.labels(name).observe(times.prompt_tokens)
        self.generation_lengths.labels(name).observe(times.generation_tokens)
        self.max_tokens.labels(name).observe(times.max_tokens)
        if times.queue_s is not None:
            self.queue.labels(name).observe(times.queue_s)
        if times.ttft_s is None:
            return
        # As vLLM does: a request with at most one token has a TPOT of 0.
        tpot = ((times.e2e_s - times.ttft_s) / (times.generation_tokens - 1)
                if times.generation_tokens > 1 else 0.0)
        self.tpot.labels(name).observe(max(tpot, 0.0))
        prefill = max(times.ttft_s - (times.queue_s or 0.0), 0.0)
        decode = max(times.decode_s or 0.0, 0.0)
        self.prefill.labels(name).observe(prefill)
        self.decode.labels(name).observe(decode)
        self.inference.labels(name).observe(prefill + decode)

    def set_engine(self, state: EngineState) -> None:
        self.running.labels(self.model_name).set(state.running)
        self.waiting.labels(self.model_name).set(state.waiting)
        self.kv_usage.labels(self.model_name).set(state.kv_usage)

    async def refresh(self, scheduler_details: Callable[[], Awaitable[Mapping[str, Any]]]) -> None:
        """Sets the engine gauges from the scheduler's Stats, at most once per
        REFRESH_S (scrapes at the same time share one call). A scheduler that
        does not answer leaves the last values (fairserve_gateway_dependency_up
        says it is down)."""
        if self._refreshed_at is not None and self._clock() - self._refreshed_at < REFRESH_S:
            return
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.ensure_future(self._fetch(scheduler_details))
        await asyncio.shield(self._refresh)

    async def _fetch(self, scheduler_details: Callable[[], Awaitable[Mapping[str, Any]]]) -> None:
        try:
            details = await asyncio.wait_for(scheduler_details(), STATS_TIMEOUT_S)
        except Exception as error:  # noqa: BLE001 - a failed refresh must not fail the scrape
            log.debug("vllm gauges not refreshed", extra={"error": type(error).__name__})
        else:
            self.set_engine(engine_state(details))
        self._refreshed_at = self._clock()
