"""One worker's step loop (workers/step_loop.py) around a scripted core and step link: a
step of frees alone (nothing else to run) goes out after the events its reply delivered
were handed to their streams, so a request's last token does not wait behind that write;
a step with work goes out at once."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
from fairserve.v1 import worker_pb2

from common.step import StepBatch, WorkItem
from services.scheduler.core.types import RequestUpdate
from services.scheduler.workers.step_loop import StepLoop, WorkerLink


@dataclass
class ScriptedCore:
    """Plans the scripted steps in turn (then nothing); each reply's updates are one update."""
    plans: list[StepBatch]
    config: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(decode_steps=1))

    def has_worker(self, worker_id: str) -> bool:
        return True

    def step_depth(self, worker_id: str) -> int:
        return 1

    def plan_step(self, worker_id: str) -> StepBatch | None:
        return self.plans.pop(0) if self.plans else None

    def drain_queue_waits(self) -> list[float]:
        return []

    def apply_step(self, worker_id: str, output: object) -> list[RequestUpdate]:
        return [RequestUpdate("r1")]


class ScriptedSteps:
    """Logs each step as it is sent; replies to steps with work at once, never to the others."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    async def send(self, request: worker_pb2.StepRequest) -> asyncio.Future[worker_pb2.StepResponse]:
        reply: asyncio.Future[worker_pb2.StepResponse] = asyncio.get_running_loop().create_future()
        kind = "work step" if request.work else "frees step"
        self.log.append(kind)
        if request.work:
            reply.set_result(worker_pb2.StepResponse(step_id=request.step_id))
        return reply

    def close(self) -> None:
        pass


async def _run(second: StepBatch) -> list[str]:
    log: list[str] = []
    delivered = asyncio.Event()
    link = WorkerLink("w0", "addr", channel=None, stub=None, info=worker_pb2.WorkerInfo())  # type: ignore[arg-type]

    async def stream_writer() -> None:      # as GenerateMany's writer waits for its events
        await delivered.wait()
        log.append("events written")
        link.wake.set()                     # the loop, idle by then, looks again and ends

    writer = asyncio.create_task(stream_writer())
    core = ScriptedCore([StepBatch(step_id=1, work=[WorkItem("r1", 4)]), second])
    loop = StepLoop(
        link=link,
        core=core,  # type: ignore[arg-type]
        steps=ScriptedSteps(log),  # type: ignore[arg-type]
        metrics=SimpleNamespace(observe_queue_waits=lambda waits: None, observe_step=lambda *args: None),  # type: ignore[arg-type]
        traces=SimpleNamespace(planned=lambda worker_id, plan: {}, applied=lambda output: None),  # type: ignore[arg-type]
        deliver=lambda updates: delivered.set(),
        drop=lambda worker_id, reason: asyncio.sleep(0),
        is_current=lambda: len(log) < 3)
    await asyncio.wait_for(loop.run(), timeout=5)
    await asyncio.wait_for(writer, timeout=5)
    return log


@pytest.mark.asyncio
async def test_a_step_of_frees_alone_goes_out_after_the_delivered_events() -> None:
    log = await _run(StepBatch(step_id=2, free_seq_ids=["r1"]))
    assert log == ["work step", "events written", "frees step"]


@pytest.mark.asyncio
async def test_a_step_with_work_goes_out_at_once() -> None:
    log = await _run(StepBatch(step_id=2, work=[WorkItem("r2", 4)], free_seq_ids=["r1"]))
    assert log == ["work step", "work step", "events written"]
