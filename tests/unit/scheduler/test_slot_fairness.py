"""Preemption order and who gives up a batch slot, on plain requests."""

from __future__ import annotations

from services.scheduler.core.fairness.slot_fairness import fair_shares, preemption_victim, slot_victim
from services.scheduler.core.types import Policy

from tests.unit.scheduler.plain_state import make_request, make_running


def test_the_preemption_victim_is_the_lowest_priority_then_the_latest_arrival() -> None:
    early_low, late_low, latest_high = make_running(1, priority=0), make_running(2, priority=0), make_running(3, priority=1)
    assert preemption_victim([latest_high, late_low, early_low]) is late_low
    assert preemption_victim([latest_high, early_low]) is early_low
    assert preemption_victim([latest_high]) is latest_high


def test_a_lower_priority_request_yields_under_either_policy_but_not_one_admitted_this_step() -> None:
    low_early, low_late, lowest = make_running(1, priority=1), make_running(2, priority=1), make_running(3, priority=0)
    urgent = make_request(9, priority=2, client="b")
    running = [low_late, lowest, low_early]
    for policy in Policy:
        assert slot_victim(urgent, running, [urgent], set(), policy, max_batch_size=3) is lowest
        assert slot_victim(urgent, running, [urgent], {lowest.seq_id}, policy, max_batch_size=3) is low_late


def test_fcfs_never_takes_a_slot_from_an_equal_priority() -> None:
    running = [make_running(i, client="a") for i in range(4)]
    light = make_request(9, client="b")
    assert slot_victim(light, running, [light], set(), Policy.FCFS, max_batch_size=4) is None


def test_vtc_takes_the_latest_slot_of_a_client_over_its_fair_share() -> None:
    running = [make_running(i, client="a") for i in range(4)]
    light = make_request(9, client="b")
    assert fair_shares(4, {"a": 1.0, "b": 1.0}) == {"a": 2.0, "b": 2.0}
    assert slot_victim(light, running, [light], set(), Policy.VTC, max_batch_size=4) is running[-1]


def test_vtc_takes_from_the_client_furthest_over_its_share_not_the_latest_arrival() -> None:
    # 8 slots over clients a, c, d and the waiting b: a share of 2 each.
    heavy = [make_running(i, client="a") for i in range(4)]
    over = [make_running(10 + i, client="c") for i in range(3)]
    running = [*heavy, *over, make_running(20, client="d")]
    light = make_request(30, client="b")
    assert slot_victim(light, running, [light], set(), Policy.VTC, max_batch_size=8) is heavy[-1]
    # Without a, c is the only client over its share (3 slots over clients c, d and b: 8/3 each).
    assert slot_victim(light, running[4:], [light], set(), Policy.VTC, max_batch_size=8) is None
    assert slot_victim(light, running[4:], [light], set(), Policy.VTC, max_batch_size=5) is over[-1]


def test_vtc_slots_do_not_move_back_once_the_split_is_fair() -> None:
    running = [make_running(1, client="a"), make_running(2, client="a"), make_running(3, client="b"),
               make_running(4, client="b")]
    again_a, again_b = make_request(5, client="a"), make_request(6, client="b")
    for candidate in (again_a, again_b):
        assert slot_victim(candidate, running, [again_a, again_b], set(), Policy.VTC, max_batch_size=4) is None


def test_vtc_gives_no_slot_to_a_client_already_at_its_share() -> None:
    # 6 slots over a, c and the waiting d: a share of 2. a holds 2, c holds 4.
    running = [make_running(1, client="a"), make_running(2, client="a"),
               *(make_running(10 + i, client="c") for i in range(4))]
    more_a, first_d = make_request(20, client="a"), make_request(21, client="d")
    pending = [more_a, first_d]
    assert slot_victim(more_a, running, pending, set(), Policy.VTC, max_batch_size=6) is None
    assert slot_victim(first_d, running, pending, set(), Policy.VTC, max_batch_size=6) is running[-1]


def test_vtc_never_takes_a_slot_from_a_higher_priority() -> None:
    running = [make_running(i, client="a", priority=1) for i in range(4)]
    light = make_request(9, client="b", priority=0)
    assert slot_victim(light, running, [light], set(), Policy.VTC, max_batch_size=4) is None
