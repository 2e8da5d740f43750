"""Per-client waiting counts and the VTC lift they drive."""

from __future__ import annotations

from services.scheduler.core.fairness.vtc import VirtualTokenCounter
from services.scheduler.core.fairness.policy import WaitingClients


def test_an_arrival_with_nothing_waiting_is_lifted_to_the_smallest_waiting_counter() -> None:
    vtc = VirtualTokenCounter(input_weight=1.0, output_weight=2.0)
    waiting = WaitingClients(vtc)
    waiting.arrive("a")
    waiting.arrive("b")
    vtc.charge_prompt("a", 50)
    vtc.charge_prompt("b", 30)
    waiting.arrive("c")
    assert vtc.counter("c") == 30.0
    assert (waiting.waiting("a"), waiting.waiting("c"), len(waiting)) == (1, 1, 3)


def test_a_second_arrival_and_a_requeue_do_not_lift() -> None:
    vtc = VirtualTokenCounter(input_weight=1.0, output_weight=2.0)
    waiting = WaitingClients(vtc)
    waiting.arrive("a")
    vtc.charge_prompt("a", 40)
    waiting.arrive("b")                      # lifted to 40
    waiting.leave("b")
    vtc.charge_prompt("a", 40)               # a at 80, b at 40, b waits for nothing
    waiting.requeue("b")
    assert vtc.counter("b") == 40.0
    waiting.arrive("b")                      # b already waits: no lift either
    assert vtc.counter("b") == 40.0 and waiting.waiting("b") == 2


def test_the_last_leaver_sets_the_floor_for_the_next_arrival() -> None:
    vtc = VirtualTokenCounter(input_weight=1.0, output_weight=2.0)
    waiting = WaitingClients(vtc)
    waiting.arrive("a")
    waiting.arrive("a")
    vtc.charge_prompt("a", 25)
    waiting.leave("a")
    assert len(waiting) == 1                 # one of a's requests still waits
    waiting.leave("a")
    assert len(waiting) == 0
    waiting.arrive("b")
    assert vtc.counter("b") == 25.0
