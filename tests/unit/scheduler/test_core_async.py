"""Async scheduling: the next step is planned while the current one is in flight."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from services.scheduler.core.types import CoreConfig, FinishReason
from common.step import SeqResult, StepBatch, StepError, StepOutput

from tests.unit.scheduler.fake_worker import EOS_TOKEN_ID, FakeEngine, hashed_next_token, reference_output
from tests.unit.scheduler.harness import Harness

ASYNC = CoreConfig(max_steps_in_flight=2, prefill_chunk_size=8, max_batch_size=4)


class CountingEngine(FakeEngine):
    """Counts the tokens it samples per request (a sequence id starts with its request id)."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.sampled: Counter[str] = Counter()

    def step(self, plan: StepBatch) -> StepOutput:
        outcome = super().step(plan)
        for result in outcome.results:
            if result.sampled:
                self.sampled[result.seq_id.split("/")[0]] += 1
        return outcome


def test_the_next_step_is_planned_from_the_one_in_flight() -> None:
    h = Harness(ASYNC, FakeEngine())
    rid = h.submit(range(10, 14), max_tokens=5).request_id
    first = h.core.plan_step("w0")
    second = h.core.plan_step("w0")
    assert first is not None and second is not None
    assert first.after_step_id == 0 and second.after_step_id == first.step_id
    (new,) = first.new_sequences
    assert [(w.seq_id, w.num_tokens) for w in first.work] == [(new.seq_id, 4)]
    # The prompt's last token samples in the first step, so the second decodes the token it samples.
    assert [(w.seq_id, w.num_tokens) for w in second.work] == [(new.seq_id, 1)]
    with pytest.raises(RuntimeError, match="in flight"):
        h.core.plan_step("w0")
    engine = h.engines["w0"]
    h.deliver(h.core.apply_step("w0", engine.step(first)))
    h.deliver(h.core.apply_step("w0", engine.step(second)))
    assert h.streams[rid].token_ids == reference_output(range(10, 14), 2)


def test_an_outcome_out_of_order_is_ignored() -> None:
    h = Harness(ASYNC, FakeEngine())
    h.submit(range(10, 14), max_tokens=5)
    first, second = h.core.plan_step("w0"), h.core.plan_step("w0")
    assert first is not None and second is not None
    stale = StepOutput(step_id=second.step_id, results=(), pool=h.engines["w0"].pool(), forward_ms=1.0)
    assert h.core.apply_step("w0", stale) == []
    assert [s.plan.step_id for s in h.core._workers["w0"].in_flight] == [first.step_id, second.step_id]


def _workload(h: Harness, cancel_at: int | None = None) -> dict[str, tuple[int, ...]]:
    prompts = {}
    for n in range(10):
        prompt = tuple(range(20 + 3 * n, 20 + 3 * n + 5 + 4 * n))
        prompts[h.submit(prompt, max_tokens=3 + 2 * n, priority=n % 3).request_id] = prompt
    for _ in range(cancel_at or 0):
        h.step()
    if cancel_at is not None:
        h.cancel(next(iter(prompts)))
    h.run()
    return prompts


@pytest.mark.parametrize("num_blocks", [256, 24])     # 24: preemptions and recomputes
def test_async_scheduling_streams_the_same_tokens_as_sync(num_blocks: int) -> None:
    streams = {}
    for depth in (1, 2):
        engine = CountingEngine(num_blocks=num_blocks)
        h = Harness(CoreConfig(max_steps_in_flight=depth, prefill_chunk_size=8, max_batch_size=4), engine)
        prompts = _workload(h, cancel_at=6)
        for rid, prompt in prompts.items():
            assert h.streams[rid].token_ids == reference_output(prompt, len(h.streams[rid].tokens))
        engine.check_invariants()
        assert not engine.seqs and engine.pool().used_blocks == 0
        streams[depth] = {rid: (s.token_ids, s.finish.reason if s.finish else None) for rid, s in h.streams.items()}
    assert streams[1] == streams[2]


def test_no_token_is_computed_past_max_tokens() -> None:
    engine = CountingEngine(num_blocks=256)
    h = Harness(ASYNC, engine)
    prompts = _workload(h)
    for rid in prompts:
        stream = h.streams[rid]
        assert stream.finish is not None and stream.finish.reason is FinishReason.LENGTH
        assert engine.sampled[rid] == len(stream.tokens)


def test_a_stop_token_ends_the_stream_and_its_one_extra_token_is_dropped() -> None:
    stop_after = 3

    def eos_after_three(tokens) -> int:
        return EOS_TOKEN_ID if len(tokens) == 8 + stop_after - 1 else hashed_next_token(tokens)

    engine = CountingEngine(num_blocks=64, next_token=eos_after_three)
    h = Harness(ASYNC, engine)
    rid = h.submit(range(30, 38), max_tokens=20).request_id
    h.run()
    stream = h.streams[rid]
    assert stream.finish is not None and stream.finish.reason is FinishReason.STOP
    assert stream.token_ids[-1] == EOS_TOKEN_ID and len(stream.tokens) == stop_after
    assert engine.sampled[rid] == stop_after + 1          # the step planned before the EOS was known
    assert not engine.seqs and engine.pool().used_blocks == 0


def test_a_cancel_while_two_steps_are_in_flight_frees_the_sequence_after_them() -> None:
    engine = FakeEngine(num_blocks=64)
    h = Harness(ASYNC, engine)
    rid = h.submit(range(40, 44), max_tokens=50).request_id
    for _ in range(4):
        h.step()
    assert len(h.sent["w0"]) == 1                        # one planned ahead, waiting to run
    tokens_before = len(h.streams[rid].tokens)
    assert h.cancel(rid)
    h.run()
    stream = h.streams[rid]
    assert stream.finish is not None and stream.finish.reason is FinishReason.CANCELLED
    assert len(stream.tokens) == tokens_before            # the step in flight's token is not streamed
    assert not engine.seqs and engine.pool().used_blocks == 0


def test_the_pool_estimate_is_corrected_by_each_outcome() -> None:
    engine = FakeEngine(num_blocks=64, prefix_caching=True)
    h = Harness(ASYNC, engine)
    prompt = tuple(range(50, 66))
    h.submit(prompt, max_tokens=2)
    h.run()
    h.submit(prompt, max_tokens=4)      # its cached blocks leave the evictable pool: the plan did not count them
    worker = h.core._workers["w0"]
    first, second = h.core.plan_step("w0"), h.core.plan_step("w0")
    assert first is not None and second is not None
    estimate_after_first, estimate_after_second = (s.available_after for s in worker.in_flight)
    outcome = engine.step(first)
    h.deliver(h.core.apply_step("w0", outcome))
    surprise = outcome.pool.available_blocks - estimate_after_first
    assert surprise != 0
    assert worker.in_flight[0].available_after == estimate_after_second + surprise
    assert worker.available_blocks() == estimate_after_second + surprise
    h.deliver(h.core.apply_step("w0", engine.step(second)))
    assert worker.available_blocks() == worker.pool.available_blocks     # nothing in flight: the snapshot


def test_a_one_token_request_waits_for_its_first_chunk_before_the_next() -> None:
    """An identical prompt is served from the worker's cache past its first chunk, which samples
    at the prompt's end: with max_tokens 1 a second chunk planned meanwhile would be a decode
    whose token is thrown away. So a one-token request's second chunk waits for the first's
    reply (a cold one pays that round trip once); longer requests keep their chunks pipelined."""
    engine = CountingEngine(num_blocks=64, prefix_caching=True)
    h = Harness(ASYNC, engine)
    prompt = tuple(range(50, 83))                       # 33 tokens: 5 chunks of 8 when cold
    for cached in (0, 32):
        rid = h.submit(prompt, max_tokens=1).request_id
        first, second = h.core.plan_step("w0"), h.core.plan_step("w0")
        assert first is not None and [w.num_tokens for w in first.work] == [8]
        assert second is None or not second.work        # nothing planned behind the first chunk
        h.deliver(h.core.apply_step("w0", engine.step(first)))
        if second is not None:
            h.deliver(h.core.apply_step("w0", engine.step(second)))
        h.run()
        assert h.streams[rid].token_ids == reference_output(prompt, 1)
        finish = h.streams[rid].finish
        assert finish is not None and finish.usage.cached_tokens == cached
        assert engine.sampled[rid] == 1                 # no forward sampled a token thrown away

    longer = h.submit(prompt, max_tokens=3).request_id
    first, second = h.core.plan_step("w0"), h.core.plan_step("w0")
    assert first is not None and second is not None and second.work   # its next step is its first decode
    h.deliver(h.core.apply_step("w0", engine.step(first)))
    h.deliver(h.core.apply_step("w0", engine.step(second)))
    h.run()
    assert h.streams[longer].token_ids == reference_output(prompt, 3)


def test_a_one_token_request_whose_first_chunk_is_refused_plans_it_again() -> None:
    """A first chunk refused for blocks is no longer in flight: the request, not the one
    preempted to make room, must be planned again, though the worker reported tokens it
    holds (a cached prefix) and no reply has said what was cached yet."""
    engine = CountingEngine(num_blocks=64)
    h = Harness(ASYNC, engine)
    other = h.submit(range(200, 210), max_tokens=40).request_id
    for _ in range(3):                                  # one step at a time: nothing left in flight
        plan = h.core.plan_step("w0")
        assert plan is not None
        h.deliver(h.core.apply_step("w0", engine.step(plan)))
    one = h.submit(tuple(range(50, 83)), max_tokens=1, priority=5).request_id    # the other is the victim
    plan = h.core.plan_step("w0")
    assert plan is not None
    seq_id = next(item.seq_id for item in plan.work if item.num_tokens > 1)
    outcome = engine.step(plan)
    refused = tuple(SeqResult(seq_id=r.seq_id, num_computed_tokens=4, error=StepError.OUT_OF_BLOCKS)
                    if r.seq_id == seq_id else r for r in outcome.results)
    h.deliver(h.core.apply_step("w0", dataclasses.replace(outcome, results=refused)))
    h.run()
    assert h.streams[one].token_ids == reference_output(tuple(range(50, 83)), 1)
    assert h.streams[other].finish is not None
