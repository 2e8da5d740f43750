"""Weighted, two-level VTC through the core: weights, users within a client,
and slot shares, on the fake engine with the fake clock."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping

import pytest

from services.scheduler.core.types import CoreConfig, Policy

from tests.unit.scheduler.fake_worker import FakeEngine
from tests.unit.scheduler.harness import Harness

PROMPT_LEN = 16
MAX_TOKENS = 16
BATCH = 6
Fields = Callable[[int], dict[str, object]]


def _harness(batch: int = BATCH) -> Harness:
    return Harness(CoreConfig(policy=Policy.VTC, max_batch_size=batch), FakeEngine(num_blocks=4096))


def _submit_backlog(h: Harness, clients: Mapping[str, Fields], count: int,
                    max_tokens: int = MAX_TOKENS) -> dict[str, dict[str, object]]:
    """`count` requests per client, interleaved; each request's extra fields
    come from its client's function of the request's index. Returns the
    fields of every request by request_id."""
    sent: dict[str, dict[str, object]] = {}
    for i in range(count):
        for k, (client_id, fields_of) in enumerate(clients.items()):
            base = 10_000 * (k + 1) + PROMPT_LEN * i
            fields = {"client_id": client_id, **fields_of(i)}
            rid = h.submit(tuple(range(base, base + PROMPT_LEN)), max_tokens=max_tokens, **fields).request_id
            sent[rid] = fields
    return sent


def _pending_keys(h: Harness) -> set[tuple[str, str]]:
    return {(r.client_id, r.user) for r in h.core._workers["w0"].pending}  # test-only peek at the queue


def _run_backlogged(h: Harness, steps: int, keys: set[tuple[str, str]]) -> None:
    """Runs `steps` steps; every (client, user) in `keys` must still be waiting
    at the end, so all of them were backlogged throughout."""
    for _ in range(steps):
        h.step()
    assert keys <= _pending_keys(h), keys - _pending_keys(h)


def _output_tokens(h: Harness, sent: Mapping[str, Mapping[str, object]], key: str) -> Counter[object]:
    tokens: Counter[object] = Counter()
    for rid, fields in sent.items():
        tokens[fields.get(key, "")] += len(h.streams[rid].tokens)
    return tokens


def _served(h: Harness) -> dict[str, int]:
    return {c.client_id: c.served_tokens for c in h.core.stats().clients}


def test_a_weight_2_client_gets_twice_the_service_of_a_weight_1_client() -> None:
    h = _harness()
    _submit_backlog(h, {"gold": lambda i: {"weight": 2.0}, "plain": lambda i: {}}, count=80)
    _run_backlogged(h, 200, {("gold", ""), ("plain", "")})
    served = _served(h)
    assert served["gold"] / served["plain"] == pytest.approx(2.0, rel=0.1)
    weights = {c.client_id: c.weight for c in h.core.stats().clients}
    assert weights == {"gold": 2.0, "plain": 1.0}
    # The counters are normalized by the weight: they stay close to each other.
    counters = {c.client_id: c.counter for c in h.core.stats().clients}
    assert abs(counters["gold"] - counters["plain"]) <= 2 * 2.0 * BATCH * (PROMPT_LEN + MAX_TOKENS)


def test_equal_weights_split_evenly() -> None:
    h = _harness()
    _submit_backlog(h, {"a": lambda i: {"weight": 3.0}, "b": lambda i: {"weight": 3.0}}, count=80)
    _run_backlogged(h, 200, {("a", ""), ("b", "")})
    served = _served(h)
    assert served["a"] / served["b"] == pytest.approx(1.0, rel=0.1)


def test_a_client_rotating_users_and_sessions_gets_no_more_than_a_single_user_client() -> None:
    h = _harness()
    sent = _submit_backlog(h, {"rotating": lambda i: {"user": f"u{i}", "session_id": f"s{i}"},
                               "single": lambda i: {}}, count=80)
    for _ in range(200):
        h.step()
    assert {"rotating", "single"} <= {c for c, _ in _pending_keys(h)}
    served = _served(h)
    assert served["rotating"] / served["single"] == pytest.approx(1.0, rel=0.1)
    outputs = _output_tokens(h, sent, "client_id")
    assert outputs["rotating"] / outputs["single"] == pytest.approx(1.0, rel=0.1)


def test_users_within_a_client_split_its_share_and_the_client_keeps_its_share() -> None:
    h = _harness()
    # u1's requests all arrive before u2's: arrival order alone would serve u1 first.
    u1 = _submit_backlog(h, {"tenant": lambda i: {"user": "u1"}}, count=60)
    u2 = _submit_backlog(h, {"tenant": lambda i: {"user": "u2"}}, count=60)
    other = _submit_backlog(h, {"other": lambda i: {"user": "x"}}, count=120)
    _run_backlogged(h, 200, {("tenant", "u1"), ("tenant", "u2"), ("other", "x")})
    served = _served(h)
    assert served["tenant"] / served["other"] == pytest.approx(1.0, rel=0.1)
    by_user = _output_tokens(h, {**u1, **u2}, "user")
    assert by_user["u1"] / by_user["u2"] == pytest.approx(1.0, rel=0.15)
    assert by_user["u1"] + by_user["u2"] == pytest.approx(_output_tokens(h, other, "client_id")["other"], rel=0.1)


def test_a_user_returning_from_idle_is_lifted_within_its_client() -> None:
    h = _harness(batch=1)
    h.submit(tuple(range(8)), max_tokens=4, client_id="t", user="busy")
    h.submit(tuple(range(8)), max_tokens=4, client_id="t", user="busy")
    h.step()   # busy: 8 (prompt) + 2 (one token); one request still waits
    late = h.submit(tuple(range(100, 108)), max_tokens=4, client_id="t", user="late").request_id
    vtc = h.core._vtc   # test-only peek at the counters
    assert vtc.user_counter("t", "busy") == 10.0
    assert vtc.user_counter("t", "late") == 10.0   # lifted to the waiting user's counter
    h.run()
    assert h.streams[late].finish is not None


def _plans_of(user_of: Callable[[str], str]) -> list[object]:
    """The flood scenario of test_core_fairness with each client's user given by `user_of`."""
    h = _harness(batch=4)
    for i in range(20):
        h.submit(tuple(range(i, i + PROMPT_LEN)), max_tokens=MAX_TOKENS, client_id="heavy",
                 user=user_of("heavy"))
    for i in range(6):
        h.submit(tuple(range(500 + i, 500 + i + PROMPT_LEN)), max_tokens=MAX_TOKENS, client_id="light",
                 user=user_of("light"))
        for _ in range(5):
            h.step()
    h.run()
    return list(h.plans["w0"])


def test_one_user_per_client_schedules_exactly_as_no_user() -> None:
    assert _plans_of(lambda client: "") == _plans_of(lambda client: f"{client}-user")


def _running_by_client(h: Harness) -> Counter[str]:
    return Counter(r.client_id for r in h.core._workers["w0"].running)  # test-only peek


@pytest.mark.parametrize(("gold_weight", "expected"), [(2.0, {"gold": 4, "plain": 2}),
                                                       (1.0, {"gold": 3, "plain": 3}),
                                                       (5.0, {"gold": 5, "plain": 1})])
def test_slot_shares_are_proportional_to_weight(gold_weight: float, expected: dict[str, int]) -> None:
    h = _harness()
    _submit_backlog(h, {"plain": lambda i: {}}, count=BATCH, max_tokens=400)
    for _ in range(3):
        h.step()
    assert _running_by_client(h) == {"plain": BATCH}
    _submit_backlog(h, {"gold": lambda i: {"weight": gold_weight}}, count=BATCH, max_tokens=400)
    for _ in range(10):
        h.step()
    assert _running_by_client(h) == expected
    preemptions = h.core.stats().preemptions
    for _ in range(20):
        h.step()
    assert _running_by_client(h) == expected and h.core.stats().preemptions == preemptions  # no ping-pong


def test_a_client_rotating_users_takes_no_more_slots_than_its_share() -> None:
    h = _harness(batch=4)
    _submit_backlog(h, {"single": lambda i: {}}, count=4, max_tokens=400)
    for _ in range(3):
        h.step()
    _submit_backlog(h, {"rotating": lambda i: {"user": f"u{i}", "session_id": f"s{i}"}}, count=8, max_tokens=400)
    for _ in range(30):
        h.step()
    assert _running_by_client(h) == {"single": 2, "rotating": 2}
