"""The worker's server ends a step's runs of decodes (multi-step decoding) when a step that
brings new sequences waits behind it: the arrival's prefill waits out at most the run in
progress, not every run one tenant's long generation was granted. A step behind it without
new sequences does not end them."""

from __future__ import annotations

import asyncio
import threading

from prometheus_client import CollectorRegistry

from benchmarks.sim_engine import SimEngine
from common.step import NewSequence, StepBatch, StepOutput, WorkItem
from common.step_convert import step_batch_to_proto
from services.worker.metrics import WorkerMetrics
from services.worker.server import EngineThread, WorkerService

PROMPT = tuple(range(3, 40))


class GatedEngine(SimEngine):
    """Holds its `gate_at`-th run until the test opens the gate."""

    def __init__(self, gate_at: int) -> None:
        super().__init__()
        self.runs_decode_steps = False    # the worker's loop runs them, as for the real engine
        self.runs = 0
        self.gate_at = gate_at
        self.reached = threading.Event()
        self.gate = threading.Event()

    def step(self, batch: StepBatch) -> StepOutput:
        self.runs += 1
        if self.runs == self.gate_at:
            self.reached.set()
            assert self.gate.wait(10)
        return super().step(batch)


async def _served(behind: StepBatch) -> tuple[int, int]:
    """(tokens of the 16-run step, runs the engine made) when `behind` arrives during its second run."""
    engine = GatedEngine(gate_at=3)   # run 1: the prefill step; runs 2..: the decodes' step
    thread = EngineThread(engine)     # type: ignore[arg-type]
    service = WorkerService(thread, "w", WorkerMetrics(CollectorRegistry(), "w", engine.pool_stats(),
                                                       {"device": "simulated"}))
    try:
        await service._step(step_batch_to_proto(StepBatch(
            step_id=1, new_sequences=(NewSequence("a", PROMPT),), work=(WorkItem("a", len(PROMPT)),))), None)
        runs = asyncio.ensure_future(service._step(step_batch_to_proto(StepBatch(
            step_id=2, after_step_id=1, work=(WorkItem("a", 1, 0, 16),))), None))
        await asyncio.get_running_loop().run_in_executor(None, engine.reached.wait, 10)
        waiting = asyncio.ensure_future(service._step(step_batch_to_proto(behind), None))
        await asyncio.sleep(0.05)         # the step behind is received and waits its turn
        engine.gate.set()
        reply, _ = await asyncio.gather(runs, waiting)
        (result,) = reply.results
        return 1 + len(result.more_token_ids), engine.runs
    finally:
        thread.shutdown()


async def test_an_arrival_ends_the_runs_at_the_next_one() -> None:
    arrival = StepBatch(step_id=3, after_step_id=2, new_sequences=(NewSequence("b", PROMPT),),
                        work=(WorkItem("b", len(PROMPT)),))
    tokens, runs = await _served(arrival)
    assert tokens == 2                  # the run in progress when it arrived, and the one before
    assert runs == 1 + 2 + 1            # prefill, two runs, the arrival's step


async def test_a_step_without_new_sequences_lets_the_runs_finish() -> None:
    decode = StepBatch(step_id=3, after_step_id=2, work=(WorkItem("a", 1),))
    tokens, runs = await _served(decode)
    assert tokens == 16 and runs == 1 + 16 + 1
