"""Identical prompts with their K/V and last position kept skip the forward: the first
token comes from the kept rows of logits or the kept final hidden state, the prompt's
blocks are reused, and what follows is the same as a cold run's. The cache itself:
LRU, private copies, a screened row serving its own draw only."""

from __future__ import annotations

import pytest
import torch

from common.types import SamplingParams
from services.worker.engine.engine import Engine
from common.step import NewSequence, StepBatch, WorkItem
from services.worker.engine.sampling.prompt_logits import (MAX_SCREENED_PICKS, KeptPrompt, PromptLogitsCache,
                                                          prompt_key)
from tests.unit.worker.engine_helpers import (
    Driver,
    RecordingSampler,
    decode_and_free,
    first_step,
    generate,
    make_engine,
    prompt_of,
    recording_engine,
)

BLOCK_SIZE = 4


def _recording_engine(kind: str, **config) -> tuple[Engine, RecordingSampler]:
    return recording_engine(kind, block_size=BLOCK_SIZE, **config)


@pytest.mark.parametrize("prompt_len,cold_new_tokens", [
    (15, 1),    # a partial last block, copied
    (14, 6),    # the cold run's output completed the prompt's last block
    (16, 1),    # block-aligned: every block reused by reference
    (3, 1),     # no full block
])
def test_identical_prompt_computes_nothing(kind: str, reference: torch.nn.Module,
                                           prompt_len: int, cold_new_tokens: int) -> None:
    engine, recorder = _recording_engine(kind)
    driver = Driver(engine)
    prompt = prompt_of(prompt_len, prompt_len)
    cold = driver.run({"cold": prompt}, cold_new_tokens)["cold"]
    hits_before = engine.pool_stats().prefix_hit_tokens

    assert first_step(driver, "warm", prompt) == (prompt_len, prompt_len, 0)
    assert (driver.steps[-1].prompt_logits_hits, driver.steps[-1].prompt_tokens) == (1, 0)
    torch.testing.assert_close(recorder.rows[cold_new_tokens][0], recorder.rows[0][0], atol=0, rtol=0)
    warm = decode_and_free(driver, "warm", 6)
    assert warm[:cold_new_tokens] == cold
    assert warm == generate(reference, prompt, 6)[:len(warm)]
    assert engine.pool_stats().prefix_hit_tokens - hits_before == prompt_len
    assert first_step(driver, "third", prompt)[2] == 0
    assert decode_and_free(driver, "third", 6) == warm


def test_exact_match_rides_along_a_batch_that_computes(kind: str, reference: torch.nn.Module) -> None:
    engine, _recorder = _recording_engine(kind)
    driver = Driver(engine)
    prompt, other = prompt_of(11, 1), prompt_of(9, 2)
    driver.run({"cold": prompt}, 1)
    out = driver.step(StepBatch(new_sequences=[NewSequence("warm", prompt), NewSequence("other", other)],
                                work=[WorkItem("warm", 64), WorkItem("other", 64)]))
    assert out.batch_tokens == out.prompt_tokens == len(other)
    assert out.prompt_logits_hits == 1
    assert [r.num_cached_tokens for r in out.results] == [len(prompt), 0]
    while len(driver.outputs["warm"]) < 5 or len(driver.outputs["other"]) < 5:
        live = [s for s in ("warm", "other") if len(driver.outputs[s]) < 5]
        driver.step(StepBatch(work=[WorkItem(s, 1) for s in live]))
    assert driver.outputs["warm"] == generate(reference, prompt, 5)[:len(driver.outputs["warm"])]
    assert driver.outputs["other"] == generate(reference, other, 5)[:len(driver.outputs["other"])]


def test_seeded_sampling_from_kept_logits_matches_the_cold_draw(kind: str) -> None:
    engine = make_engine(kind, block_size=BLOCK_SIZE)
    driver = Driver(engine)
    prompt = prompt_of(13, 3)
    params = SamplingParams(temperature=1.0, seed=1234)
    cold = driver.run({"cold": prompt}, 6, sampling={"cold": params})["cold"]
    assert first_step(driver, "warm", prompt, params)[2] == 0
    assert decode_and_free(driver, "warm", 6) == cold


def test_penalties_do_not_change_the_kept_logits(kind: str) -> None:
    engine = make_engine(kind, block_size=BLOCK_SIZE)
    driver = Driver(engine)
    prompt = prompt_of(10, 4)
    cold = driver.run({"cold": prompt}, 1)["cold"]
    penalized = SamplingParams(repetition_penalty=5.0, presence_penalty=2.0)
    assert first_step(driver, "penalized", prompt, penalized)[2] == 0
    driver.step(StepBatch(free_seq_ids=["penalized"]))
    assert first_step(driver, "greedy", prompt)[2] == 0
    assert driver.outputs["greedy"] == cold


def test_evicted_blocks_fall_back_to_computing(kind: str, reference: torch.nn.Module) -> None:
    engine = make_engine(kind, num_blocks=5, block_size=BLOCK_SIZE)
    driver = Driver(engine)
    prompt = prompt_of(15, 5)
    driver.run({"cold": prompt}, 1)
    driver.run({"filler": prompt_of(19, 6)}, 1)     # needs all five blocks: the prompt's are gone
    cached, computed, batch = first_step(driver, "again", prompt)
    assert (cached, computed, batch) == (0, len(prompt), len(prompt))
    assert decode_and_free(driver, "again", 3) == generate(reference, prompt, 3)[:3]


def test_sequence_resumed_with_output_tokens_is_computed(kind: str) -> None:
    engine = make_engine(kind, block_size=BLOCK_SIZE)
    driver = Driver(engine)
    prompt = prompt_of(10, 7)
    cold = driver.run({"cold": prompt}, 3)["cold"]
    # A preempted sequence comes back with its output so far: its next token's logits
    # are not the prompt's, so they must be computed.
    resumed = NewSequence("resumed", prompt, cold[:2])
    out = driver.step(StepBatch(new_sequences=[resumed], work=[WorkItem("resumed", 64)]))
    assert out.batch_tokens >= 1
    assert out.results[0].token_id == cold[2]


def test_cache_disabled_with_prefix_caching(kind: str) -> None:
    engine = make_engine(kind, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    assert engine.prompt_logits.capacity == 0
    driver = Driver(engine)
    prompt = prompt_of(10, 8)
    driver.run({"cold": prompt}, 1)
    assert len(engine.prompt_logits) == 0
    assert first_step(driver, "again", prompt)[2] == len(prompt)


# ---- the cache itself ----------------------------------------------------------------------


def test_cache_evicts_least_recently_used() -> None:
    cache = PromptLogitsCache(capacity=2)
    a, b, c = prompt_key(1, [1]), prompt_key(1, [2]), prompt_key(2, ())
    cache.put(a, torch.zeros(4))
    cache.put(b, torch.ones(4))
    assert cache.get(a) is not None          # a is now the most recent
    cache.put(c, torch.full((4,), 2.0))
    assert cache.contains(a) and cache.contains(c) and not cache.contains(b)
    assert len(cache) == 2 and cache.hits == 1


def test_cache_keeps_its_own_copy() -> None:
    cache = PromptLogitsCache(capacity=1)
    row = torch.zeros(3)
    cache.put(prompt_key(0, [5]), row)
    row += 1
    stored = cache.get(prompt_key(0, [5]))
    assert stored is not None and stored.hidden.tolist() == [0.0, 0.0, 0.0]


def test_a_screened_row_serves_its_own_pick_only() -> None:
    kept = KeptPrompt(torch.zeros(2))
    screened = torch.tensor([float("-inf"), 3.0, float("-inf"), 1.0])
    kept.keep_logits(screened, (1, ()))
    assert torch.equal(kept.logits_for((1, ())), screened)
    assert kept.logits_for((2, ())) is None          # reads more best tokens than it kept
    assert kept.logits_for((1, (0,))) is None        # another token adjusted
    assert kept.logits_for(None) is None             # a draw over the whole row
    screened[1] = 0.0
    assert kept.logits_for((1, ()))[1] == 3.0        # its own copy


def test_a_complete_row_serves_every_draw_and_screened_rows_are_bounded() -> None:
    kept = KeptPrompt(torch.zeros(2))
    for count in range(1, MAX_SCREENED_PICKS + 2):
        kept.keep_logits(torch.tensor([float(count), float("-inf")]), (count, ()))
    assert kept.logits_for((1, ())) is None and len(kept.screened) == MAX_SCREENED_PICKS
    complete = torch.tensor([1.0, 2.0])
    kept.keep_logits(complete, None)
    assert not kept.screened
    for pick in (None, (1, ()), (7, (1,))):
        assert torch.equal(kept.logits_for(pick), complete)


def test_zero_capacity_keeps_nothing() -> None:
    cache = PromptLogitsCache(capacity=0)
    cache.put(prompt_key(0, [1]), torch.zeros(2))
    assert len(cache) == 0
    with pytest.raises(ValueError):
        PromptLogitsCache(capacity=-1)


def test_a_screened_row_keeps_its_finite_entries_only() -> None:
    """-inf, +inf and NaN are not kept; the finite entries come back at their places, also
    from a strided row."""
    wide = torch.full((2, 40), float("-inf"))
    values = {3: 1.5, 17: -2.0, 31: 0.0, 39: 7.25}
    for index, value in values.items():
        wide[0, index] = value
    wide[0, 5], wide[0, 6] = float("inf"), float("nan")
    for row in (wide[0], wide.t()[:, 0]):
        kept = KeptPrompt(torch.zeros(4))
        kept.keep_logits(row, (1, ()))
        ids, kept_values = kept.screened[(1, ())]
        assert ids.tolist() == sorted(values) and kept_values.tolist() == [values[i] for i in sorted(values)]
        served = kept.logits_for((1, ()))
        assert torch.equal(torch.isfinite(served).nonzero().flatten(), ids)
