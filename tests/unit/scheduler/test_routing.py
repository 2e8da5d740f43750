"""Routing on plain workers: sessions, cached prefixes, load, and prefix hints."""

from __future__ import annotations

from services.scheduler.core.routing import SessionMap, balanced, choose_worker, prefix_hints, route, route_with_reason
from services.scheduler.core.state import Phase

from tests.unit.scheduler.plain_state import make_request, make_worker

SHARED = tuple(range(100, 120))


def test_sessions_forget_the_least_recently_used_first_and_a_gone_workers_all() -> None:
    sessions = SessionMap(capacity=2)
    sessions.remember("s1", "w0")
    sessions.remember("s2", "w1")
    assert sessions.get("s1") == "w0"          # now the most recently used
    sessions.remember("s3", "w0")
    assert (sessions.get("s1"), sessions.get("s2"), sessions.get("s3")) == ("w0", None, "w0")
    sessions.forget_worker("w0")
    assert sessions.get("s1") is None and sessions.get("s3") is None


def test_choose_worker_prefers_the_session_then_the_prefix_then_the_load() -> None:
    idle, busy = make_worker("w0"), make_worker("w1")
    busy.pending.append(make_request(1))
    assert choose_worker([idle, busy], "w1", {}) is busy
    assert choose_worker([idle, busy], "gone", {}) is idle
    assert choose_worker([idle, busy], None, {"w1": 8}) is busy
    assert choose_worker([], None, {}) is None


def test_choose_worker_breaks_load_ties_by_reservations_then_untouched_blocks_then_id() -> None:
    first, second = make_worker("w0", free_blocks=10), make_worker("w1", free_blocks=20)
    assert choose_worker([first, second], None, {}) is second
    second.reserved_kv_tokens = 1
    assert choose_worker([first, second], None, {}) is first
    assert choose_worker([make_worker("w1"), make_worker("w0")], None, {}).worker_id == "w0"


def test_prefix_hints_raise_a_worker_that_is_filling_the_prefix() -> None:
    filling, other = make_worker("w0"), make_worker("w1")
    filling.prefilling.append(make_request(1, prompt=SHARED + (1, 2), phase=Phase.PREFILLING))
    prompt = SHARED + (7, 8, 9)
    assert prefix_hints(prompt, [filling, other], {"w1": 4}, min_tokens=8) == {"w0": 20, "w1": 4}
    assert prefix_hints(prompt, [filling, other], {"w0": 24}, min_tokens=8) == {"w0": 24}
    assert prefix_hints(prompt, [filling, other], {}, min_tokens=0) == {}
    assert prefix_hints(prompt, [filling], {}, min_tokens=8) == {}   # one worker: nothing to choose
    assert prefix_hints(prompt[:6] + (0,) * 20, [filling, other], {}, min_tokens=8) == {}  # shares only 6


def test_route_uses_the_session_then_the_hints_and_remembers_nothing_itself() -> None:
    first, second = make_worker("w0"), make_worker("w1")
    sessions = SessionMap()
    sessions.remember("s", "w1")
    assert route((1, 2, 3), "s", [first, second], sessions, {"w0": 3}, min_tokens=8) is second
    assert route((1, 2, 3), "", [first, second], sessions, {"w1": 3}, min_tokens=8) is second
    assert route((1, 2, 3), "other", [first, second], sessions, {}, min_tokens=8) is first
    assert sessions.get("other") is None
    assert route((1, 2, 3), "", [], sessions, {}, min_tokens=8) is None


def loaded(worker_id: str, requests: int):
    worker = make_worker(worker_id)
    worker.pending.extend(make_request(index) for index in range(requests))
    return worker


def test_balanced_keeps_workers_within_the_slack_or_the_ratio_of_the_least_loaded() -> None:
    light, within_slack, within_ratio, over = loaded("w0", 20), loaded("w1", 24), loaded("w2", 30), loaded("w3", 31)
    assert balanced([light, within_slack, within_ratio, over], load_slack=4) == [light, within_slack, within_ratio]
    assert [w.worker_id for w in balanced([loaded("w0", 0), loaded("w1", 5)], load_slack=4)] == ["w0"]
    assert [w.worker_id for w in balanced([loaded("w0", 0), loaded("w1", 4)], load_slack=4)] == ["w0", "w1"]


def test_a_cache_holder_far_busier_than_the_least_loaded_gives_way() -> None:
    holder, idle = loaded("w0", 20), loaded("w1", 0)
    hints = {"w0": 96}
    assert choose_worker([holder, idle], None, hints) is holder                 # no slack given: affinity
    assert choose_worker([holder, idle], None, hints, load_slack=32) is holder  # within the slack
    assert choose_worker([holder, idle], None, hints, load_slack=16) is idle    # past it: the least loaded
    assert choose_worker([holder, idle], "w0", hints, load_slack=16) is holder  # a session stays put
    both = loaded("w2", 1)
    # Of the workers that hold the prefix and are not overloaded, the least loaded.
    assert choose_worker([holder, idle, both], None, {"w0": 96, "w2": 96}, load_slack=16) is both


def test_route_says_why_it_chose_the_worker() -> None:
    holder, idle = loaded("w0", 20), loaded("w1", 0)
    sessions = SessionMap()
    sessions.remember("s", "w0")
    prompt = (1, 2, 3)

    def reason(session: str, hints: dict[str, int], slack: int | None = 16) -> tuple[str, str]:
        worker, why = route_with_reason(prompt, session, [holder, idle], sessions, hints, min_tokens=8,
                                        load_slack=slack)
        return worker.worker_id, why

    assert reason("s", {"w1": 3}) == ("w0", "session")
    assert reason("", {"w0": 3}, slack=None) == ("w0", "cache")
    assert reason("", {"w0": 3}) == ("w1", "load")              # w0 holds more but is overloaded
    assert reason("", {"w1": 3}) == ("w1", "cache")
    assert reason("", {}) == ("w1", "least_loaded")
    holder.draining = True                                       # a draining holder passed over is not load
    assert reason("", {"w0": 3}) == ("w1", "least_loaded")
    assert route_with_reason(prompt, "", [], sessions, {}, min_tokens=8) == (None, "")


def test_with_no_cached_prefix_anywhere_the_choice_is_the_full_orders_least_loaded() -> None:
    """The path taken when the index knows nothing (most admissions at scale) picks what the
    full ordering picks: loads, reservations, never-used blocks, then the id, over balanced workers."""
    import random
    rng = random.Random(7)
    for _ in range(200):
        workers = [make_worker(f"w{i}", free_blocks=rng.randrange(0, 64), reserved_kv_tokens=rng.choice((0, 16)))
                   for i in range(rng.randrange(1, 9))]
        for index, worker in enumerate(workers):
            worker.active.extend(make_request(index * 100 + j) for j in range(rng.randrange(0, 6)))
        slack = rng.choice((None, 0, 2))
        zeros = {worker.worker_id: 0 for worker in workers}     # no prefix anywhere, said explicitly
        assert choose_worker(workers, None, {}, load_slack=slack) is choose_worker(workers, None, zeros,
                                                                                  load_slack=slack)
