"""A worker's books across steps in flight: settling an outcome, refusals, frees."""

from __future__ import annotations

from dataclasses import replace

from services.scheduler.core.state import InFlightStep
from common.step import PoolStats, StepOutput, StepBatch, WorkItem

from tests.unit.scheduler.plain_state import make_worker


def _in_flight(step_id: int, available_after: int) -> InFlightStep:
    plan = StepBatch(step_id=step_id, new_sequences=(), work=(WorkItem("s1", 1), WorkItem("s2", 3)), free_seq_ids=())
    return InFlightStep(plan, available_after, frozenset())


def _outcome(step_id: int, free_blocks: int) -> StepOutput:
    pool = PoolStats(total_blocks=64, free_blocks=free_blocks, cached_blocks=2, used_blocks=10)
    return StepOutput(step_id=step_id, results=(), pool=pool, forward_ms=7.5)


def test_settle_corrects_the_later_steps_by_what_the_pool_turned_out_to_be() -> None:
    worker = make_worker()
    worker.in_flight = [_in_flight(1, 20), _in_flight(2, 15)]
    done, echoes = worker.settle(_outcome(1, free_blocks=21))     # 23 available where 20 were expected
    assert done.plan.step_id == 1 and not echoes
    assert [s.available_after for s in worker.in_flight] == [18]
    assert worker.available_blocks() == 18 and worker.tokens_in_flight() == {"s1": 1, "s2": 3}
    assert (worker.steps, worker.last_step_ms, worker.last_batch_size, worker.pool.free_blocks) == (1, 7.5, 2, 21)


def test_a_refusal_holds_until_a_step_planned_after_it_has_run() -> None:
    worker = make_worker()
    worker.in_flight = [_in_flight(1, 20), _in_flight(2, 20)]
    worker.settle(_outcome(1, free_blocks=18))
    worker.note_refusal()                         # seen while step 2 was in flight
    worker.in_flight.append(_in_flight(3, 20))
    _, echoes = worker.settle(_outcome(2, free_blocks=18))
    assert echoes and worker.refused_allocation
    _, echoes = worker.settle(_outcome(3, free_blocks=18))
    assert not echoes and not worker.refused_allocation


def test_frees_wait_for_the_next_step_and_are_taken_once() -> None:
    worker = make_worker()
    worker.free_in_next_step("s1", 2)
    worker.free_in_next_step("s2", 3)
    assert worker.take_frees() == (["s1", "s2"], 5)
    assert worker.take_frees() == ([], 0)


def test_settle_keeps_the_time_a_run_of_the_last_decode_only_step() -> None:
    worker = make_worker()
    runs = StepBatch(step_id=1, work=(WorkItem("s1", 1, decode_steps=3), WorkItem("s2", 1, decode_steps=2)))
    prefill = StepBatch(step_id=2, work=(WorkItem("s3", 40),))
    worker.in_flight = [InFlightStep(runs, 20, frozenset(), decode_only=True), InFlightStep(prefill, 15, frozenset())]
    worker.settle(_outcome(1, free_blocks=20))
    assert (worker.decode_run_ms, worker.decode_run_decodes) == (2.5, 2)      # 7.5 ms over its 3 runs
    worker.settle(_outcome(2, free_blocks=15))                                 # a prefill's time is no run's
    assert (worker.decode_run_ms, worker.decode_run_decodes) == (2.5, 2)
    # A worker that says how many runs it ran (its sequences stopped early: caps, EOS) is read by that.
    worker.in_flight = [InFlightStep(replace(runs, step_id=3), 20, frozenset(), decode_only=True)]
    worker.settle(replace(_outcome(3, free_blocks=20), runs=2))
    assert (worker.decode_run_ms, worker.decode_run_decodes) == (3.75, 2)     # 7.5 ms over the 2 it ran
