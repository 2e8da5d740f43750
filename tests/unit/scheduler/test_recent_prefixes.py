"""recent_prefixes.py: which queued or prefilling requests a new prompt starts like, found by
key rather than by scanning every worker's queue; its answers equal the scan's, and a burst
of requests with distinct prompts over many workers compares each with none of the others
(before, each new request was compared with every queued one: a burst of N cost O(N²))."""

from __future__ import annotations

import random

from services.scheduler.core import prefix_share
from services.scheduler.core.recent_prefixes import PER_KEY, RecentPrefixes
from services.scheduler.core.routing import prefix_hints
from services.scheduler.core.state import Phase, RequestState
from services.scheduler.core.types import CoreConfig

from tests.unit.scheduler.fake_worker import FakeEngine
from tests.unit.scheduler.harness import Harness
from tests.unit.scheduler.plain_state import make_request, make_worker

SHARED = tuple(range(100, 120))


def live_set(live: set[str]):
    return lambda request: request.request_id in live and request.phase in (Phase.PENDING, Phase.PREFILLING)


def test_candidates_share_the_head_and_the_salt_most_recent_first_live_only() -> None:
    live = {"r1", "r2", "r3", "r4"}
    index = RecentPrefixes(8, live_set(live))
    first, second = make_request(1, prompt=SHARED + (1,)), make_request(2, prompt=SHARED + (2,))
    other = make_request(3, prompt=(9,) * 20)
    salted = make_request(4, prompt=SHARED + (4,))
    salted.spec = salted.spec.__class__(**{**salted.spec.__dict__, "cache_salt": "tenant-b"})
    for request in (first, second, other, salted):
        index.add(request)
    assert index.candidates(SHARED + (7,), "") == [second, first]
    assert index.candidates(SHARED + (7,), "tenant-b") == [salted]     # another salt never mixes
    assert index.candidates((5,) * 20, "") == []
    assert index.candidates(SHARED[:5], "") == []                    # shorter than the head
    live.discard("r2")                                               # finished, or moved on
    assert index.candidates(SHARED + (7,), "") == [first]
    second.phase = Phase.ACTIVE
    live.add("r2")
    assert index.candidates(SHARED + (7,), "") == [first]            # decoding: not about to fill


def test_sweep_drops_keys_whose_requests_all_moved_on_and_a_key_keeps_the_last_ones() -> None:
    live: set[str] = set()
    index = RecentPrefixes(4, live_set(live))
    for arrival in range(10):
        index.add(make_request(arrival, prompt=(arrival,) * 8))
    live.add("r3")
    index.sweep()
    assert len(index) == 1
    crowd = [make_request(100 + n, prompt=SHARED + (n,)) for n in range(PER_KEY + 5)]
    live.update(request.request_id for request in crowd)
    for request in crowd:
        index.add(request)
    assert index.candidates(SHARED, "") == crowd[::-1][:PER_KEY]
    assert RecentPrefixes(0, live_set(live)).candidates(SHARED, "") == []   # sharing off


def test_hints_from_the_index_equal_the_scan_of_every_queue() -> None:
    rng = random.Random(7)
    heads = [tuple(rng.randrange(50) for _ in range(8)) for _ in range(3)]
    for _ in range(50):
        workers = [make_worker(f"w{n}") for n in range(4)]
        live: set[str] = set()
        index = RecentPrefixes(8, live_set(live))
        for arrival in range(rng.randrange(0, 20)):
            worker = rng.choice(workers)
            if sum(len(w.pending) + len(w.prefilling) for w in workers if w is worker) >= 8:
                continue   # the scan and the index look at the last 8 of a worker alike
            phase = rng.choice([Phase.PENDING, Phase.PREFILLING])
            request = make_request(arrival, prompt=rng.choice(heads) + tuple(rng.randrange(4) for _ in range(12)),
                                   phase=phase, worker_id=worker.worker_id)
            (worker.pending if phase is Phase.PENDING else worker.prefilling).append(request)
            live.add(request.request_id)
            index.add(request)
        prompt = rng.choice(heads) + tuple(rng.randrange(4) for _ in range(12))
        hints = {"w1": rng.randrange(30)}
        assert prefix_hints(prompt, workers, hints, 8, "", index) == prefix_hints(prompt, workers, hints, 8)


def test_a_burst_of_distinct_prompts_over_many_workers_compares_none_with_the_others(monkeypatch) -> None:
    compared: list[int] = []
    original = prefix_share.shared_prefix_tokens

    def counting(prompt, others, min_tokens, cache_salt=""):
        compared.append(len(others))
        return original(prompt, others, min_tokens, cache_salt)

    monkeypatch.setattr("services.scheduler.core.routing.shared_prefix_tokens", counting)
    h = Harness(CoreConfig(max_batch_size=64, max_queue_len=100_000),
                {f"w{n}": FakeEngine(num_blocks=100_000) for n in range(16)})
    rng = random.Random(1)
    for index in range(1024):   # longer than PREFIX_WAIT_MIN_TOKENS (64), so each is looked up
        h.submit(tuple(rng.randrange(3, 30000) for _ in range(96)), max_tokens=4)
    assert sum(compared) == 0            # the scan compared the 1,024th with 1,023 queued ones
    # Requests that do start alike still find each other, on the worker filling the prefix.
    system = tuple(range(100, 180))
    first = h.submit(system + (1,) * 16, max_tokens=4)
    follower = h.submit(system + (2,) * 16, max_tokens=4)
    assert h.core.worker_of(follower.request_id) == h.core.worker_of(first.request_id)
    assert sum(compared) >= 1
