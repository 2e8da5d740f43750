"""Engine vs transformers on tiny random models: greedy tokens equal `generate`
token for token, and every sampled position's logits agree within LOGITS_ATOL.
The Gemma 3 config's sliding window (8) is shorter than most prompts here, so
windowed layers are exercised; test_engine_parity_gemma4.py reruns these tests
on Gemma 4 shapes."""

from __future__ import annotations

import torch

from common.block_hash import ROOT_HASH, chain_hashes
from common.types import SamplingParams
from common.step import NewSequence, StepBatch, WorkItem, StepError
from services.worker.engine.types import REMOVED, STORED
from tests.unit.worker.engine_helpers import (
    Driver,
    RecordingSampler,
    generate,
    make_engine,
    prompt_of,
)

LOGITS_ATOL = 1e-4


def _expect(reference: torch.nn.Module, prompts: dict[str, list[int]], new_tokens: int) -> dict[str, list[int]]:
    return {seq_id: generate(reference, prompt, new_tokens) for seq_id, prompt in prompts.items()}


def _assert_tokens_match(got: dict[str, list[int]], expected: dict[str, list[int]]) -> None:
    for seq_id, tokens in expected.items():
        assert got[seq_id][:len(tokens)] == tokens, seq_id


def test_mixed_batch_with_chunked_prefill_matches_generate(kind: str, reference: torch.nn.Module) -> None:
    engine = make_engine(kind)
    recorder = RecordingSampler(engine.sampler)
    engine.sampler = recorder
    prompts = {"short": prompt_of(3, 1), "mid": prompt_of(9, 2), "long": prompt_of(30, 3), "odd": prompt_of(17, 4)}
    # Small chunks keep prefills running while the short prompt already decodes.
    chunk = {"short": 64, "mid": 4, "long": 7, "odd": 5}
    driver = Driver(engine)
    got = driver.run(prompts, 10, chunk)
    _assert_tokens_match(got, _expect(reference, prompts, 10))
    assert any(out.batch_tokens > 1 and len(out.results) > 1 for out in driver.steps)

    # Every sampled row's logits against a full forward over what that sequence had seen.
    assert len(recorder.rows) == 40
    with torch.no_grad():
        for logits, seen in recorder.rows:
            expected = reference(torch.tensor([seen])).logits[0, -1]
            torch.testing.assert_close(logits, expected, atol=LOGITS_ATOL, rtol=0)
    assert engine.pool_stats().used_blocks == 0


def test_chunks_on_block_boundaries_and_single_token_chunks(kind: str, reference: torch.nn.Module) -> None:
    engine = make_engine(kind)
    prompts = {"a": prompt_of(12, 5), "b": prompt_of(13, 6), "c": prompt_of(6, 7)}
    got = Driver(engine).run(prompts, 6, {"a": 4, "b": 1, "c": 3})
    _assert_tokens_match(got, _expect(reference, prompts, 6))


def test_shared_prefix_blocks_are_reused(kind: str, reference: torch.nn.Module) -> None:
    engine = make_engine(kind, prompt_logits_cache_size=0)   # "again" recomputes its last token
    driver = Driver(engine)
    base = prompt_of(21, 8)
    driver.run({"first": base}, 5)
    # Same 16-token prefix (four blocks of 4), different tail.
    forked = base[:16] + prompt_of(6, 9)[1:]
    # The very same prompt: everything but the last block is reused.
    got = driver.run({"forked": forked, "again": list(base)}, 5)
    assert driver.cached == {"forked": 16, "again": 20}
    _assert_tokens_match(got, _expect(reference, {"forked": forked, "again": base}, 5))
    assert got["again"] == driver.outputs["first"]
    stats = engine.pool_stats()
    assert stats.prefix_hit_tokens == 36
    assert stats.prefix_query_tokens == 21 + 21 + 21


def test_running_sequences_share_blocks_and_block_aligned_prompt_copies_its_last_block(
        kind: str, reference: torch.nn.Module) -> None:
    engine = make_engine(kind, prompt_logits_cache_size=0)   # b recomputes its last token
    driver = Driver(engine)
    prompt = prompt_of(16, 10)
    driver.step(StepBatch(new_sequences=[NewSequence("a", prompt)], work=[WorkItem("a", 100)]))
    used_by_one = engine.pool_stats().used_blocks
    driver.step(StepBatch(new_sequences=[NewSequence("b", prompt)], work=[WorkItem("a", 1), WorkItem("b", 100)]))
    assert driver.cached == {"b": 15}
    # b shares a's first three blocks and copies the fourth into a block of its own,
    # where it recomputes only its last token.
    assert engine.pool_stats().used_blocks == used_by_one + 1 + 1
    for _ in range(4):
        driver.step(StepBatch(work=[WorkItem("a", 1), WorkItem("b", 1)]))
    expected = generate(reference, prompt, 6)
    assert driver.outputs["a"][:len(expected)] == expected[:len(driver.outputs["a"])]
    assert driver.outputs["b"] == driver.outputs["a"][:len(driver.outputs["b"])]
    assert engine.running_sequences() == 2


def test_out_of_blocks_changes_nothing_and_recovers(kind: str, reference: torch.nn.Module) -> None:
    engine = make_engine(kind, num_blocks=6)
    driver = Driver(engine)
    long_prompt, other = prompt_of(17, 11), prompt_of(9, 12)
    driver.step(StepBatch(new_sequences=[NewSequence("long", long_prompt), NewSequence("other", other)],
                          work=[WorkItem("long", 100)]))
    before = engine.pool_stats()
    out = engine.step(StepBatch(work=[WorkItem("other", 100)]))
    engine.check_invariants()
    assert [(r.seq_id, r.error, r.num_computed_tokens) for r in out.results] == [("other", StepError.OUT_OF_BLOCKS, 0)]
    assert out.pool == before and out.batch_tokens == 0
    # The running sequence is unaffected; after it is freed the other one fits.
    driver.step(StepBatch(work=[WorkItem("long", 1)]))
    driver.step(StepBatch(free_seq_ids=["long"], work=[WorkItem("other", 100)]))
    for _ in range(3):
        driver.step(StepBatch(work=[WorkItem("other", 1)]))
    assert driver.outputs["long"] == generate(reference, long_prompt, 2)[:2]
    expected = generate(reference, other, 4)
    assert driver.outputs["other"][:len(expected)] == expected


def test_resume_with_output_tokens_continues_the_same_text(kind: str, reference: torch.nn.Module) -> None:
    engine = make_engine(kind)
    driver = Driver(engine)
    prompt = prompt_of(10, 13)
    full = driver.run({"x": prompt}, 8)["x"]
    driver.step(StepBatch(new_sequences=[NewSequence("y", prompt, full[:4])], work=[WorkItem("y", 100)]))
    for _ in range(3):
        driver.step(StepBatch(work=[WorkItem("y", 1)]))
    assert driver.outputs["y"] == full[4:]


def test_seeded_sampling_does_not_depend_on_the_batch(kind: str) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    prompt = prompt_of(7, 14)
    alone = Driver(make_engine(kind)).run({"s": prompt}, 8, sampling={"s": seeded})["s"]
    crowd = {"s": prompt, "n1": prompt_of(12, 15), "n2": prompt_of(5, 16)}
    sampling = {"s": seeded, "n1": SamplingParams(temperature=0.7), "n2": SamplingParams(temperature=1.0, seed=9)}
    together = Driver(make_engine(kind)).run(crowd, 8, chunk={"n1": 3}, sampling=sampling)["s"]
    assert together == alone


def test_block_events_and_snapshot(kind: str) -> None:
    engine = make_engine(kind, num_blocks=8)
    driver = Driver(engine)
    prompt = prompt_of(13, 17)
    driver.step(StepBatch(new_sequences=[NewSequence("a", prompt)], work=[WorkItem("a", 100)]))
    expected = chain_hashes(prompt, 4, kind)
    events = engine.drain_events()
    assert [(e.kind, list(e.hashes), e.parent_hash) for e in events] == [(STORED, expected, ROOT_HASH)]
    assert engine.drain_events() == []
    # Three decodes complete the fourth block.
    for _ in range(3):
        driver.step(StepBatch(work=[WorkItem("a", 1)]))
    events = engine.drain_events()
    tokens = prompt + driver.outputs["a"]
    assert [(e.kind, list(e.hashes), e.parent_hash) for e in events] == [
        (STORED, [chain_hashes(tokens, 4, kind)[3]], expected[-1])]
    driver.step(StepBatch(free_seq_ids=["a"]))
    assert engine.snapshot_chains() == [(ROOT_HASH, chain_hashes(tokens, 4, kind)[:4])]
    # A 29-token prompt needs all 8 blocks: every cached block is evicted.
    driver.step(StepBatch(new_sequences=[NewSequence("b", prompt_of(29, 18))], work=[WorkItem("b", 100)]))
    removed = [h for e in engine.drain_events() if e.kind == REMOVED for h in e.hashes]
    assert sorted(removed) == sorted(chain_hashes(tokens, 4, kind)[:4])
    assert engine.pool_stats().evictions == 4
