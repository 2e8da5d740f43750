"""The worker's gRPC transport: Step/Info/Stats over the engine, registration
and heartbeats towards the scheduler, KV block events towards the index."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import grpc
from fairserve.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc

from common.transport.grpc_server import request_id_from
from common.sequence_ids import request_id_of
from common.step_convert import pool_to_proto, step_batch_from_proto
from services.worker.decode_steps import run_decode_steps
from services.worker.host.quiet_release import QuietRelease
from services.worker.step_order import StepOrder
from services.worker.step_spans import record_step_spans
from services.worker.step_stream import replies_in_order
from services.worker import convert
from services.worker.engine.engine import Engine
from services.worker.engine.types import BlockEvent, StaleEpoch
from common.step import PoolStats, StepBatch, StepOutput
from services.worker.kv_events import CacheSnapshot
from services.worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)
RETRY_REGISTRATION_S = 0.5   # while the scheduler cannot be reached

T = TypeVar("T")


class EngineThread:
    """The one thread the engine runs on (it is not thread-safe, and torch releases the
    GIL while it computes): steps, stats and cache snapshots queue here in turn.

    `build` makes the engine on this thread too. On CPU that matters: OpenMP (torch's and
    the C kernels') keeps a team of threads for each thread that starts parallel work, and
    once it manages more threads than there are cores, libgomp stops spinning between
    parallel regions, so each of a step's regions waits for a futex wake-up. An engine
    prepared on the main thread left such a team there, and a batch-1 decode step on this
    thread took 27 ms instead of 15 (default model, 2 cores)."""

    def __init__(self, engine: Engine | None = None) -> None:
        self._engine = engine
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")

    @classmethod
    async def build(cls, make: Callable[[], Engine]) -> "EngineThread":
        """A thread whose engine `make` builds on it."""
        thread = cls()
        thread._engine = await thread.run(make)
        return thread

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise RuntimeError("the engine thread has no engine yet (EngineThread.build)")
        return self._engine

    async def run(self, function: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, function)

    async def snapshot(self) -> CacheSnapshot:
        """The engine's cached chains and whole prompts' partial blocks, taken together."""
        return await self.run(lambda: (self.engine.snapshot_chains(), self.engine.snapshot_partials()))

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


@dataclass
class StepCounters:
    steps: int = 0
    last_forward_ms: float = 0.0
    last_batch_tokens: int = 0
    computed_tokens: int = 0
    prompt_tokens: int = 0
    sampled_tokens: int = 0


class WorkerService(worker_pb2_grpc.WorkerServicer):
    """Serves Step/Info/Stats; steps run one at a time on the engine's thread, in the
    order the scheduler planned them.

    `on_block_events` is called on the engine's thread right after each step, so that
    a Stats call (queued on the same thread) sees every earlier step's events handed
    over; `kv_events_unacknowledged` says how many the index has not acknowledged."""

    def __init__(self, thread: EngineThread, worker_id: str, metrics: WorkerMetrics,
                 on_block_events: Callable[[list[BlockEvent]], None] | None = None,
                 kv_events_unacknowledged: Callable[[], int] | None = None,
                 after_step: Callable[[int, float], None] | None = None,
                 before_step: Callable[[bool], None] | None = None, quiet_release_s: float = 0.0) -> None:
        self._thread = thread
        self._engine = thread.engine
        self._worker_id = worker_id
        self._metrics = metrics
        self._order = StepOrder()   # pipelined steps run in the order the scheduler planned them
        self._on_block_events = on_block_events
        self._kv_events_unacknowledged = kv_events_unacknowledged
        self._after_step = after_step      # on the engine's thread: decode-only rows (else 0), wall (CPU thread pacer)
        self._before_step = before_step    # on the engine's thread: whether the step is decode-only (the same)
        self.counters = StepCounters()
        self.last_pool = self._engine.pool_stats()
        self._stop_token_ids = frozenset(self._engine.info.eos_token_ids)
        # Steps received that bring new sequences and have not started: a multi-step decode
        # in progress stops at its next run (decode_steps.py) rather than make them wait.
        self._arrivals_waiting = 0
        self._steps_received = 0        # steps received and not yet run to the end
        # What wide steps freed goes back once the worker has been quiet quiet_release_s (host/quiet_release.py).
        self.quiet_release = QuietRelease(
            quiet_release_s, lambda: getattr(self._engine, "holds_wide_step_memory", False),
            lambda: self._thread.run(self._engine.release_wide_step_memory))

    def _run_once(self, batch: StepBatch) -> StepOutput:
        """One run of the engine, between the CPU pacer's hooks."""
        decodes = not batch.new_sequences and all(item.num_tokens == 1 for item in batch.work)
        if self._before_step is not None:
            self._before_step(decodes)
        started = time.perf_counter()
        output = self._engine.step(batch)   # adopts or refuses the batch's epoch first
        if self._after_step is not None:
            self._after_step(len(batch.work) if decodes else 0, time.perf_counter() - started)
        return output

    def _run_step(self, batch: StepBatch) -> tuple[StepOutput, int]:
        if getattr(self._engine, "runs_decode_steps", False):   # it runs a step's decode runs itself
            output = self._run_once(batch)
        else:
            output = run_decode_steps(batch, self._run_once, self._stop_token_ids,
                                      interrupted=lambda: self._arrivals_waiting > 0)
        events = self._engine.drain_events()
        if events and self._on_block_events is not None:
            self._on_block_events(events)
        return output, self._engine.running_sequences()

    async def Step(self, request: worker_pb2.StepRequest, context: grpc.aio.ServicerContext):
        request_id_from(context)
        return await self._step(request, context)

    async def StepStream(self, requests: AsyncIterator[worker_pb2.StepRequest],
                         context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.StepResponse]:
        """The scheduler's steps over one call (step_stream.py): the same steps, in turn."""
        request_id_from(context)
        async for reply in replies_in_order(requests, lambda request: self._step(request, context)):
            yield reply

    async def _step(self, request: worker_pb2.StepRequest,
                    context: grpc.aio.ServicerContext) -> worker_pb2.StepResponse:
        batch = step_batch_from_proto(request)
        arrival = bool(batch.new_sequences)
        self._arrivals_waiting += arrival
        self._steps_received += 1
        self.quiet_release.step_received()
        try:
            async with self._order.turn(request.step_id, request.after_step_id, request.epoch):
                self._arrivals_waiting -= arrival
                arrival = False
                started_ns = time.time_ns()
                output, running = await self._thread.run(lambda: self._run_step(batch))
        except ValueError as error:  # malformed batch: the engine changed nothing
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        finally:
            self._arrivals_waiting -= arrival
            self._steps_received -= 1
        self.quiet_release.after_step(running, self._steps_received)
        record_step_spans(request.trace_context, batch, output, started_ns, time.time_ns(), self._worker_id)
        self._record(batch, output, running)
        self._log_step(batch, output)
        return convert.step_response_to_proto(request.step_id, output)

    @property
    def epoch(self) -> int:
        """The scheduler registration the engine serves."""
        return self._engine.epoch

    async def adopt_epoch(self, epoch: int) -> None:
        """A registration's epoch: what earlier ones left is freed now, not at
        the first step of the new one (which may be long in coming)."""
        def adopt() -> PoolStats:
            self._engine.adopt_epoch(epoch)
            events = self._engine.drain_events()
            if events and self._on_block_events is not None:
                self._on_block_events(events)
            return self._engine.pool_stats()
        try:
            self.last_pool = await self._thread.run(adopt)
        except StaleEpoch as error:
            log.warning("registration of an earlier epoch", extra={"error": str(error)})

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
        pool, running = await self._thread.run(
            lambda: (self._engine.pool_stats(), self._engine.running_sequences()))
        counters = self.counters
        unacknowledged = self._kv_events_unacknowledged() if self._kv_events_unacknowledged else 0
        return worker_pb2.WorkerStats(
            pool=pool_to_proto(pool), running_sequences=running, steps=counters.steps,
            last_forward_ms=counters.last_forward_ms, last_batch_tokens=counters.last_batch_tokens,
            total_prefill_tokens=counters.prompt_tokens,
            total_decode_tokens=counters.sampled_tokens, kv_events_unacknowledged=unacknowledged,
        )


async def keep_registered(channel: grpc.aio.Channel, worker_id: str, address: str,
                          service: WorkerService, interval_s: float, stop: asyncio.Event,
                          lost_after_s: float | None = None) -> None:
    """Registers with the scheduler, then heartbeats; registers again whenever
    the scheduler says it does not know us (it restarted, or timed us out).
    Returns when `stop` is set, or (with `lost_after_s`) once the scheduler has
    not been reached for that long (a shard gone: shard_choice.py chooses again)."""
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    registered = False
    unreachable_since: float | None = None
    while not stop.is_set():
        try:
            if not registered:
                reply = await stub.RegisterWorker(
                    scheduler_pb2.RegisterWorkerRequest(worker_id=worker_id, address=address,
                                                        epoch=service.epoch), timeout=5)
                registered = True
                interval_s = reply.heartbeat_interval_s or interval_s
                log.info("registered with the scheduler", extra={"worker_id": worker_id, "address": address,
                                                                 "epoch": reply.epoch})
                await service.adopt_epoch(reply.epoch)
            else:
                reply = await stub.Heartbeat(scheduler_pb2.HeartbeatRequest(worker_id=worker_id), timeout=5)
                registered = reply.known
                if not registered:
                    continue   # the scheduler restarted, or dropped us: register at once
        except grpc.aio.AioRpcError as error:
            registered = False
            refused = error.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            log.warning("scheduler refused the worker" if refused else "scheduler unreachable",
                        extra={"code": error.code().name, **({"reason": error.details()} if refused else {})})
            if not refused:
                unreachable_since = unreachable_since if unreachable_since is not None else time.monotonic()
                if lost_after_s is not None and time.monotonic() - unreachable_since >= lost_after_s:
                    return
        else:
            unreachable_since = None
        try:
            await asyncio.wait_for(stop.wait(), timeout=interval_s if registered else RETRY_REGISTRATION_S)
        except asyncio.TimeoutError:
            pass
