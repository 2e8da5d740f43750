"""Cache salts in the scheduler's core: a request's salt travels to the worker with its
sequence, and the in-flight prefix sharing (waiting for a leader, routing after it)
only pairs requests with the same salt, since no other could reuse the leader's blocks."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.scheduler.core.types import CoreConfig
from services.scheduler.core.prefix_share import blocked_by_leaders, shared_prefix_tokens
from services.scheduler.core.state import Phase, RequestState

from tests.unit.scheduler.fake_worker import FakeEngine, reference_output
from tests.unit.scheduler.harness import Harness
from tests.unit.scheduler.plain_state import make_request

SHARED = tuple(range(100, 140))            # 40 tokens: ten blocks of 4


def _admitted_in(h: Harness, worker_id: str, step: int) -> list[str]:
    return [new.seq_id for new in h.plans[worker_id][step].new_sequences]


def test_the_salt_travels_with_every_incarnation_of_the_sequence() -> None:
    # A pool too small for both: one is preempted and registered again.
    h = Harness(CoreConfig(), FakeEngine(num_blocks=12))
    h.submit(tuple(range(200, 220)), max_tokens=20, cache_salt="tenant-a")
    h.submit(tuple(range(300, 320)), max_tokens=20, cache_salt="tenant-b")
    h.run()
    new = [seq for plan in h.plans["w0"] for seq in plan.new_sequences]
    assert len(new) > 2
    assert {(seq.prompt_token_ids[0], seq.cache_salt) for seq in new} == {(200, "tenant-a"), (300, "tenant-b")}


@pytest.mark.parametrize("leader_salt,follower_salt", [("tenant-a", "tenant-b"), ("", "tenant-b"),
                                                       ("tenant-a", "")])
def test_a_request_does_not_wait_for_a_leader_of_another_salt(leader_salt: str, follower_salt: str) -> None:
    h = Harness(CoreConfig(prefix_wait_min_tokens=16), FakeEngine())
    leader = h.submit(SHARED, max_tokens=4, cache_salt=leader_salt).request_id
    follower = h.submit(SHARED, max_tokens=4, cache_salt=follower_salt).request_id
    h.step()
    assert len(_admitted_in(h, "w0", 0)) == 2          # both at once: nothing to wait for
    h.run()
    assert h.streams[follower].token_ids == h.streams[leader].token_ids == reference_output(SHARED, 4)
    assert h.streams[follower].finish.usage.cached_tokens == 0


def test_a_request_waits_for_a_leader_of_its_own_salt() -> None:
    h = Harness(CoreConfig(prefix_wait_min_tokens=16), FakeEngine())
    h.submit(SHARED, max_tokens=4, cache_salt="tenant-a")
    h.submit(SHARED, max_tokens=4, cache_salt="tenant-b")
    follower = h.submit(SHARED, max_tokens=4, cache_salt="tenant-a").request_id
    h.step()
    assert len(_admitted_in(h, "w0", 0)) == 2          # tenant-a's leader and tenant-b
    h.run()
    assert h.streams[follower].finish.usage.cached_tokens == 36


def test_routing_follows_only_a_leader_of_the_same_salt() -> None:
    h = Harness(CoreConfig(prefix_wait_min_tokens=16), {"w0": FakeEngine(), "w1": FakeEngine()})
    assert h.submit(SHARED, max_tokens=2, cache_salt="tenant-a").worker_id == "w0"
    # The idle w1 wins for another salt: w0's prefix is of no use to it.
    assert h.submit(SHARED[:30] + (5,), max_tokens=2, cache_salt="tenant-b").worker_id == "w1"
    assert h.submit(SHARED[:30] + (6,), max_tokens=2, cache_salt="tenant-a").worker_id == "w0"


def _salted(arrival: int, prompt: tuple[int, ...], salt: str, **fields: object) -> RequestState:
    request = make_request(arrival, prompt=prompt, **fields)  # type: ignore[arg-type]
    request.spec = replace(request.spec, cache_salt=salt)
    return request


def test_shared_prefix_tokens_counts_only_requests_of_the_same_salt() -> None:
    queued = [_salted(0, SHARED, "tenant-a"), _salted(1, SHARED[:20], "")]
    assert shared_prefix_tokens(SHARED, queued, 16, "tenant-a") == 40
    assert shared_prefix_tokens(SHARED, queued, 16) == 20
    assert shared_prefix_tokens(SHARED, queued, 16, "tenant-b") == 0


def test_only_a_prefilling_leader_of_the_same_salt_blocks() -> None:
    leader = _salted(0, SHARED, "tenant-a", phase=Phase.PREFILLING, num_computed=8)
    pending = [_salted(1, SHARED, "tenant-a"), _salted(2, SHARED, "tenant-b"), _salted(3, SHARED, "")]
    assert blocked_by_leaders(pending, [leader], 4, 16) == {"r1"}


def test_a_session_id_of_another_client_neither_routes_nor_moves_that_session() -> None:
    # Alice's session is pinned to w1; bob names the same session id. Without sessions keyed
    # by client and salt, bob would follow it to w1 (and move it where he goes).
    h = Harness(CoreConfig(prefix_wait_min_tokens=16), {"w0": FakeEngine(), "w1": FakeEngine()})
    h.submit(tuple(range(300, 320)), max_tokens=2, client_id="bob", cache_salt="bob")     # w0
    alice = dict(client_id="alice", cache_salt="alice", session_id="s-1")
    assert h.submit(SHARED, max_tokens=2, **alice).worker_id == "w1"
    bob = dict(client_id="bob", cache_salt="bob", session_id="s-1")
    assert h.submit(tuple(range(400, 410)), max_tokens=2, **bob).worker_id == "w0", \
        "bob does not follow alice's session to its worker"
    assert h.submit(tuple(range(500, 520)), max_tokens=2, **alice).worker_id == "w1", "nor moves it"
    assert h.submit(tuple(range(510, 530)), max_tokens=2, **alice).worker_id == "w1"
    # The same client's session id under another salt (another end user, PREFIX_CACHE_SCOPE=user)
    # is another session too: it goes to the least loaded worker, not to alice's.
    other_user = dict(client_id="alice", cache_salt="alice/u2", session_id="s-1")
    assert h.submit(tuple(range(600, 620)), max_tokens=2, **other_user).worker_id == "w0"
