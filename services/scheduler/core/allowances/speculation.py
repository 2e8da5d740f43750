"""The speculative draft allowance: how many draft tokens a decode may ask the
worker to verify in a step, and how many extra blocks their slots take.

A decode computes one token (the last sampled one) and may verify up to
`drafts` proposed tokens in the same forward; each one accepted is an extra
output token. The allowance never lets a request pass max_tokens even if
every draft granted to the steps still in flight is kept, never overdraws the
step's token budget (drafts cost budget like computed tokens), and never needs
more blocks than are available without evicting anything for it.
"""

from __future__ import annotations

from services.scheduler.core.state import blocks_for


def speculating(speculative_tokens: int, speculative_max_batch: int, num_decoding: int) -> bool:
    """Whether decodes on a worker get drafts this step: speculation is on and
    at most speculative_max_batch requests decode there (0: any number)."""
    return speculative_tokens > 0 and (speculative_max_batch <= 0 or num_decoding <= speculative_max_batch)


def drafts_allowed(kv_cap_tokens: int, is_greedy: bool, speculative_sampled: bool) -> bool:
    """Whether a request's decodes may verify drafts while its worker speculates: not under a
    KV budget (lossy policies drop what drafts would be checked against), and a sampled request
    (temperature > 0) only with speculative_sampled: a draw at a temperature keeps far fewer
    copied tokens, and every rejected draft is a row of the forward paid for nothing."""
    return not kv_cap_tokens and (speculative_sampled or is_greedy)


def draft_allowance(*, speculative_tokens: int, outputs_left: int, token_budget: int, num_computed: int,
                    held_blocks: int, spare_blocks: int, block_size: int) -> tuple[int, int]:
    """(draft tokens, extra blocks for their slots) for one decode.

    outputs_left: max_tokens minus the outputs the request has if every draft
      in flight is kept; the decode's own sample takes one of them.
    token_budget: the step's budget before the decode; its own token takes one.
    num_computed: tokens the sequence holds; the decode computes one more.
    held_blocks: blocks the sequence holds once the decode's own token has one.
    spare_blocks: the step's available blocks left after that.
    """
    drafts = min(speculative_tokens, outputs_left - 1, token_budget - 1)
    capacity = (held_blocks + max(spare_blocks, 0)) * block_size - (num_computed + 1)
    drafts = min(drafts, capacity)
    if drafts <= 0:
        return 0, 0
    return drafts, blocks_for(num_computed + 1 + drafts, block_size) - held_blocks
