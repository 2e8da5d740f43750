"""Requests that share a prompt prefix with one already being prefilled.

The worker's prefix cache only helps a request once the blocks it shares are
computed. When several requests with a common prefix arrive together (n > 1
choices, a burst of chats over the same system prompt), admitting them all at
once makes each one compute the shared part. Instead, the followers go to the
leader's worker and wait there until the leader has computed the shared
blocks; they are then admitted and skip them. Waiting costs a follower nothing
it would not have paid anyway: computing the shared part itself would have
taken at least as long, and in the same batches as the leader.

Only requests with the same cache salt share: a request never waits for, nor
is routed after, one whose blocks it could not reuse (nor learn anything from).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from common.common_prefix import common_prefix_len
from services.scheduler.core.state import Phase, RequestState


# Routing compares a new prompt with at most this many queued or prefilling
# requests per worker that start like it (the most recent first): enough to
# find the worker that is filling the prefix, without a full scan of a long queue.
MAX_ROUTING_CANDIDATES = 8


def shared_prefix_tokens(prompt: tuple[int, ...], others: Sequence[RequestState], min_tokens: int,
                         cache_salt: str = "") -> int:
    """The longest prefix `prompt` shares with the most recent of `others` with its
    `cache_salt` that start with its first `min_tokens` tokens, or 0 below
    `min_tokens` (prefix sharing disabled when 0)."""
    if min_tokens <= 0 or len(prompt) < min_tokens:
        return 0
    head = prompt[:min_tokens]
    best = checked = 0
    for other in reversed(others):
        if other.spec.cache_salt != cache_salt or other.prompt[:min_tokens] != head:
            continue
        best = max(best, common_prefix_len(prompt, other.prompt))
        checked += 1
        if checked == MAX_ROUTING_CANDIDATES:
            break
    return best if best >= min_tokens else 0


def blocked_by_leaders(pending: Iterable[RequestState], leaders: Iterable[RequestState], block_size: int,
                       min_tokens: int) -> set[str]:
    """Ids of the fresh `pending` requests that should stay queued because one of
    the prefilling `leaders` still has to compute full blocks they share with it.
    Each (request, leader) pair costs one slice comparison."""
    if min_tokens <= 0:
        return set()
    active = [leader for leader in leaders if leader.phase is Phase.PREFILLING]
    if not active:
        return set()
    blocked: set[str] = set()
    for request in pending:
        if request.started or len(request.prompt) <= min_tokens:
            continue
        if any(leader is not request and _waits_for(request, leader, block_size, min_tokens) for leader in active):
            blocked.add(request.request_id)
    return blocked


def _waits_for(request: RequestState, leader: RequestState, block_size: int, min_tokens: int) -> bool:
    """Whether `request` could reuse a full block the leader has not computed yet (only
    with the same cache salt): the reusable part (shared full blocks, short of the
    request's last token, which it computes itself) must reach `min_tokens` and go
    past what the leader computed.
    Both bounds are multiples of the block size, so one comparison of the first
    `need` tokens decides."""
    at_least = -(-min_tokens // block_size) * block_size
    past_computed = (leader.num_computed // block_size + 1) * block_size
    need = max(at_least, past_computed)
    return (need <= len(request.prompt) - 1 and request.spec.cache_salt == leader.spec.cache_salt
            and request.prompt[:need] == leader.prompt[:need])
