"""Room in the pool: blocks to grow, tokens that fit, and the preemptions that make room."""

from __future__ import annotations

from services.scheduler.core.room import blocks_to_grow, tokens_that_fit, victims_for_room

from tests.unit.scheduler.plain_state import make_running


def test_blocks_to_grow_counts_only_blocks_past_the_partly_filled_one() -> None:
    assert blocks_to_grow(num_computed=0, num_tokens=1, block_size=4) == 1
    assert blocks_to_grow(num_computed=3, num_tokens=1, block_size=4) == 0   # fills the 4th slot
    assert blocks_to_grow(num_computed=4, num_tokens=1, block_size=4) == 1
    assert blocks_to_grow(num_computed=5, num_tokens=8, block_size=4) == 2   # 2 blocks held, 13 tokens need 4


def test_tokens_that_fit_use_the_free_slots_held_then_the_available_blocks() -> None:
    # 5 tokens computed in blocks of 4: 2 blocks held, 3 slots free in them.
    assert tokens_that_fit(num_computed=5, available_blocks=0, block_size=4, wanted=10) == 3
    assert tokens_that_fit(num_computed=5, available_blocks=1, block_size=4, wanted=10) == 7
    assert tokens_that_fit(num_computed=5, available_blocks=9, block_size=4, wanted=10) == 10
    assert tokens_that_fit(num_computed=5, available_blocks=-2, block_size=4, wanted=10) == 3  # overdrawn: none
    assert tokens_that_fit(num_computed=8, available_blocks=0, block_size=4, wanted=10) == 0


def test_no_shortfall_preempts_nobody() -> None:
    requester = make_running(1)
    assert victims_for_room([requester, make_running(2)], requester, 0, lambda r: 5) == ([], True)


def test_victims_go_in_preemption_order_until_enough_is_freed() -> None:
    keeper, early, late = make_running(1, priority=1), make_running(2), make_running(3)
    freed = {keeper.seq_id: 4, early.seq_id: 2, late.seq_id: 2}
    running = [keeper, early, late]
    assert victims_for_room(running, keeper, 2, lambda r: freed[r.seq_id]) == ([late], True)
    assert victims_for_room(running, keeper, 3, lambda r: freed[r.seq_id]) == ([late, early], True)


def test_the_requester_goes_too_when_it_is_the_next_victim() -> None:
    keeper, requester, late = make_running(1, priority=1), make_running(2), make_running(3)
    victims, keeps_place = victims_for_room([keeper, requester, late], requester, 5, lambda r: 2)
    assert victims == [late, requester] and not keeps_place
