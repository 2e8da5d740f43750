"""What planning assumes about steps in flight, and retiring it."""

from __future__ import annotations

from services.scheduler.core.in_flight import dispatch, retire
from services.scheduler.core.state import InFlightStep, Phase
from common.step import StepBatch, WorkItem

from tests.unit.scheduler.plain_state import make_request


def _step(*work: WorkItem) -> StepBatch:
    return StepBatch(step_id=1, new_sequences=(), work=work, free_seq_ids=())


def test_dispatch_counts_the_work_as_computed_and_samples_only_a_chunk_that_reaches_the_end() -> None:
    first_chunk = make_request(1, prompt=tuple(range(10)), phase=Phase.PREFILLING)
    last_chunk = make_request(2, prompt=tuple(range(10)), phase=Phase.PREFILLING, num_computed=6)
    decode = make_request(3, prompt=tuple(range(10)), phase=Phase.ACTIVE, num_computed=9)
    by_seq = {r.seq_id: r for r in (first_chunk, last_chunk, decode)}
    step = _step(WorkItem("s1", 4), WorkItem("s2", 4), WorkItem("s3", 1, 3))
    assert dispatch(step, by_seq) == frozenset({"s2", "s3"})
    assert [r.num_computed for r in (first_chunk, last_chunk, decode)] == [4, 10, 10]
    assert [(r.inflight_samples, r.inflight_drafts) for r in (first_chunk, last_chunk, decode)] == \
        [(0, 0), (1, 0), (1, 3)]
    # Planned on top of the step in flight: the decode now needs the sample that step brings.
    assert dispatch(_step(WorkItem("s3", 1)), by_seq) == frozenset({"s3"})
    assert (decode.num_computed, decode.worker_tokens, decode.inflight_samples) == (11, 12, 2)


def test_retire_undoes_the_counts_of_requests_still_running_on_the_worker_only() -> None:
    stays = make_request(1, phase=Phase.ACTIVE)
    moved = make_request(2, phase=Phase.ACTIVE, worker_id="w1")
    stays.inflight_samples, stays.inflight_drafts = 2, 5
    moved.inflight_samples, moved.inflight_drafts = 1, 2
    gone = make_request(3, phase=Phase.ACTIVE)      # finished: no longer in by_seq
    step = _step(WorkItem("s1", 1, 3), WorkItem("s2", 1, 2), WorkItem(gone.seq_id or "", 1, 1))
    retire(InFlightStep(step, 0, frozenset({"s1", "s2", "s3"})), {"s1": stays, "s2": moved}, "w0")
    assert (stays.inflight_samples, stays.inflight_drafts) == (1, 2)
    assert (moved.inflight_samples, moved.inflight_drafts) == (1, 2)
