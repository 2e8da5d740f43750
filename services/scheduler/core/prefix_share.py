"""Requests that share a prompt prefix with one already being prefilled.

The worker's prefix cache only helps a request once the blocks it shares are
computed. When several requests with a common prefix arrive together (n > 1
choices, a burst of chats over the same system prompt), admitting them all at
once makes each one compute the shared part. Instead, the followers go to the
leader's worker and wait there until the leader has computed the shared
blocks; they are then admitted and skip them. Waiting costs a follower nothing
it would not have paid anyway: computing the shared part itself would have
taken at least as long, and in the same batches as the leader.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from services.scheduler.core.state import Phase, RequestState


def common_prefix_len(left: Sequence[int], right: Sequence[int]) -> int:
    """Length of the longest common prefix (binary search over slice comparisons,
    which run in C: O(n log n) element comparisons, no Python loop per token)."""
    low, high = 0, min(len(left), len(right))
    while low < high:
        middle = (low + high + 1) // 2
        if left[:middle] == right[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def shared_prefix_tokens(prompt: Sequence[int], others: Iterable[RequestState], min_tokens: int) -> int:
    """The longest prefix `prompt` shares with any of `others`' known tokens, or 0
    when it is shorter than `min_tokens` (prefix sharing disabled when 0)."""
    if min_tokens <= 0 or len(prompt) < min_tokens:
        return 0
    best = 0
    for other in others:
        known = other.prompt
        if known[:min_tokens] != tuple(prompt[:min_tokens]):
            continue
        best = max(best, common_prefix_len(prompt, known))
    return best if best >= min_tokens else 0


def waits_for_leader(request: RequestState, prefilling: Iterable[RequestState], block_size: int,
                     min_tokens: int) -> bool:
    """Whether a fresh request should stay queued because a request already
    prefilling on its worker still has to compute full blocks they share."""
    if min_tokens <= 0 or request.admitted_once or len(request.prompt) < min_tokens:
        return False
    for leader in prefilling:
        if leader.phase is not Phase.PREFILLING or leader is request:
            continue
        shared = common_prefix_len(request.prompt, leader.prompt)
        # Only full blocks are reused, and the request computes its last token itself.
        reusable = min(shared, len(request.prompt) - 1) // block_size * block_size
        if reusable >= min_tokens and leader.num_computed < reusable:
            return True
    return False
