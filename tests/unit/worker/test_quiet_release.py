"""The worker's server hands a wide step's freed memory back right after a step that leaves no
sequence running when no other step has been received (`WorkerService._release_if_quiet`): on
the engine's thread, once, while the reply goes back; not while a sequence still runs (the
engine's own rule keeps a burst's memory until its end); not while another step waits; not when
no wide step ran; a release that fails is logged and serving goes on."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest
from prometheus_client import CollectorRegistry

from benchmarks.sim_engine import SimEngine
from common.step import NewSequence, StepBatch, StepOutput, WorkItem
from common.step_convert import step_batch_to_proto
from services.worker.metrics import WorkerMetrics
from services.worker.server import EngineThread, WorkerService

PROMPT = tuple(range(3, 40))


class HoldingEngine(SimEngine):
    """Holds a wide step's memory after each step with `wide` set; counts the releases and the
    thread each ran on; holds its `gate_at`-th step until the test opens the gate."""

    def __init__(self, gate_at: int = 0, fail: bool = False) -> None:
        super().__init__()
        self.runs_decode_steps = False
        self.holds_wide_step_memory = False
        self.wide = True
        self.fail = fail
        self.releases: list[str] = []
        self.runs = 0
        self.gate_at = gate_at
        self.reached, self.gate = threading.Event(), threading.Event()

    def step(self, batch: StepBatch) -> StepOutput:
        self.runs += 1
        if self.runs == self.gate_at:
            self.reached.set()
            assert self.gate.wait(10)
        output = super().step(batch)
        self.holds_wide_step_memory = self.holds_wide_step_memory or self.wide
        return output

    def release_wide_step_memory(self) -> bool:
        if self.fail:
            raise OSError("no release here")
        held, self.holds_wide_step_memory = self.holds_wide_step_memory, False
        if held:
            self.releases.append(threading.current_thread().name)
        return held


def _service(engine: HoldingEngine) -> tuple[WorkerService, EngineThread]:
    thread = EngineThread(engine)     # type: ignore[arg-type]
    metrics = WorkerMetrics(CollectorRegistry(), "w", engine.pool_stats(), {"device": "simulated"})
    return WorkerService(thread, "w", metrics), thread


def _free(step_id: int, name: str, after: int) -> object:
    return step_batch_to_proto(StepBatch(step_id=step_id, after_step_id=after, free_seq_ids=(name,)))


def _prefill(step_id: int, name: str, after: int = 0) -> object:
    return step_batch_to_proto(StepBatch(step_id=step_id, after_step_id=after,
                                         new_sequences=(NewSequence(name, PROMPT),),
                                         work=(WorkItem(name, len(PROMPT)),)))


async def _settled(service: WorkerService) -> None:
    await asyncio.gather(*service._releases)


async def test_the_step_that_leaves_nothing_running_releases_once_on_the_engine_thread() -> None:
    engine = HoldingEngine()
    service, thread = _service(engine)
    try:
        await service._step(_prefill(1, "a"), None)
        await _settled(service)
        assert engine.releases == []              # "a" still runs: the burst may go on
        engine.wide = False
        await service._step(_free(2, "a", after=1), None)
        await _settled(service)
        assert len(engine.releases) == 1 and engine.releases[0].startswith("engine")
        await service._step(_prefill(3, "b", after=2), None)
        await service._step(_free(4, "b", after=3), None)
        await _settled(service)
        assert len(engine.releases) == 1          # no wide step since: nothing to hand back
    finally:
        thread.shutdown()


async def test_no_release_while_another_step_waits() -> None:
    engine = HoldingEngine(gate_at=2)
    service, thread = _service(engine)
    try:
        await service._step(_prefill(1, "a"), None)
        first = asyncio.ensure_future(service._step(_free(2, "a", after=1), None))
        await asyncio.get_running_loop().run_in_executor(None, engine.reached.wait, 10)
        second = asyncio.ensure_future(service._step(_prefill(3, "b", after=2), None))
        await asyncio.sleep(0.05)                 # received, waiting for its turn
        engine.gate.set()
        await first
        assert service._releases == set()         # the step behind it goes first
        await second
        await service._step(_free(4, "b", after=3), None)
        await _settled(service)
        assert len(engine.releases) == 1          # after the last one, once
    finally:
        thread.shutdown()


async def test_a_failed_release_is_logged_and_steps_go_on(caplog: pytest.LogCaptureFixture) -> None:
    engine = HoldingEngine(fail=True)
    service, thread = _service(engine)
    try:
        with caplog.at_level(logging.WARNING, logger="services.worker.server"):
            await service._step(_prefill(1, "a"), None)
            await service._step(_free(2, "a", after=1), None)
            await asyncio.sleep(0.05)
            await service._step(_prefill(3, "b", after=2), None)
        assert "memory release after a step failed" in caplog.text
        assert engine.runs == 3
    finally:
        thread.shutdown()
