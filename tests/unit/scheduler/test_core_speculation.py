"""Speculative decoding in the core: decodes get a draft allowance, results with
several tokens stream them all, and nothing passes max_tokens or a stop token."""

from __future__ import annotations

import pytest

from common.types import SamplingParams
from services.scheduler.core.types import CoreConfig, FinishReason

from tests.unit.scheduler.fake_worker import EOS_TOKEN_ID, FakeEngine, hashed_next_token, reference_output
from tests.unit.scheduler.harness import Harness


def _config(depth: int, **overrides: object) -> CoreConfig:
    values: dict[str, object] = dict(max_steps_in_flight=depth, prefill_chunk_size=8, max_batch_size=4,
                                     speculative_tokens=3)
    values.update(overrides)
    return CoreConfig(**values)  # type: ignore[arg-type]


def _workload(h: Harness) -> dict[str, tuple[int, ...]]:
    prompts = {}
    for n in range(8):
        prompt = tuple(range(20 + 3 * n, 20 + 3 * n + 5 + 4 * n))
        prompts[h.submit(prompt, max_tokens=3 + 3 * n, priority=n % 3).request_id] = prompt
    h.run()
    return prompts


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("num_blocks", [256, 30])    # 30: preemptions and recomputes
def test_speculation_streams_the_reference_tokens_up_to_max_tokens(depth: int, num_blocks: int) -> None:
    engine = FakeEngine(num_blocks=num_blocks, accepted_drafts=2)
    h = Harness(_config(depth), engine)
    prompts = _workload(h)
    for rid, prompt in prompts.items():
        stream = h.streams[rid]
        assert stream.finish is not None and stream.finish.reason is FinishReason.LENGTH
        expected_len = 3 + 3 * list(prompts).index(rid)
        assert stream.token_ids == reference_output(prompt, expected_len)
        assert stream.finish.usage.completion_tokens == expected_len
    assert any(item.draft_tokens for plan in h.plans["w0"] for item in plan.work)
    engine.check_invariants()
    assert not engine.seqs and engine.pool().used_blocks == 0


def test_fewer_steps_than_tokens_when_drafts_are_accepted() -> None:
    plain, speculative = Harness(_config(1, speculative_tokens=0), FakeEngine()), Harness(_config(1), FakeEngine(accepted_drafts=3))
    for h in (plain, speculative):
        h.submit(range(10, 18), max_tokens=24)
        h.run()
    assert speculative.streams and [s.token_ids for s in speculative.streams.values()] == \
        [s.token_ids for s in plain.streams.values()]
    assert speculative.steps * 2 < plain.steps


@pytest.mark.parametrize("sampled_drafts", [False, True])
def test_sampled_requests_get_drafts_only_with_speculative_sampled(sampled_drafts: bool) -> None:
    h = Harness(_config(1, speculative_sampled=sampled_drafts), FakeEngine(accepted_drafts=2))
    greedy = h.submit(range(10, 18), max_tokens=12).request_id
    sampled = h.submit(range(30, 38), max_tokens=12, sampling=SamplingParams(temperature=0.7, seed=3)).request_id
    h.run()
    drafted = {rid: any(item.draft_tokens for plan in h.plans["w0"] for item in plan.work
                        if item.seq_id.startswith(rid)) for rid in (greedy, sampled)}
    assert drafted == {greedy: True, sampled: sampled_drafts}
    assert all(len(h.streams[rid].token_ids) == 12 for rid in (greedy, sampled))


def test_the_allowance_stays_within_max_tokens_even_if_every_draft_in_flight_is_kept() -> None:
    engine = FakeEngine(accepted_drafts=4)
    emitted = []
    run_step = engine.step

    def counting_step(plan):
        outcome = run_step(plan)
        emitted.extend(token for r in outcome.results if r.sampled for token in (r.token_id, *r.more_token_ids))
        return outcome

    engine.step = counting_step  # type: ignore[method-assign]
    h = Harness(_config(2, speculative_tokens=4), engine)
    rid = h.submit(range(10, 18), max_tokens=7).request_id
    h.run()
    assert len(h.streams[rid].tokens) == 7
    granted = [item.draft_tokens for plan in h.plans["w0"] for item in plan.work]
    assert max(granted) <= 4 and sum(granted) > 0
    assert len(emitted) == 7        # the worker never computed a token past max_tokens


def test_tokens_after_a_stop_token_are_dropped() -> None:
    prompt_len, stop_at = 8, 4

    def eos_at_four(tokens) -> int:
        return EOS_TOKEN_ID if len(tokens) == prompt_len + stop_at - 1 else hashed_next_token(tokens)

    engine = FakeEngine(next_token=eos_at_four, accepted_drafts=3)
    h = Harness(_config(2), engine)
    rid = h.submit(range(30, 30 + prompt_len), max_tokens=20).request_id
    h.run()
    stream = h.streams[rid]
    assert stream.finish is not None and stream.finish.reason is FinishReason.STOP
    assert stream.token_ids[-1] == EOS_TOKEN_ID and len(stream.tokens) == stop_at
    assert stream.finish.usage.completion_tokens == stop_at
    assert not engine.seqs and engine.pool().used_blocks == 0


def test_no_drafts_above_the_batch_limit_and_drafts_use_the_token_budget() -> None:
    h = Harness(_config(1, speculative_max_batch=2), FakeEngine(accepted_drafts=3))
    for n in range(3):
        h.submit(range(10 + 10 * n, 18 + 10 * n), max_tokens=6)
    h.run()
    for plan in h.plans["w0"]:
        decodes = [item for item in plan.work if item.num_tokens == 1]
        if len(decodes) > 2:
            assert all(item.draft_tokens == 0 for item in decodes)

    budget = Harness(_config(1, max_batch_tokens=3, speculative_tokens=8), FakeEngine(accepted_drafts=8))
    budget.submit(range(10, 12), max_tokens=12)
    budget.run()
    assert all(sum(i.num_tokens + i.draft_tokens for i in plan.work) <= 3 for plan in budget.plans["w0"])
    assert len(next(iter(budget.streams.values())).tokens) == 12
