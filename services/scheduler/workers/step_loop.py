"""One worker's step loop: plan a step in the core, send it over the worker's step link
(step_link.py), apply the reply, deliver what the streams get. With async scheduling
(max_steps_in_flight 2) the next step is planned and sent while the current one runs, so
the worker starts it as soon as the current one ends instead of waiting a round trip and
a planning pass; with multi-step decodes an arrival may deepen that pipeline by one
(SchedulerCore.step_depth). A step of frees alone (nothing else to run) lets the streams write
the events just delivered first: a request's last token does not wait behind that step's write.
All decisions are the core's; this is the transport around them."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc
from fairserve.v1 import worker_pb2, worker_pb2_grpc

from common.sequence_ids import request_id_of
from common.step import StepBatch
from common.step_convert import step_batch_to_proto, step_output_from_proto
from services.scheduler.core.scheduler import SchedulerCore
from services.scheduler.core.types import RequestUpdate
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.request_traces import RequestTraces
from services.scheduler.workers.step_link import StepFailed, UnarySteps, StreamSteps

log = logging.getLogger(__name__)


@dataclass(eq=False)
class WorkerLink:
    """A registered worker as the transport holds it: its channel, its Info, its loop's task
    and the event that wakes the loop (new work, a cancel, a drain)."""

    worker_id: str
    address: str
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.WorkerStub
    info: worker_pb2.WorkerInfo
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None


@dataclass
class _SentStep:
    call: asyncio.Future[Any]   # the step's reply (step_link.py)
    sent_at: float


@dataclass
class StepLoop:
    """Runs `link`'s steps while `is_current()` and the core still has the worker; a failed
    step or a bug in the loop drops the worker (`drop(worker_id, reason)`)."""

    link: WorkerLink
    core: SchedulerCore
    steps: UnarySteps | StreamSteps
    metrics: SchedulerMetrics
    traces: RequestTraces
    deliver: Callable[[Iterable[RequestUpdate]], None]
    drop: Callable[[str, str], Awaitable[None]]
    is_current: Callable[[], bool]

    async def run(self) -> None:
        link, core, worker_id = self.link, self.core, self.link.worker_id
        # With multi-step decodes an arrival may deepen the pipeline (SchedulerCore.step_depth):
        # the loop then waits for a reply or a wake-up even with every step slot taken.
        deepens = core.config.decode_steps > 1
        sent: deque[_SentStep] = deque()
        try:
            while self.is_current() and core.has_worker(worker_id):
                link.wake.clear()
                depth = core.step_depth(worker_id)
                if len(sent) < depth:
                    plan = core.plan_step(worker_id)
                    self.metrics.observe_queue_waits(core.drain_queue_waits())
                    if plan is not None:
                        if not plan.work:
                            # Frees alone (nothing else runs): the events just delivered go out
                            # first, a request's last token not waiting behind this step's write.
                            await asyncio.sleep(0)
                        _log_plan(worker_id, plan)
                        request = step_batch_to_proto(plan)
                        request.trace_context.update(self.traces.planned(worker_id, plan))
                        call = await self.steps.send(request)
                        sent.append(_SentStep(call, time.perf_counter()))
                        continue
                if not sent:
                    await link.wake.wait()
                    continue
                oldest = sent[0]
                if (len(sent) < depth or deepens) and not await _reply_or_wake(oldest.call, link.wake):
                    continue   # new work arrived: plan it before the reply
                try:
                    reply = await oldest.call
                except StepFailed as error:
                    await self.drop(worker_id, f"worker {worker_id} failed a step: {error}")
                    return
                sent.popleft()
                self.metrics.observe_step(worker_id, time.perf_counter() - oldest.sent_at)
                output = step_output_from_proto(reply)
                self.traces.applied(output)
                self.deliver(core.apply_step(worker_id, output))
        except asyncio.CancelledError:
            raise
        except Exception as error:  # a bug must not leave this worker's requests hanging
            log.exception("worker loop failed", extra={"worker_id": worker_id})
            await self.drop(worker_id, f"scheduler loop for worker {worker_id} failed: {error!r}")
        finally:
            for step in sent:
                step.call.cancel()
            self.steps.close()


async def _reply_or_wake(call: asyncio.Future[Any], wake: asyncio.Event) -> bool:
    """Waits for the step's reply or a wake-up; True when the reply is in."""
    woken = asyncio.ensure_future(wake.wait())
    try:
        await asyncio.wait({call, woken}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        woken.cancel()
    return call.done()


def _log_plan(worker_id: str, plan: StepBatch) -> None:
    for new in plan.new_sequences:
        log.info("sequence admitted", extra={
            "request_id": request_id_of(new.seq_id), "seq_id": new.seq_id, "worker_id": worker_id,
            "prompt_tokens": len(new.prompt_token_ids), "resumed_tokens": len(new.output_token_ids)})
    log.debug("step planned", extra={"worker_id": worker_id, "step_id": plan.step_id,
                                     "sequences": len(plan.work), "tokens": plan.num_tokens,
                                     "frees": len(plan.free_seq_ids)})
