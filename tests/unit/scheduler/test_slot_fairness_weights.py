"""Weighted slot shares on plain requests: a client's share of the batch is
proportional to its weight among the clients with work on the worker, and
users never change it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.scheduler.core.fairness.slot_fairness import client_weights, fair_shares, slot_victim
from services.scheduler.core.state import RequestState
from services.scheduler.core.types import Policy

from tests.unit.scheduler.plain_state import make_request, make_running


def _with(request: RequestState, weight: float = 1.0, user: str = "") -> RequestState:
    request.spec = replace(request.spec, weight=weight, user=user)
    return request


def test_shares_follow_the_weights() -> None:
    assert fair_shares(6, {"a": 2.0, "b": 1.0}) == {"a": 4.0, "b": 2.0}
    assert fair_shares(8, {"a": 1.0, "b": 1.0, "c": 2.0}) == {"a": 2.0, "b": 2.0, "c": 4.0}
    assert sum(fair_shares(7, {"a": 0.3, "b": 1.7, "c": 5.0}).values()) == pytest.approx(7.0)


def test_a_client_s_weight_is_its_latest_request_s() -> None:
    requests = [_with(make_request(1, client="a"), 2.0), _with(make_request(3, client="a"), 4.0),
                _with(make_request(2, client="a"), 8.0), make_request(4, client="b")]
    assert client_weights(requests) == {"a": 4.0, "b": 1.0}


def test_a_heavier_client_takes_slots_up_to_its_weighted_share() -> None:
    # 6 slots, gold weight 2, plain weight 1: shares 4 and 2.
    plain = [make_running(i, client="plain") for i in range(5)]
    gold = [_with(make_running(10 + i, client="gold"), 2.0) for i in range(1)]
    candidate = _with(make_request(20, client="gold"), 2.0)
    running = [*plain, *gold]
    assert slot_victim(candidate, running, [candidate], set(), Policy.VTC, max_batch_size=6) is plain[-1]
    # At 4 gold and 2 plain nothing moves either way.
    balanced = [*plain[:2], *(_with(make_running(10 + i, client="gold"), 2.0) for i in range(4))]
    more_plain = make_request(30, client="plain")
    for waiting in (candidate, more_plain):
        assert slot_victim(waiting, balanced, [candidate, more_plain], set(), Policy.VTC, max_batch_size=6) is None


def test_a_light_client_keeps_its_smaller_share_against_a_heavy_one() -> None:
    # gold (weight 2) holds 5 of 6: over its share of 4, so plain gets one back.
    gold = [_with(make_running(i, client="gold"), 2.0) for i in range(5)]
    plain = [make_running(10, client="plain")]
    candidate = make_request(20, client="plain")
    assert slot_victim(candidate, [*gold, *plain], [candidate], set(), Policy.VTC, max_batch_size=6) is gold[-1]


def test_users_do_not_enlarge_their_client_s_share() -> None:
    # 4 slots: a single-user client holding 2, a client with one user per request holding 2.
    running = [make_running(1, client="single"), make_running(2, client="single"),
               _with(make_running(3, client="many"), user="u3"), _with(make_running(4, client="many"), user="u4")]
    fresh_user = _with(make_request(9, client="many"), user="u9")
    assert slot_victim(fresh_user, running, [fresh_user], set(), Policy.VTC, max_batch_size=4) is None
    # Nor does a user take a slot from another user of its own client.
    crowded = [make_running(1, client="single"), *(_with(make_running(i, client="many"), user=f"u{i}")
                                                   for i in range(2, 5))]
    assert slot_victim(fresh_user, crowded, [fresh_user], set(), Policy.VTC, max_batch_size=4) is None
