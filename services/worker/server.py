"""The worker's gRPC transport: Step/Info/Stats over the engine, registration
and heartbeats towards the scheduler, KV block events towards the index."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import grpc
from fairserve.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
from prometheus_client import CollectorRegistry, Gauge

from common import prometheus_names as names
from common.grpc_server import request_id_from
from common.sequence_ids import request_id_of
from common.step_order import StepOrder
from services.worker import convert
from services.worker.engine.engine import Engine
from services.worker.engine.types import BlockEvent, PoolStats, StepBatch, StepOutput

log = logging.getLogger(__name__)


BLOCK_STATES = ("free", "cached", "used", "total")
TOKEN_KINDS = ("computed", "prompt", "sampled")
SPECULATIVE_KINDS = ("drafted", "accepted")
LOGITS_PATHS = ("screened", "full")
ENGINE_LABELS = ("device", "dtype", "linear_kernel", "prefill_attention", "decode_attention")


class WorkerMetrics:
    """The worker families of common.prometheus_names, all labelled with this
    worker's id and exported from the start (block states from the empty pool)."""

    def __init__(self, registry: CollectorRegistry, worker_id: str, pool: PoolStats | None = None,
                 engine_labels: Mapping[str, str] | None = None) -> None:
        def gauge(family: names.MetricFamily) -> Gauge:
            return names.gauge(family, registry)

        self.step_seconds = names.histogram(names.WORKER_STEP, registry).labels(worker=worker_id)
        self.batch_tokens = gauge(names.WORKER_BATCH_TOKENS).labels(worker=worker_id)
        self.batch_sequences = gauge(names.WORKER_BATCH_SEQUENCES).labels(worker=worker_id)
        token_counter = names.counter(names.WORKER_TOKENS, registry)
        self.tokens = {kind: token_counter.labels(worker=worker_id, kind=kind) for kind in TOKEN_KINDS}
        blocks = gauge(names.WORKER_KV_BLOCKS)
        self.blocks = {state: blocks.labels(worker=worker_id, state=state) for state in BLOCK_STATES}
        self.evictions = gauge(names.WORKER_KV_EVICTIONS).labels(worker=worker_id)
        self.prefix_hit_tokens = gauge(names.WORKER_PREFIX_HIT_TOKENS).labels(worker=worker_id)
        self.prefix_query_tokens = gauge(names.WORKER_PREFIX_QUERY_TOKENS).labels(worker=worker_id)
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
        self.evictions.set(pool.evictions)
        self.prefix_hit_tokens.set(pool.prefix_hit_tokens)
        self.prefix_query_tokens.set(pool.prefix_query_tokens)


@dataclass
class StepCounters:
    steps: int = 0
    last_forward_ms: float = 0.0
    last_batch_tokens: int = 0
    computed_tokens: int = 0
    prompt_tokens: int = 0
    sampled_tokens: int = 0


class WorkerService(worker_pb2_grpc.WorkerServicer):
    """Runs engine steps one at a time on a dedicated thread (the engine is
    not thread-safe, and torch releases the GIL while it computes)."""

    def __init__(self, engine: Engine, worker_id: str, metrics: WorkerMetrics,
                 on_block_events: Callable[[list[BlockEvent]], None] | None = None,
                 kv_events_unacknowledged: Callable[[], int] | None = None) -> None:
        self._engine = engine
        self._worker_id = worker_id
        self._metrics = metrics
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._order = StepOrder()   # pipelined steps run in the order the scheduler planned them
        # Called on the engine's thread right after each step, so that a Stats call
        # (queued on the same thread) sees every earlier step's events handed over.
        self.on_block_events = on_block_events
        self.kv_events_unacknowledged = kv_events_unacknowledged
        self.counters = StepCounters()
        self.last_pool = engine.pool_stats()

    def _run_step(self, batch: StepBatch) -> tuple[StepOutput, int]:
        output = self._engine.step(batch)
        events = self._engine.drain_events()
        if events and self.on_block_events is not None:
            self.on_block_events(events)
        return output, self._engine.running_sequences()

    async def Step(self, request: worker_pb2.StepRequest, context: grpc.aio.ServicerContext):
        request_id_from(context)
        batch = convert.step_batch_from_proto(request)
        loop = asyncio.get_running_loop()
        try:
            async with self._order.turn(request.step_id, request.after_step_id):
                output, running = await loop.run_in_executor(self._executor, self._run_step, batch)
        except ValueError as error:  # malformed batch: the engine changed nothing
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        self._record(batch, output, running)
        self._log_step(batch, output)
        return convert.step_response_to_proto(request.step_id, output)

    def _log_step(self, batch: StepBatch, output: StepOutput) -> None:
        """A step serves many requests: one debug line for the step, and an
        info line per sequence that starts, fails or is freed, with the
        request id its sequence id carries."""
        for seq_id in batch.free_seq_ids:
            log.info("sequence freed", extra={"request_id": request_id_of(seq_id), "seq_id": seq_id})
        for new in batch.new_sequences:
            log.info("sequence registered", extra={
                "request_id": request_id_of(new.seq_id), "seq_id": new.seq_id,
                "prompt_tokens": len(new.prompt_token_ids), "resumed_tokens": len(new.output_token_ids)})
        for result in output.results:
            if result.error:
                log.info("sequence step failed", extra={"request_id": request_id_of(result.seq_id),
                                                        "seq_id": result.seq_id, "error": result.error})
        log.debug("step", extra={"sequences": len(batch.work), "tokens": output.batch_tokens,
                                 "forward_ms": round(output.forward_ms, 3)})

    def _record(self, batch: StepBatch, output: StepOutput, running: int) -> None:
        counters = self.counters
        counters.steps += 1
        counters.last_forward_ms = output.forward_ms
        counters.last_batch_tokens = output.batch_tokens
        counters.computed_tokens += output.batch_tokens
        counters.prompt_tokens += output.prompt_tokens
        counters.sampled_tokens += sum(len(r.token_ids) for r in output.results)
        self.last_pool = output.pool
        self._metrics.observe(batch, output, running)

    async def Info(self, request, context):
        return convert.info_to_proto(self._worker_id, self._engine.info)

    async def Stats(self, request, context):
        loop = asyncio.get_running_loop()
        pool, running = await loop.run_in_executor(
            self._executor, lambda: (self._engine.pool_stats(), self._engine.running_sequences()))
        counters = self.counters
        unacknowledged = self.kv_events_unacknowledged() if self.kv_events_unacknowledged else 0
        return worker_pb2.WorkerStats(
            pool=convert.pool_to_proto(pool), running_sequences=running, steps=counters.steps,
            last_forward_ms=counters.last_forward_ms, last_batch_tokens=counters.last_batch_tokens,
            total_prefill_tokens=counters.prompt_tokens,
            total_decode_tokens=counters.sampled_tokens, kv_events_unacknowledged=unacknowledged,
        )

    async def snapshot_async(self) -> tuple[list[tuple[int, list[int]]], list[tuple[int, int]]]:
        """The engine's cached chains and whole prompts' partial blocks, taken together
        on the engine's thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._executor, lambda: (self._engine.snapshot_chains(), self._engine.snapshot_partials()))

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


async def keep_registered(channel: grpc.aio.Channel, worker_id: str, address: str,
                          service: WorkerService, interval_s: float, stop: asyncio.Event) -> None:
    """Registers with the scheduler, then heartbeats; registers again whenever
    the scheduler says it does not know us (it restarted, or timed us out)."""
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    registered = False
    while not stop.is_set():
        try:
            if not registered:
                reply = await stub.RegisterWorker(
                    scheduler_pb2.RegisterWorkerRequest(worker_id=worker_id, address=address), timeout=5)
                registered = True
                interval_s = reply.heartbeat_interval_s or interval_s
                log.info("registered with the scheduler", extra={"worker_id": worker_id, "address": address})
            else:
                pool = service.last_pool
                reply = await stub.Heartbeat(scheduler_pb2.HeartbeatRequest(
                    worker_id=worker_id, free_blocks=pool.free_blocks, cached_blocks=pool.cached_blocks),
                    timeout=5)
                registered = reply.known
        except grpc.aio.AioRpcError as error:
            registered = False
            log.warning("scheduler unreachable", extra={"code": error.code().name})
        try:
            await asyncio.wait_for(stop.wait(), timeout=interval_s if registered else 1.0)
        except asyncio.TimeoutError:
            pass
