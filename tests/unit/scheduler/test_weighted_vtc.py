"""The weighted, two-level counters, the waiting counts that lift them, and
the admission pick, on plain values."""

from __future__ import annotations

import math

import pytest

from services.scheduler.core import request_book
from services.scheduler.core.fairness.counters import CoreCounters
from services.scheduler.core.fairness.policy import WaitingClients, pick_next
from services.scheduler.core.request_book import RequestBook
from services.scheduler.core.state import RequestState
from services.scheduler.core.types import FinishReason, Policy, RequestSpec
from services.scheduler.core.fairness.vtc import MAX_WEIGHT, MIN_WEIGHT, VirtualTokenCounter, sane_weight

from tests.unit.scheduler.plain_state import make_worker


def _request(arrival: int, client: str, user: str = "", weight: float = 1.0, priority: int = 0,
             resumed: bool = False) -> RequestState:
    spec = RequestSpec(request_id=f"r{arrival}", prompt_token_ids=(1, 2, 3, 4), max_tokens=8, client_id=client,
                       user=user, weight=weight, priority=priority)
    return RequestState(spec=spec, client_id=client, max_tokens=8, arrival_s=float(arrival),
                        arrival_order=arrival, worker_id="w0", resumed=resumed)


def test_charges_are_divided_by_the_client_weight_at_both_levels() -> None:
    vtc = VirtualTokenCounter(input_weight=1.0, output_weight=2.0)
    vtc.set_weight("gold", 2.0)
    vtc.charge_prompt("gold", 10, user="u")
    vtc.charge_output("gold", 3, user="u")
    vtc.charge_prompt("plain", 10)
    assert vtc.counter("gold") == vtc.user_counter("gold", "u") == (10 + 2 * 3) / 2
    assert vtc.counter("plain") == vtc.user_counter("plain", "") == 10.0
    assert vtc.user_counter("gold", "nobody") == vtc.user_counter("stranger", "u") == 0.0
    snapshot = {c.client_id: (c.counter, c.served_tokens, c.weight) for c in vtc.snapshot()}
    assert snapshot == {"gold": (8.0, 13, 2.0), "plain": (10.0, 10, 1.0)}


def test_users_of_a_client_each_have_a_counter_summing_to_the_client_charges() -> None:
    vtc = VirtualTokenCounter(input_weight=1.0, output_weight=1.0)
    vtc.charge_prompt("t", 5, user="a")
    vtc.charge_prompt("t", 7, user="b")
    vtc.charge_output("t", 1, user="b")
    assert (vtc.user_counter("t", "a"), vtc.user_counter("t", "b"), vtc.counter("t")) == (5.0, 8.0, 13.0)
    assert sorted(vtc.users("t")) == ["a", "b"] and vtc.num_users("t") == 2
    vtc.forget_users("t", ["a"])
    assert vtc.users("t") == ["b"] and vtc.counter("t") == 13.0
    vtc.forget(["t"])
    assert (len(vtc), vtc.num_users("t"), vtc.weight("t")) == (0, 0, 1.0)


@pytest.mark.parametrize(("given", "used"), [(2.5, 2.5), (0.0, 1.0), (-3.0, 1.0), (math.nan, 1.0),
                                             (math.inf, 1.0), (1e-12, MIN_WEIGHT), (1e12, MAX_WEIGHT)])
def test_weights_that_would_break_the_counters_are_replaced(given: float, used: float) -> None:
    assert sane_weight(given) == used
    assert _request(1, "a", weight=given).weight == used


def test_the_lift_on_arrival_compares_normalized_counters() -> None:
    # gold (weight 4) was served 400 tokens, plain (weight 1) 100: both at 100.
    vtc = VirtualTokenCounter(input_weight=1.0, output_weight=1.0)
    waiting = WaitingClients(vtc)
    vtc.set_weight("gold", 4.0)
    waiting.arrive("gold")
    waiting.arrive("plain")
    vtc.charge_prompt("gold", 400)
    vtc.charge_prompt("plain", 100)
    waiting.arrive("newcomer")
    assert vtc.counter("newcomer") == 100.0


def test_users_are_lifted_among_their_client_s_waiting_users_only() -> None:
    vtc = VirtualTokenCounter(input_weight=1.0, output_weight=1.0)
    waiting = WaitingClients(vtc)
    waiting.arrive("t", "a")
    waiting.arrive("other", "z")
    vtc.charge_prompt("t", 30, user="a")
    vtc.charge_prompt("other", 90, user="z")
    waiting.arrive("t", "b")
    assert vtc.user_counter("t", "b") == 30.0                  # to a's, not to other's users
    assert waiting.waiting_users("t") == {"a": 1, "b": 1} and waiting.waiting("t") == 2
    waiting.leave("t", "a")
    waiting.leave("t", "b")                                    # t's last departure: b at 30
    assert len(waiting) == 1 and waiting.waiting_users("t") == {}
    vtc.charge_prompt("t", 10, user="b")
    waiting.arrive("t", "c")
    assert vtc.user_counter("t", "c") == 30.0                  # the last user departure's counter
    waiting.requeue("t", "d")                                  # no lift on a requeue
    assert vtc.user_counter("t", "d") == 0.0 and waiting.waiting_users("t") == {"c": 1, "d": 1}


def test_the_pick_is_the_client_first_then_its_user() -> None:
    vtc = VirtualTokenCounter(input_weight=1.0, output_weight=1.0)
    vtc.charge_prompt("t", 10, user="heavy")       # t at 10: heavy 10, light 0
    vtc.charge_prompt("other", 20, user="x")       # other at 20
    pending = [_request(1, "t", "heavy"), _request(2, "other", "x"), _request(3, "t", "light"),
               _request(4, "t", "light")]
    assert pick_next(pending, Policy.VTC, vtc) is pending[2]   # t (10 < 20), then light (0 < 10)
    vtc.charge_prompt("t", 20, user="light")                   # t at 30, light at 20
    assert pick_next(pending, Policy.VTC, vtc) is pending[1]   # other now
    assert pick_next(pending, Policy.FCFS, vtc) is pending[0]


def test_within_a_user_a_resumed_request_goes_first_and_priority_sits_above_all() -> None:
    vtc = VirtualTokenCounter(input_weight=1.0, output_weight=1.0)
    early, resumed = _request(1, "t", "u"), _request(5, "t", "u", resumed=True)
    assert pick_next([early, resumed], Policy.VTC, vtc) is resumed
    urgent = _request(9, "rich", "v", priority=1)
    vtc.charge_prompt("rich", 1000, user="v")
    assert pick_next([early, resumed, urgent], Policy.VTC, vtc) is urgent


def test_the_book_keeps_the_weight_of_the_latest_request_and_forgets_idle_users(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(request_book, "MAX_TRACKED_USERS", 4)
    book, worker = RequestBook(VirtualTokenCounter(1.0, 2.0), CoreCounters()), make_worker()
    book.add(worker, _request(1, "t", "keep", weight=2.0))
    assert book.vtc.weight("t") == 2.0
    for i in range(2, 8):
        request = _request(i, "t", f"u{i}", weight=3.0)
        book.add(worker, request)
        book.admit(worker, request, f"s{i}", now=float(i))
        book.finish(worker, request, FinishReason.LENGTH)
    assert book.vtc.weight("t") == 3.0
    # Past 4 users, the idle ones are forgotten down to 2; "keep" still waits.
    assert "keep" in book.vtc.users("t") and book.vtc.num_users("t") <= 4
    assert book.waiting.waiting_users("t") == {"keep": 1}
