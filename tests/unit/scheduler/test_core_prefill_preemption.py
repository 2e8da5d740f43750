"""Chunked prefill (mixed and alternating) and preemption by recompute."""

from __future__ import annotations

from services.scheduler.core.types import CoreConfig, FinishReason, PrefillMode

from tests.unit.scheduler.fake_worker import FakeEngine, reference_output
from tests.unit.scheduler.harness import Harness

LONG_PROMPT = tuple(range(1000, 1100))  # 100 tokens


def _decoders(h: Harness, count: int) -> list[str]:
    ids = [h.submit((7, 8, 9, i), max_tokens=40).request_id for i in range(count)]
    h.step()
    return ids


def test_mixed_mode_chunks_ride_with_the_running_decodes() -> None:
    h = Harness(CoreConfig(prefill_chunk_size=32), FakeEngine(num_blocks=256))
    decoders = _decoders(h, 3)
    long_id = h.submit(LONG_PROMPT, max_tokens=4).request_id
    for _ in range(4):
        h.step()
    chunk_steps = h.plans["w0"][-4:]
    decode_seqs = {p.seq_id for p in h.plans["w0"][0].new_sequences}
    for plan, chunk in zip(chunk_steps, (32, 32, 32, 4)):
        decode_items = [w for w in plan.work if w.seq_id in decode_seqs]
        chunk_items = [w for w in plan.work if w.seq_id not in decode_seqs]
        assert [w.num_tokens for w in decode_items] == [1, 1, 1]  # every decoder advances each step
        assert [w.num_tokens for w in chunk_items] == [chunk]
    assert h.streams[long_id].first_token_step == h.steps - 1
    h.run()
    assert h.streams[long_id].token_ids == reference_output(LONG_PROMPT, 4)
    for i, rid in enumerate(decoders):
        assert h.streams[rid].token_ids == reference_output((7, 8, 9, i), 40)


def test_alternating_mode_separates_prefill_and_decode_steps() -> None:
    config = CoreConfig(prefill_chunk_size=32, prefill_mode=PrefillMode.ALTERNATING)
    h = Harness(config, FakeEngine(num_blocks=256))
    decoders = _decoders(h, 2)
    decode_seqs = {p.seq_id for p in h.plans["w0"][0].new_sequences}
    long_id = h.submit(LONG_PROMPT, max_tokens=4).request_id
    for _ in range(8):
        h.step()
    kinds = []
    for plan in h.plans["w0"][-8:]:
        seqs = {w.seq_id for w in plan.work}
        assert not (seqs & decode_seqs and seqs - decode_seqs), "a step mixed prefill and decodes"
        kinds.append("decode" if seqs <= decode_seqs else "prefill")
    # The decoders' own prefill ran last, so a decode step comes first.
    assert kinds == ["decode", "prefill"] * 4
    assert h.streams[long_id].first_token_step == h.steps - 1  # with the 4th prefill chunk
    h.run()
    assert h.streams[long_id].token_ids == reference_output(LONG_PROMPT, 4)
    assert all(h.streams[r].token_ids == reference_output((7, 8, 9, i), 40) for i, r in enumerate(decoders))


def _prompts(count: int) -> list[tuple[int, ...]]:
    return [tuple(range(50 * i, 50 * i + 12)) for i in range(count)]


def test_preemption_and_resumption_give_the_same_tokens_as_an_uninterrupted_run() -> None:
    # 5 requests of 12 + 30 tokens need up to 11 blocks each; 24 blocks cannot hold them all.
    engine = FakeEngine(num_blocks=24, block_size=4, prefix_caching=False)
    h = Harness(CoreConfig(), engine)
    ids = [h.submit(p, max_tokens=30).request_id for p in _prompts(5)]
    h.run()
    stats = h.core.stats()
    assert stats.preemptions > 0
    resumed = [n for plan in h.plans["w0"] for n in plan.new_sequences if n.output_token_ids]
    assert resumed, "no sequence came back with its generated tokens"
    for prompt, rid in zip(_prompts(5), ids):
        stream = h.streams[rid]
        assert stream.token_ids == reference_output(prompt, 30)  # nothing lost, nothing repeated
        assert stream.finish.reason is FinishReason.LENGTH
        assert stream.finish.usage.completion_tokens == 30
    assert engine.out_of_blocks_errors == 0  # the block math saw it coming
    assert engine.pool().used_blocks == 0 and not engine.seqs


def test_an_out_of_blocks_error_from_the_worker_triggers_a_preemption() -> None:
    # The pool claims 6 more free blocks than it has: the scheduler plans too
    # much and the worker refuses allocations instead.
    engine = FakeEngine(num_blocks=24, block_size=4, prefix_caching=False, overstate_free_blocks=6)
    h = Harness(CoreConfig(), engine)
    ids = [h.submit(p, max_tokens=30).request_id for p in _prompts(5)]
    h.run()
    assert engine.out_of_blocks_errors > 0
    assert h.core.stats().preemptions > 0
    for prompt, rid in zip(_prompts(5), ids):
        assert h.streams[rid].token_ids == reference_output(prompt, 30)
    assert engine.pool().used_blocks == 0


def test_the_lowest_priority_latest_arrival_is_preempted_first() -> None:
    engine = FakeEngine(num_blocks=12, block_size=4, prefix_caching=False)
    h = Harness(CoreConfig(), engine)
    starts = {0: 0, 1: 100, 2: 200}
    ids = {h.submit(tuple(range(s, s + 8)), max_tokens=20, priority=1 if s == 100 else 0).request_id: s
           for s in starts.values()}
    owner: dict[str, int] = {}
    preempted: list[int] = []
    while not all(stream.done for stream in h.streams.values()):
        seen = len(h.plans["w0"])
        h.step()
        for plan in h.plans["w0"][seen:]:
            owner.update({n.seq_id: n.prompt_token_ids[0] for n in plan.new_sequences})
            preempted += [owner[s] for s in plan.free_seq_ids
                          if not h.streams[_by_start(ids, owner[s])].done]
    assert preempted and preempted[0] == 200  # low priority, latest arrival
    assert 100 not in preempted  # the high-priority one was never chosen
    high = _by_start(ids, 100)
    assert all(h.streams[high].finish_step <= h.streams[r].finish_step for r in ids)
    for rid, start in ids.items():
        assert h.streams[rid].token_ids == reference_output(tuple(range(start, start + 8)), 20)


def _by_start(ids: dict[str, int], start: int) -> str:
    return next(rid for rid, s in ids.items() if s == start)


def test_a_4k_prompt_adds_at_most_one_chunk_to_each_step_of_eight_decoding_streams() -> None:
    h = Harness(CoreConfig(prefill_chunk_size=512),
                FakeEngine(num_blocks=2048, block_size=16, max_model_len=8192))
    for i in range(8):
        h.submit((7, 8, 9, i), max_tokens=30)
    h.step()
    long_id = h.submit(tuple(range(5000, 9096)), max_tokens=2).request_id
    for _ in range(8):
        h.step()
    decode_seqs = {n.seq_id for n in h.plans["w0"][0].new_sequences}
    for plan in h.plans["w0"][1:9]:
        decodes = [w.num_tokens for w in plan.work if w.seq_id in decode_seqs]
        chunks = [w.num_tokens for w in plan.work if w.seq_id not in decode_seqs]
        assert decodes == [1] * 8  # no decoding stream skips a step for the prompt
        assert chunks == [512]     # and each step carries one chunk more, no more
    assert h.streams[long_id].first_token_step == 8
    h.run()
