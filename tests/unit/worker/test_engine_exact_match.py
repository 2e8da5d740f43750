"""The exact-match path: a prompt whose tokens a cached block already holds past its
last full block copies that block's K/V and computes only its last position, with the
same tokens and logits as a cold run. These tests turn the prompt-logits cache off, so
that last position is recomputed (test_engine_prompt_logits.py covers the cache)."""

from __future__ import annotations

import pytest
import torch

from common.block_hash import chain_hashes
from services.worker.engine.engine import Engine
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

LOGITS_ATOL = 1e-4
BLOCK_SIZE = 4


def _engine(kind: str, **config) -> Engine:
    return make_engine(kind, prompt_logits_cache_size=0, **config)


def _recording_engine(kind: str, **config) -> tuple[Engine, RecordingSampler]:
    return recording_engine(kind, block_size=BLOCK_SIZE, prompt_logits_cache_size=0, **config)


def _assert_rows_match(recorder: RecordingSampler, reference: torch.nn.Module, first_row: int) -> None:
    with torch.no_grad():
        for logits, seen in recorder.rows[first_row:]:
            expected = reference(torch.tensor([seen])).logits[0, -1]
            torch.testing.assert_close(logits, expected, atol=LOGITS_ATOL, rtol=0)


# (prompt length, tokens the cold run generates): where the rest of the warm prompt sits.
@pytest.mark.parametrize("prompt_len,cold_new_tokens", [
    (15, 1),    # a partial block: the cold run computed its prompt only
    (14, 6),    # a full block the cold run's generated tokens completed
    (16, 1),    # a block-aligned prompt: its own last full block
    (3, 1),     # no full block at all: a partial block after the root
])
def test_identical_prompt_computes_only_its_last_token(kind: str, reference: torch.nn.Module,
                                                       prompt_len: int, cold_new_tokens: int) -> None:
    engine, recorder = _recording_engine(kind)
    driver = Driver(engine)
    prompt = prompt_of(prompt_len, prompt_len)
    cold = driver.run({"cold": prompt}, cold_new_tokens)["cold"]
    cold_logits = recorder.rows[0][0]
    hits_before = engine.pool_stats().prefix_hit_tokens

    assert first_step(driver, "warm", prompt) == (prompt_len - 1, prompt_len, 1)
    torch.testing.assert_close(recorder.rows[cold_new_tokens][0], cold_logits, atol=LOGITS_ATOL, rtol=0)
    warm = decode_and_free(driver, "warm", 6)
    assert warm[:cold_new_tokens] == cold
    assert warm == generate(reference, prompt, 6)[:len(warm)]
    _assert_rows_match(recorder, reference, cold_new_tokens)
    assert engine.pool_stats().prefix_hit_tokens - hits_before == prompt_len - 1

    # The warm run left its own last block behind: a third run copies again.
    assert first_step(driver, "third", prompt)[0] == prompt_len - 1
    assert decode_and_free(driver, "third", 6) == warm


def test_prompt_made_of_an_earlier_prompt_and_its_output_reuses_the_tail(
        kind: str, reference: torch.nn.Module) -> None:
    engine, recorder = _recording_engine(kind)
    driver = Driver(engine)
    first = prompt_of(10, 3)
    output = driver.run({"first": first}, 5)["first"]
    # The first run computed 10 + 4 tokens: two full blocks, a full one of prompt and
    # output, then a partial one holding output[2:4].
    follow_up = first + output[:4]
    rows_before = len(recorder.rows)
    assert first_step(driver, "follow-up", follow_up) == (13, 14, 1)
    got = decode_and_free(driver, "follow-up", 4)
    assert got == generate(reference, follow_up, 4)[:len(got)]
    assert got[0] == output[4]
    _assert_rows_match(recorder, reference, rows_before)


@pytest.mark.parametrize("tail_of,expected_cached", [
    (lambda prompt: prompt[:14] + [prompt[14] + 1], 14),                  # the last token differs
    (lambda prompt: prompt[:13] + [prompt[13] + 1] + prompt[14:], 12),    # one shared token: no copy
    (lambda prompt: prompt + [prompt[-1]], 15),       # longer than anything the cache holds
])
def test_tail_that_differs_reuses_the_tokens_before_the_difference(
        kind: str, reference: torch.nn.Module, tail_of, expected_cached: int) -> None:
    engine, recorder = _recording_engine(kind)
    driver = Driver(engine)
    prompt = prompt_of(15, 7)
    driver.run({"cold": prompt}, 1)
    other = tail_of(prompt)
    rows_before = len(recorder.rows)
    cached, computed, batch = first_step(driver, "other", other)
    assert (cached, computed, batch) == (expected_cached, len(other), len(other) - expected_cached)
    got = decode_and_free(driver, "other", 4)
    assert got == generate(reference, other, 4)[:len(got)]
    _assert_rows_match(recorder, reference, rows_before)


def test_prompt_differing_inside_a_full_block_reuses_the_part_before(
        kind: str, reference: torch.nn.Module) -> None:
    engine, recorder = _recording_engine(kind)
    driver = Driver(engine)
    prompt = prompt_of(15, 8)
    driver.run({"cold": prompt}, 1)
    # Differs at token 6, inside the second full block: one full block, then two copied slots.
    other = prompt[:6] + [token + 1 for token in prompt[6:]]
    rows_before = len(recorder.rows)
    assert first_step(driver, "other", other) == (6, len(other), len(other) - 6)
    got = decode_and_free(driver, "other", 4)
    assert got == generate(reference, other, 4)[:len(got)]
    _assert_rows_match(recorder, reference, rows_before)


def test_missing_full_block_disables_the_tail_path(kind: str) -> None:
    engine = _engine(kind, block_size=BLOCK_SIZE)
    driver = Driver(engine)
    prompt = prompt_of(15, 11)
    driver.run({"cold": prompt}, 1)
    # Same tail tokens after a different second block: the cached partial block is not
    # its continuation, whatever its own tokens.
    changed = prompt[:4] + [token + 1 for token in prompt[4:8]] + prompt[8:]
    assert first_step(driver, "changed", changed)[0] == 4


def test_tail_source_survives_the_allocation_it_makes(kind: str, reference: torch.nn.Module) -> None:
    # Five blocks: the cold prompt's four, then an unrelated one; no free block is left.
    engine = _engine(kind, num_blocks=5, block_size=BLOCK_SIZE)
    driver = Driver(engine)
    prompt = prompt_of(15, 12)
    driver.run({"cold": prompt}, 1)
    filler = prompt_of(4, 13)
    driver.run({"filler": filler}, 1)
    assert engine.pool_stats().free_blocks == 1         # the partial block: it counts as free
    assert first_step(driver, "warm", prompt)[0] == 14
    # The allocation evicted the filler's block, not the partial one it copies from.
    assert engine.pool_stats().evictions == 1
    cached_hashes = {value for _parent, chain in engine.snapshot_chains() for value in chain}
    assert chain_hashes(filler, BLOCK_SIZE, kind)[0] not in cached_hashes
    got = decode_and_free(driver, "warm", 3)
    assert got == generate(reference, prompt, 3)[:len(got)]
    assert first_step(driver, "again", prompt)[0] == 14


def test_prefix_caching_disabled_keeps_no_partial_blocks(kind: str) -> None:
    engine = _engine(kind, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    driver = Driver(engine)
    prompt = prompt_of(15, 14)
    driver.run({"cold": prompt}, 1)
    assert engine.pool_stats().free_blocks == engine.info.num_blocks
    assert first_step(driver, "warm", prompt)[0] == 0


def test_copy_is_dropped_when_holding_its_source_would_leave_the_pool_short(
        kind: str, reference: torch.nn.Module) -> None:
    engine = _engine(kind, num_blocks=5, block_size=BLOCK_SIZE)
    driver = Driver(engine)
    cold = prompt_of(7, 21)           # one full block and a kept partial one
    driver.run({"cold": cold}, 1)
    big = cold[:6] + prompt_of(13, 22)[1:]   # 18 tokens, 20 with two new ones: all five blocks
    # Copying cold's partial block would need it held while four more are allocated.
    assert first_step(driver, "big", big)[0] == 4
    got = decode_and_free(driver, "big", 2)
    assert got == generate(reference, big, 2)[:len(got)]
