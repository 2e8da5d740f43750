"""Prometheus metrics of the worker, named as catalogued in
common.observability.prometheus_names (fairserve_worker_*).

Every family carries this worker's id and is exported from the start (the
block states from the empty pool); a step's counters are observed as the
step returns, on the event loop."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge

from common.observability import prometheus_names as names
from common.step import PoolStats, StepBatch, StepOutput

if TYPE_CHECKING:
    from services.worker.engine.engine import Engine

BLOCK_STATES = ("free", "cached", "used", "total")
TOKEN_KINDS = ("computed", "prompt", "sampled")
SPECULATIVE_KINDS = ("drafted", "accepted")
LOGITS_PATHS = ("screened", "full")
ENGINE_LABELS = ("device", "dtype", "linear_kernel", "prefill_attention", "decode_attention")


def engine_labels(engine: Engine) -> dict[str, str]:
    """The labels of the engine info series: what the engine runs on and with."""
    return {"device": engine.info.device, "dtype": engine.info.dtype,
            "linear_kernel": engine.linear_kernel.kernel if engine.linear_kernel is not None else "none",
            "prefill_attention": engine.attention_kernel, "decode_attention": engine.decode_attention}


class PoolTotal:
    """A counter fed from a total the engine keeps: each new total adds what it
    grew by. A total that went down (a step rolled back) adds nothing, and the
    counter resumes from there, so it never decreases."""

    def __init__(self, counter: Counter) -> None:
        self.counter = counter
        self._last = 0

    def advance(self, total: int) -> None:
        if total > self._last:
            self.counter.inc(total - self._last)
        self._last = total


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry, worker_id: str, pool: PoolStats | None = None,
                 engine_labels: Mapping[str, str] | None = None) -> None:
        self.registry = registry

        def gauge(family: names.MetricFamily) -> Gauge:
            return names.gauge(family, registry)

        self.step_seconds = names.histogram(names.WORKER_STEP, registry).labels(worker=worker_id)
        self.batch_tokens = gauge(names.WORKER_BATCH_TOKENS).labels(worker=worker_id)
        self.batch_sequences = gauge(names.WORKER_BATCH_SEQUENCES).labels(worker=worker_id)
        token_counter = names.counter(names.WORKER_TOKENS, registry)
        self.tokens = {kind: token_counter.labels(worker=worker_id, kind=kind) for kind in TOKEN_KINDS}
        blocks = gauge(names.WORKER_KV_BLOCKS)
        self.blocks = {state: blocks.labels(worker=worker_id, state=state) for state in BLOCK_STATES}
        self.evictions = PoolTotal(names.counter(names.WORKER_KV_EVICTIONS, registry).labels(worker=worker_id))
        self.prefix_hit_tokens = PoolTotal(
            names.counter(names.WORKER_PREFIX_HIT_TOKENS, registry).labels(worker=worker_id))
        self.prefix_query_tokens = PoolTotal(
            names.counter(names.WORKER_PREFIX_QUERY_TOKENS, registry).labels(worker=worker_id))
        self.running = gauge(names.WORKER_RUNNING).labels(worker=worker_id)
        self.prompt_logits_hits = names.counter(names.WORKER_PROMPT_LOGITS_HITS, registry).labels(worker=worker_id)
        self.graph_steps = names.counter(names.WORKER_GRAPH_STEPS, registry).labels(worker=worker_id)
        speculative = names.counter(names.WORKER_SPECULATIVE_TOKENS, registry)
        self.speculative = {kind: speculative.labels(worker=worker_id, kind=kind) for kind in SPECULATIVE_KINDS}
        logits_rows = names.counter(names.WORKER_LOGITS_ROWS, registry)
        self.logits_rows = {path: logits_rows.labels(worker=worker_id, path=path) for path in LOGITS_PATHS}
        labels = {label: (engine_labels or {}).get(label, "") for label in ENGINE_LABELS}
        gauge(names.WORKER_ENGINE_INFO).labels(worker=worker_id, **labels).set(1)
        if pool is not None:
            self.observe_pool(pool)

    def observe(self, batch: StepBatch, output: StepOutput, running: int) -> None:
        sampled = sum(len(r.token_ids) for r in output.results)
        self.step_seconds.observe(output.forward_ms / 1000.0)
        self.batch_tokens.set(output.batch_tokens)
        self.batch_sequences.set(len(batch.work))
        self.tokens["computed"].inc(output.batch_tokens)
        self.tokens["prompt"].inc(output.prompt_tokens)
        self.tokens["sampled"].inc(sampled)
        self.prompt_logits_hits.inc(output.prompt_logits_hits)
        self.graph_steps.inc(1 if output.graph_replayed else 0)
        self.speculative["drafted"].inc(output.draft_tokens)
        self.speculative["accepted"].inc(output.accepted_tokens)
        self.logits_rows["screened"].inc(output.screened_rows)
        self.logits_rows["full"].inc(output.full_rows)
        self.observe_pool(output.pool)
        self.running.set(running)

    def observe_pool(self, pool: PoolStats) -> None:
        for state, value in (("free", pool.free_blocks), ("cached", pool.cached_blocks),
                             ("used", pool.used_blocks), ("total", pool.total_blocks)):
            self.blocks[state].set(value)
        self.evictions.advance(pool.evictions)
        self.prefix_hit_tokens.advance(pool.prefix_hit_tokens)
        self.prefix_query_tokens.advance(pool.prefix_query_tokens)
