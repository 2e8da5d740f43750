"""N-gram speculation: drafts from the sequence itself, verified in the decode's
forward, change nothing in the text (greedy equals transformers' generate, seeded
sampling equals plain decoding) while several tokens come out of one step."""

from __future__ import annotations

import pytest
import torch

from common.types import SamplingParams
from common.step import NewSequence, StepBatch, WorkItem
from services.worker.engine.sampling.speculation import NgramIndex, accepted_prefix
from tests.unit.worker.engine_helpers import Driver, assert_greedy_matches, make_engine, reference_model


def repetitive_prompt(period: int = 6, repeats: int = 4, salt: int = 0) -> list[int]:
    """A prompt that repeats a phrase, so its suffix has earlier occurrences to draft from."""
    phrase = [(11 * i + 5 * salt) % 300 + 20 for i in range(period)]
    return [2] + phrase * repeats


# ---- the proposer ----

def test_the_latest_earlier_occurrence_of_the_longest_suffix_is_proposed() -> None:
    index = NgramIndex(2, 3)
    tokens = [5, 6, 7, 1, 5, 6, 7, 2, 9, 6, 7]
    # Suffix (9, 6, 7)? never before. (6, 7): latest earlier end at 7 -> continues with 2, 9, 6.
    assert index.propose(tokens, 3) == [2, 9, 6]
    tokens += [2]
    # Suffix (6, 7, 2) occurred ending at 8 -> continues 9, 6, 7, 2.
    assert index.propose(tokens, 10) == [9, 6, 7, 2]


def test_no_match_no_draft_and_limits_are_kept() -> None:
    index = NgramIndex(2, 4)
    assert index.propose([1, 2, 3, 4], 4) == []
    assert index.propose([1, 2, 1, 2], 0) == []
    assert index.propose([1, 2, 1, 2], 1) == [1]
    with pytest.raises(ValueError, match="n-gram sizes"):
        NgramIndex(3, 2)


def test_an_index_grown_step_by_step_proposes_what_a_fresh_one_does() -> None:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 5, (200,), generator=generator).tolist()
    grown = NgramIndex(1, 3)
    for length in range(1, len(tokens) + 1):
        prefix = tokens[:length]
        assert grown.propose(prefix, 4) == NgramIndex(1, 3).propose(prefix, 4)


def test_drafts_are_kept_until_the_first_disagreement() -> None:
    assert accepted_prefix([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]
    assert accepted_prefix([4, 5, 6], [4, 9, 6, 7]) == [4, 9]
    assert accepted_prefix([4, 5, 6], [8, 5, 6, 7]) == [8]
    assert accepted_prefix([], [3]) == [3]


# ---- the engine ----

@pytest.mark.parametrize("kind", ["gemma3", "llama", "gemma4"])
def test_greedy_speculation_equals_generate_with_fewer_steps(kind: str) -> None:
    prompts = {"a": repetitive_prompt(6, 4), "b": repetitive_prompt(5, 5, salt=1), "c": repetitive_prompt(7, 3, salt=2)}
    driver = Driver(make_engine(kind))
    got = driver.run(prompts, 24, draft_tokens=4)
    assert_greedy_matches(reference_model(kind), prompts, got, 24)
    drafted = sum(step.draft_tokens for step in driver.steps)
    accepted = sum(step.accepted_tokens for step in driver.steps)
    assert drafted > 0 and 0 < accepted <= drafted     # some steps emitted several tokens
    assert driver.engine.pool_stats().used_blocks == 0


def test_seeded_sampling_with_penalties_is_the_same_with_and_without_speculation() -> None:
    prompts = {f"s{i}": repetitive_prompt(4 + i, 4, salt=i) for i in range(3)}
    # Low temperatures: the tiny random model's flat distributions would never repeat a phrase.
    sampling = {"s0": SamplingParams(temperature=0.1, seed=7),
                "s1": SamplingParams(temperature=0.2, top_k=5, seed=11, repetition_penalty=1.05),
                "s2": SamplingParams(temperature=0.1, top_p=0.9, seed=3, presence_penalty=0.1,
                                     frequency_penalty=0.1, min_tokens=10)}
    plain = Driver(make_engine("gemma3")).run(prompts, 20, sampling=sampling)
    speculative = Driver(make_engine("gemma3"))
    got = speculative.run(prompts, 20, sampling=sampling, draft_tokens=3)
    assert {seq_id: tokens[:20] for seq_id, tokens in got.items()} == plain
    assert sum(step.accepted_tokens for step in speculative.steps) > 0


def test_every_emitted_token_carries_its_logprob() -> None:
    engine = make_engine("gemma3")
    prompt = repetitive_prompt(6, 4)
    params = SamplingParams(logprobs=True, top_logprobs=2)
    engine.step(StepBatch(new_sequences=[NewSequence("a", prompt, [], params)], work=[WorkItem("a", 1024)]))
    multi = None
    for _ in range(12):
        (result,) = engine.step(StepBatch(work=[WorkItem("a", 1, 4)])).results
        assert result.logprob is not None and len(result.more_logprobs) == len(result.more_token_ids)
        assert all(logprob is not None and len(logprob.top) == 2 for logprob in result.more_logprobs)
        if result.more_token_ids:
            multi = result
    assert multi is not None, "no step accepted a draft"


def test_drafts_stop_at_the_model_context_and_fall_back_when_the_pool_is_short() -> None:
    prompt = repetitive_prompt(4, 4)                    # 17 tokens
    engine = make_engine("gemma3", max_model_len=20)
    engine.step(StepBatch(new_sequences=[NewSequence("a", prompt)], work=[WorkItem("a", 1024)]))
    out = engine.step(StepBatch(work=[WorkItem("a", 1, 8)]))
    assert out.draft_tokens <= 20 - 18                  # rows stay below position 20
    engine.check_invariants()

    tight = make_engine("gemma3", num_blocks=5, block_size=4, enable_prefix_caching=False)
    tight.step(StepBatch(new_sequences=[NewSequence("a", prompt)], work=[WorkItem("a", 1024)]))
    # 18 tokens fill the 5 blocks but for 2 slots: drafts that do not fit are dropped.
    (result,) = tight.step(StepBatch(work=[WorkItem("a", 1, 8)])).results
    assert not result.error and result.sampled
    tight.check_invariants()
    assert tight.pool_stats().used_blocks <= 5


def test_rejected_drafts_give_their_blocks_back() -> None:
    engine = make_engine("gemma3", block_size=2, enable_prefix_caching=False)
    engine.step(StepBatch(new_sequences=[NewSequence("a", repetitive_prompt(6, 4))], work=[WorkItem("a", 1024)]))
    for _ in range(10):
        (result,) = engine.step(StepBatch(work=[WorkItem("a", 1, 6)])).results
        engine.check_invariants()
        assert engine.pool.blocks_for(result.num_computed_tokens) == len(engine.pool.table("a"))


def test_blocks_filled_by_kept_drafts_are_cached_for_the_next_turn() -> None:
    driver = Driver(make_engine("gemma3"))
    prompt = repetitive_prompt(6, 4)
    first = driver.run({"a": prompt}, 24, draft_tokens=4, free_at_end=False)["a"]
    assert sum(step.accepted_tokens for step in driver.steps) > 0
    computed = len(prompt) + len(first) - 1          # all but the last sampled token
    driver.run({"b": prompt + first + [7, 8, 9]}, 1)
    assert driver.cached["b"] >= computed // 4 * 4     # every full block turn one computed


def test_decodes_with_drafts_attend_as_decode_rows_through_the_decode_kernel() -> None:
    """Where the native decode attention serves, a decode's draft rows are decode rows (one
    per row, each up to its own position), not a prefill chunk per sequence."""
    engine = make_engine("gemma3")
    assert engine.forward.decode_kernel is not None, "the C decode attention did not build here"
    seen = []
    hidden_states = engine.forward.hidden_states

    def spy(input_ids, positions, meta, keep=None):
        seen.append((meta.num_tokens, meta.num_decodes, len(meta.prefills), meta.decode_ctx_lens.tolist()))
        return hidden_states(input_ids, positions, meta, keep)

    engine.forward.hidden_states = spy
    prompts = {"a": repetitive_prompt(6, 4), "b": repetitive_prompt(5, 5, salt=1)}
    driver = Driver(engine)
    got = driver.run(prompts, 16, draft_tokens=4)
    assert_greedy_matches(reference_model("gemma3"), prompts, got, 16)
    # Two sequences decoding: a step of more rows with no prefill chunk verified drafts.
    verified = [entry for entry in seen if entry[0] > 2 and entry[2] == 0]
    assert verified, "no step verified drafts"
    for rows, decodes, _, ctx_lens in verified:
        assert decodes == rows and len(ctx_lens) == rows
