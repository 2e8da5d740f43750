"""Room in a worker's KV pool for a step's work: how many new blocks a
sequence needs to compute more tokens, how many of its tokens fit in what is
available, and which running requests to preempt when that is not enough.

A sequence holding `num_computed` tokens holds blocks_for(num_computed)
blocks; computing `num_tokens` more takes the difference up to
blocks_for(num_computed + num_tokens). Available blocks are the step's
estimate of free and evictable blocks; preempting a running request gives
back the blocks it holds plus those the step had planned for it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from services.scheduler.core.fairness.slot_fairness import preemption_victim
from services.scheduler.core.state import RequestState, blocks_for


def blocks_to_grow(num_computed: int, num_tokens: int, block_size: int, cap_tokens: int = 0) -> int:
    """New blocks a sequence holding `num_computed` tokens needs to compute `num_tokens` more;
    a lossy KV policy's sequence (`cap_tokens`: the most its cache holds) never holds more
    than its cap."""
    if cap_tokens:
        held = blocks_for(min(num_computed, cap_tokens), block_size)
        return max(0, blocks_for(min(num_computed + num_tokens, cap_tokens), block_size) - held)
    return blocks_for(num_computed + num_tokens, block_size) - blocks_for(num_computed, block_size)


def tokens_that_fit(num_computed: int, available_blocks: int, block_size: int, wanted: int,
                    cap_tokens: int = 0) -> int:
    """How many of `wanted` more tokens fit in the blocks the sequence holds
    (the last one partly filled) plus the available ones; 0 to `wanted`. A lossy sequence
    that can reach its cap fits them all: it drops blocks to make room."""
    held_tokens = min(num_computed, cap_tokens) if cap_tokens else num_computed
    room_blocks = blocks_for(held_tokens, block_size) + max(available_blocks, 0)
    if cap_tokens and room_blocks * block_size >= cap_tokens:
        return wanted
    return max(0, min(wanted, room_blocks * block_size - held_tokens))


def victims_for_room(running: Sequence[RequestState], requester: RequestState, shortfall: int,
                     freed_blocks: Callable[[RequestState], int]) -> tuple[list[RequestState], bool]:
    """The running requests to preempt, in order, until `shortfall` more blocks
    are available, and whether `requester` (itself running) keeps its place.
    Victims go in preemption order and stop at the requester: when it is the
    next victim, it goes too (it would only have taken blocks from requests
    that rank above it) and the answer is False. `freed_blocks(r)` is what
    preempting r gives back."""
    victims: list[RequestState] = []
    remaining = list(running)
    while shortfall > 0:
        victim = preemption_victim(remaining)
        remaining.remove(victim)
        victims.append(victim)
        if victim is requester:
            return victims, False
        shortfall -= freed_blocks(victim)
    return victims, True
