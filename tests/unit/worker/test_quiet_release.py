"""The worker's server hands a wide step's freed memory back once a step leaves no sequence
running and no other step has been received (host/quiet_release.py): with HOST_MEMORY_QUIET_RELEASE_S
0 right after that step, on the engine's thread, once, while the reply goes back; with a delay,
once no step has come for that long, a step received meanwhile putting it off to the next quiet
point; never while a sequence still runs (the engine's own rule keeps a burst's memory until its
end), while another step waits or when no wide step ran; a release that fails is logged and
serving goes on."""

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


def _service(engine: HoldingEngine, delay_s: float = 0.0) -> tuple[WorkerService, EngineThread]:
    thread = EngineThread(engine)     # type: ignore[arg-type]
    metrics = WorkerMetrics(CollectorRegistry(), "w", engine.pool_stats(), {"device": "simulated"})
    return WorkerService(thread, "w", metrics, quiet_release_s=delay_s), thread


def _free(step_id: int, name: str, after: int) -> object:
    return step_batch_to_proto(StepBatch(step_id=step_id, after_step_id=after, free_seq_ids=(name,)))


def _prefill(step_id: int, name: str, after: int = 0) -> object:
    return step_batch_to_proto(StepBatch(step_id=step_id, after_step_id=after,
                                         new_sequences=(NewSequence(name, PROMPT),),
                                         work=(WorkItem(name, len(PROMPT)),)))


async def _settled(service: WorkerService) -> None:
    await asyncio.gather(*service.quiet_release._tasks)


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
        assert service.quiet_release._tasks == set()    # the step behind it goes first
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
        with caplog.at_level(logging.WARNING, logger="services.worker.host.quiet_release"):
            await service._step(_prefill(1, "a"), None)
            await service._step(_free(2, "a", after=1), None)
            await asyncio.sleep(0.05)
            await service._step(_prefill(3, "b", after=2), None)
        assert "memory release after a step failed" in caplog.text
        assert engine.runs == 3
    finally:
        thread.shutdown()


async def test_with_a_delay_the_release_waits_for_a_quiet_spell() -> None:
    engine = HoldingEngine()
    service, thread = _service(engine, delay_s=0.1)
    try:
        await service._step(_prefill(1, "a"), None)
        await service._step(_free(2, "a", after=1), None)
        assert service.quiet_release.armed and engine.releases == []
        await asyncio.sleep(0.3)
        await _settled(service)
        assert len(engine.releases) == 1 and engine.releases[0].startswith("engine")
        assert not service.quiet_release.armed and service.quiet_release.releases == 1
    finally:
        thread.shutdown()


async def test_a_step_within_the_delay_puts_the_release_off_to_the_next_quiet_point() -> None:
    """A prompt that follows the one just prefilled (a shared prefix's last tokens) runs
    before the release: it is not slowed by it."""
    engine = HoldingEngine()
    service, thread = _service(engine, delay_s=0.2)
    try:
        await service._step(_prefill(1, "a"), None)
        await service._step(_free(2, "a", after=1), None)
        engine.wide = False
        await service._step(_prefill(3, "b", after=2), None)     # received: the release waits
        assert not service.quiet_release.armed
        await asyncio.sleep(0.3)
        assert engine.releases == []                             # "b" still runs
        await service._step(_free(4, "b", after=3), None)
        assert service.quiet_release.armed
        await asyncio.sleep(0.3)
        await _settled(service)
        assert len(engine.releases) == 1
    finally:
        thread.shutdown()
