"""FCFS iteration-level continuous batching, finishing and cancellation."""

from __future__ import annotations

from common.types import SamplingParams

from services.scheduler.core.types import CoreConfig, FinishReason, Gate

from tests.unit.scheduler.fake_worker import EOS_TOKEN_ID, FakeEngine, reference_output
from tests.unit.scheduler.harness import Harness

PROMPT = tuple(range(10, 18))


def test_a_new_request_joins_the_running_batch_at_the_next_step() -> None:
    h = Harness(CoreConfig(), FakeEngine())
    a = h.submit(PROMPT, max_tokens=6).request_id
    h.step()
    h.step()
    b = h.submit(PROMPT[::-1], max_tokens=3).request_id
    h.step()
    joined = h.plans["w0"][-1]
    assert [n.prompt_token_ids for n in joined.new_sequences] == [PROMPT[::-1]]
    assert len(joined.work) == 2 and joined.work[0].num_tokens == 1  # a's decode rides along
    h.run()
    assert h.streams[a].token_ids == reference_output(PROMPT, 6)
    assert h.streams[b].token_ids == reference_output(PROMPT[::-1], 3)


def test_a_finished_sequence_leaves_at_once_and_is_freed_in_the_next_step() -> None:
    engine = FakeEngine()
    h = Harness(CoreConfig(), engine)
    short = h.submit(PROMPT, max_tokens=2).request_id
    h.submit(PROMPT[::-1], max_tokens=5)
    h.step()
    h.step()
    assert h.streams[short].finish is not None and h.streams[short].finish.reason is FinishReason.LENGTH
    finished_seq = h.plans["w0"][0].new_sequences[0].seq_id
    h.step()
    last = h.plans["w0"][-1]
    assert last.free_seq_ids == (finished_seq,)
    assert [w.seq_id for w in last.work] != [finished_seq]
    assert finished_seq not in engine.seqs
    h.run()
    assert engine.pool().used_blocks == 0


def test_length_usage_and_one_event_per_token() -> None:
    h = Harness(CoreConfig(), FakeEngine())
    rid = h.submit(PROMPT, max_tokens=5).request_id
    h.run()
    stream = h.streams[rid]
    assert len(stream.tokens) == 5
    assert stream.finish is not None
    assert stream.finish.reason is FinishReason.LENGTH
    assert (stream.finish.usage.prompt_tokens, stream.finish.usage.completion_tokens) == (8, 5)


def _eos_after(generated_counts: set[int], prompt_len: int = len(PROMPT)):
    def next_token(tokens):
        return EOS_TOKEN_ID if len(tokens) - prompt_len in generated_counts else 100 + len(tokens)
    return next_token


def test_eos_stops_unless_ignored_and_respects_min_tokens() -> None:
    # The 3rd and the 6th generated tokens are EOS.
    engine = FakeEngine(next_token=_eos_after({2, 5}))
    h = Harness(CoreConfig(), engine)
    plain = h.submit(PROMPT, max_tokens=10).request_id
    ignoring = h.submit(PROMPT, max_tokens=10, ignore_eos=True).request_id
    at_least_four = h.submit(PROMPT, max_tokens=10, min_tokens=4).request_id
    h.run()
    assert h.streams[plain].finish.reason is FinishReason.STOP
    assert h.streams[plain].token_ids[-1] == EOS_TOKEN_ID and len(h.streams[plain].tokens) == 3
    assert h.streams[ignoring].finish.reason is FinishReason.LENGTH
    assert len(h.streams[ignoring].tokens) == 10
    assert h.streams[at_least_four].finish.reason is FinishReason.STOP
    assert len(h.streams[at_least_four].tokens) == 6


def test_stop_token_ids_finish_with_stop() -> None:
    expected = reference_output(PROMPT, 6)
    h = Harness(CoreConfig(), FakeEngine())
    rid = h.submit(PROMPT, max_tokens=6, stop_token_ids=frozenset({expected[3]})).request_id
    h.run()
    assert h.streams[rid].token_ids == expected[:4]
    assert h.streams[rid].finish.reason is FinishReason.STOP


def test_logprobs_pass_through_and_cached_tokens_come_from_the_worker() -> None:
    engine = FakeEngine(block_size=4)
    h = Harness(CoreConfig(), engine)
    first = h.submit(PROMPT + (99, 98), max_tokens=2,
                     sampling=SamplingParams(logprobs=True)).request_id
    h.run()
    second = h.submit(PROMPT + (99, 98), max_tokens=2).request_id
    h.run()
    assert all(t.logprob is not None and t.logprob.logprob == -0.5 for t in h.streams[first].tokens)
    assert h.streams[first].finish.usage.cached_tokens == 0
    assert h.streams[second].finish.usage.cached_tokens == 8  # two full blocks of the 10-token prompt
    assert h.streams[second].token_ids == h.streams[first].token_ids


def test_max_tokens_zero_means_up_to_the_context() -> None:
    h = Harness(CoreConfig(), FakeEngine(max_model_len=12))
    rid = h.submit(PROMPT, max_tokens=0).request_id
    h.run()
    assert len(h.streams[rid].tokens) == 4
    assert h.streams[rid].finish.reason is FinishReason.LENGTH


def test_cancelling_a_waiting_request_ends_it_without_touching_the_worker() -> None:
    h = Harness(CoreConfig(max_batch_size=1), FakeEngine())
    h.submit(PROMPT, max_tokens=3)
    waiting = h.submit(PROMPT[::-1], max_tokens=3).request_id
    h.step()
    assert h.cancel(waiting)
    assert h.streams[waiting].finish.reason is FinishReason.CANCELLED
    h.run()
    assert all(n.prompt_token_ids != PROMPT[::-1] for p in h.plans["w0"] for n in p.new_sequences)
    assert not h.cancel(waiting)


def test_cancelling_a_running_request_frees_its_blocks_at_the_next_step() -> None:
    engine = FakeEngine(prefix_caching=False)
    h = Harness(CoreConfig(), engine)
    rid = h.submit(PROMPT, max_tokens=50).request_id
    h.step()
    h.step()
    assert engine.pool().used_blocks > 0
    assert h.cancel(rid)
    stream = h.streams[rid]
    assert stream.finish.reason is FinishReason.CANCELLED
    assert stream.finish.usage.completion_tokens == 2
    h.step()
    assert h.plans["w0"][-1].free_seq_ids and not h.plans["w0"][-1].work
    assert engine.pool().used_blocks == 0 and engine.pool().free_blocks == engine.num_blocks
    assert h.core.stats().active == 0
    assert not h.step()  # nothing left to do: the worker idles


def test_batch_size_and_token_budgets_bound_every_step() -> None:
    config = CoreConfig(max_batch_size=3, max_batch_tokens=20, prefill_chunk_size=16)
    h = Harness(config, FakeEngine(num_blocks=256))
    ids = [h.submit(tuple(range(i, i + 30)), max_tokens=5).request_id for i in range(7)]
    h.run()
    for plan in h.plans["w0"]:
        assert len(plan.work) <= 3
        assert plan.num_tokens <= 20
        assert all(item.num_tokens <= 16 for item in plan.work)
    for i, rid in enumerate(ids):
        assert h.streams[rid].token_ids == reference_output(tuple(range(i, i + 30)), 5)
    assert h.core.stats().admitted == 7


def test_fcfs_admits_in_arrival_order_and_priority_comes_first() -> None:
    h = Harness(CoreConfig(max_batch_size=1), FakeEngine())
    first = h.submit(PROMPT, max_tokens=2).request_id
    second = h.submit(PROMPT, max_tokens=2).request_id
    urgent = h.submit(PROMPT, max_tokens=2, priority=5).request_id
    h.run()
    order = sorted(h.streams, key=lambda r: h.streams[r].first_token_step)
    assert order == [urgent, first, second]


def test_no_worker_means_unavailable() -> None:
    h = Harness(CoreConfig(), {})
    result = h.submit(PROMPT)
    assert result.rejection is not None and result.rejection.gate is Gate.NO_WORKER
