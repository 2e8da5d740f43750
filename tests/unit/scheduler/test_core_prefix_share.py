"""Requests sharing a prompt prefix with one being prefilled go to its worker and
wait for the shared blocks, then skip them."""

from __future__ import annotations

from hypothesis import given, strategies as st

from services.scheduler.core.types import CoreConfig
from common.common_prefix import common_prefix_len

from tests.unit.scheduler.fake_worker import FakeEngine, reference_output
from tests.unit.scheduler.harness import Harness

SHARED = tuple(range(100, 140))            # 40 tokens: ten blocks of 4


def _admitted_in(h: Harness, worker_id: str, step: int) -> list[str]:
    return [new.seq_id for new in h.plans[worker_id][step].new_sequences]


@given(st.lists(st.integers(0, 3), max_size=30), st.lists(st.integers(0, 3), max_size=30))
def test_common_prefix_len_matches_a_plain_loop(left: list[int], right: list[int]) -> None:
    expected = 0
    while expected < min(len(left), len(right)) and left[expected] == right[expected]:
        expected += 1
    assert common_prefix_len(tuple(left), tuple(right)) == expected


def test_an_identical_prompt_waits_for_the_leader_then_skips_its_blocks() -> None:
    h = Harness(CoreConfig(prefix_wait_min_tokens=16), FakeEngine())
    leader = h.submit(SHARED, max_tokens=4).request_id
    follower = h.submit(SHARED, max_tokens=4).request_id
    h.step()
    assert len(_admitted_in(h, "w0", 0)) == 1          # only the leader
    h.run()
    assert h.streams[leader].token_ids == h.streams[follower].token_ids == reference_output(SHARED, 4)
    # Every full block but the one holding the last prompt token came from the cache.
    assert h.streams[follower].finish.usage.cached_tokens == 36
    assert h.streams[leader].finish.usage.cached_tokens == 0


def test_a_follower_is_admitted_once_the_shared_part_is_computed() -> None:
    h = Harness(CoreConfig(prefix_wait_min_tokens=16, prefill_chunk_size=8), FakeEngine())
    h.submit(SHARED + tuple(range(500, 540)), max_tokens=2)           # 80 tokens: ten chunks
    follower = h.submit(SHARED[:20] + (7, 7, 7), max_tokens=2).request_id
    steps_until_admitted = next(step for step in range(20) if h.step() and h.plans["w0"][-1].new_sequences
                                and step > 0)
    # The 20 shared tokens are five blocks; the leader computes 8 per step: 24 after three steps.
    assert steps_until_admitted == 3
    h.run()
    assert h.streams[follower].finish.usage.cached_tokens == 20
    assert h.streams[follower].token_ids == reference_output(SHARED[:20] + (7, 7, 7), 2)


def test_a_short_shared_prefix_does_not_wait() -> None:
    h = Harness(CoreConfig(prefix_wait_min_tokens=16), FakeEngine())
    h.submit(SHARED, max_tokens=2)
    h.submit(SHARED[:12] + (9,) * 30, max_tokens=2)
    h.step()
    assert len(_admitted_in(h, "w0", 0)) == 2


def test_disabled_admits_both_at_once() -> None:
    h = Harness(CoreConfig(prefix_wait_min_tokens=0), FakeEngine())
    h.submit(SHARED, max_tokens=2)
    follower = h.submit(SHARED, max_tokens=2).request_id
    h.step()
    assert len(_admitted_in(h, "w0", 0)) == 2
    h.run()
    assert h.streams[follower].finish.usage.cached_tokens == 0


def test_a_follower_goes_to_the_leaders_worker() -> None:
    h = Harness(CoreConfig(prefix_wait_min_tokens=16), {"w0": FakeEngine(), "w1": FakeEngine()})
    assert h.submit(SHARED, max_tokens=2).worker_id == "w0"
    # Least-loaded routing would pick the idle w1; the shared prefix wins.
    assert h.submit(SHARED[:30] + (5,), max_tokens=2).worker_id == "w0"
    assert h.submit(tuple(range(600, 640)), max_tokens=2).worker_id == "w1"


def test_a_resumed_request_never_waits() -> None:
    h = Harness(CoreConfig(prefix_wait_min_tokens=16, max_batch_size=1, prefill_chunk_size=8), FakeEngine())
    low = h.submit(SHARED, max_tokens=6).request_id
    for _ in range(6):
        h.step()
    # A higher-priority request with the same prompt takes the slot; the preempted one
    # then resumes without waiting on anyone, and both end with the reference text.
    high = h.submit(SHARED, max_tokens=3, priority=1).request_id
    h.run()
    assert h.streams[high].token_ids == reference_output(SHARED, 3)
    assert h.streams[low].token_ids == reference_output(SHARED, 6)
