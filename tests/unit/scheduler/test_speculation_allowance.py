"""The draft allowance of one decode, on plain numbers."""

from __future__ import annotations

from services.scheduler.core.allowances.speculation import draft_allowance, drafts_allowed, speculating

# A decode of a sequence holding 5 tokens (blocks of 4): its own token fits in
# the 2 blocks it holds, which have 2 more free slots.
ROOMY = dict(speculative_tokens=3, outputs_left=100, token_budget=100, num_computed=5, held_blocks=2,
             spare_blocks=10, block_size=4)


def test_speculation_is_on_only_up_to_the_batch_limit() -> None:
    assert not speculating(speculative_tokens=0, speculative_max_batch=0, num_decoding=1)
    assert speculating(speculative_tokens=3, speculative_max_batch=0, num_decoding=500)
    assert speculating(speculative_tokens=3, speculative_max_batch=2, num_decoding=2)
    assert not speculating(speculative_tokens=3, speculative_max_batch=2, num_decoding=3)


def test_sampled_requests_draft_only_when_allowed_and_budgeted_ones_never() -> None:
    assert drafts_allowed(kv_cap_tokens=0, is_greedy=True, speculative_sampled=False)
    assert not drafts_allowed(kv_cap_tokens=0, is_greedy=False, speculative_sampled=False)
    assert drafts_allowed(kv_cap_tokens=0, is_greedy=False, speculative_sampled=True)
    assert not drafts_allowed(kv_cap_tokens=256, is_greedy=True, speculative_sampled=True)


def test_a_roomy_decode_gets_every_draft_and_the_block_their_slots_spill_into() -> None:
    # Token 6 and drafts 7, 8 fit in the 2 held blocks; draft 9 needs a third.
    assert draft_allowance(**ROOMY) == (3, 1)
    assert draft_allowance(**{**ROOMY, "speculative_tokens": 2}) == (2, 0)


def test_the_decodes_own_sample_counts_against_max_tokens() -> None:
    assert draft_allowance(**{**ROOMY, "outputs_left": 3}) == (2, 0)
    assert draft_allowance(**{**ROOMY, "outputs_left": 1}) == (0, 0)


def test_drafts_cost_token_budget_after_the_decodes_own_token() -> None:
    assert draft_allowance(**{**ROOMY, "token_budget": 2}) == (1, 0)
    assert draft_allowance(**{**ROOMY, "token_budget": 1}) == (0, 0)


def test_drafts_only_take_blocks_that_are_available() -> None:
    assert draft_allowance(**{**ROOMY, "spare_blocks": 0}) == (2, 0)
    assert draft_allowance(**{**ROOMY, "spare_blocks": -3}) == (2, 0)     # overdrawn counts as none
    full = {**ROOMY, "num_computed": 7}                                      # its own token fills block 2
    assert draft_allowance(**{**full, "spare_blocks": 0}) == (0, 0)
    assert draft_allowance(**{**full, "spare_blocks": 1}) == (3, 1)
