"""Tenant quotas through the core: every request of a tenant counts, whichever
gateway sent it; a refusal is Gate.QUOTA with the seconds to wait; output
tokens are charged as they stream; max_request_s ends a request with "length";
a continuation is never refused. And the default policy, auto: the VTC for
authenticated tenants (the attack: one tenant's n=8 long generations make
another's short request wait), FCFS for everyone else."""

from __future__ import annotations

from services.scheduler.core.types import CoreConfig, FinishReason, Gate, Policy, TenantQuota
from services.scheduler.core.fairness.quotas import TenantUsage

from tests.unit.scheduler.fake_worker import FakeEngine, reference_output
from tests.unit.scheduler.harness import Harness

PROMPT = tuple(range(30, 42))


def _harness(**config: object) -> Harness:
    return Harness(CoreConfig(**config), FakeEngine(num_blocks=1024))  # type: ignore[arg-type]


def test_a_tenant_at_max_in_flight_is_refused_alone_and_served_once_one_ends() -> None:
    h = _harness()
    quota = TenantQuota(max_in_flight=2)
    first = h.submit(PROMPT, max_tokens=4, client_id="a", quota=quota).request_id
    h.submit(PROMPT, max_tokens=4, client_id="a", quota=quota)
    refused = h.submit(PROMPT, max_tokens=4, client_id="a", quota=quota)
    assert refused.rejection is not None and refused.rejection.gate is Gate.QUOTA
    assert refused.rejection.retry_after_s == 1 and "2 generations in flight" in refused.rejection.message
    assert h.submit(PROMPT, max_tokens=4, client_id="b", quota=quota).accepted
    assert h.core.stats().rejections == {"quota": 1}
    h.cancel(first)
    assert h.submit(PROMPT, max_tokens=4, client_id="a", quota=quota).accepted
    h.run()
    assert h.core.tenant_usage("a") == TenantUsage()      # every hold ended with its request


def test_the_token_budget_counts_prompt_and_output_and_refuses_with_the_refill() -> None:
    h = _harness()
    quota = TenantQuota(tokens_per_minute=60)             # one token a second
    done = h.submit(PROMPT, max_tokens=20, client_id="a", quota=quota, ignore_eos=True).request_id
    h.run()
    assert len(h.streams[done].tokens) == 20              # a running generation is not cut off
    # 12 prompt + 20 output of 60: 28 left (plus the refill of the steps' 0.01 s each).
    assert h.submit(PROMPT, max_tokens=1, client_id="a", quota=quota).accepted   # 12 more: 16 left
    refused = h.submit(PROMPT * 2, max_tokens=1, client_id="a", quota=quota)     # 24 > 16
    assert refused.rejection is not None and refused.rejection.gate is Gate.QUOTA
    assert 8 <= refused.rejection.retry_after_s <= 9
    too_large = h.submit(PROMPT * 6, max_tokens=1, client_id="a", quota=quota)   # 72 > 60: never
    assert too_large.rejection is not None and too_large.rejection.gate is Gate.NEVER_FIT
    assert "tokens_per_minute of 60" in too_large.rejection.message


def test_max_request_s_ends_a_long_generation_with_length_and_keeps_its_tokens() -> None:
    h = _harness(max_tokens_limit=100_000)   # a lossy policy's long generation, allowed by the operator
    quota = TenantQuota(max_request_s=1.0)
    slow = h.submit(PROMPT, max_tokens=100_000, client_id="a", quota=quota, ignore_eos=True,
                    kv_policy="window").request_id
    other = h.submit(PROMPT, max_tokens=300, client_id="b", ignore_eos=True).request_id
    for _ in range(150):                                   # 1.5 s of 0.01 s steps
        h.step()
        h.deliver(h.core.expire().updates)
    stream = h.streams[slow]
    assert stream.finish is not None and stream.finish.reason is FinishReason.LENGTH
    assert "max_request_s of 1 s" in stream.finish.message
    assert 90 <= len(stream.tokens) <= 102 and stream.finish.usage.completion_tokens == len(stream.tokens)
    assert not h.streams[other].done                       # another tenant's request runs on
    h.run()
    assert h.streams[other].finish is not None and len(h.streams[other].tokens) == 300


def test_a_continuation_at_the_limit_is_admitted_and_not_charged_again() -> None:
    h = _harness()
    quota = TenantQuota(max_in_flight=1, tokens_per_minute=30)
    h.submit(PROMPT, max_tokens=50, client_id="a", quota=quota, ignore_eos=True)  # holds the one slot
    # Another request of the tenant, admitted by a scheduler that was lost, comes back with
    # the 5 tokens it streamed: at max_in_flight and with 18 of 30 tokens left, it is
    # neither refused nor charged for its prompt and those 5 tokens.
    expected = reference_output(PROMPT, 12)
    resumed = h.submit(PROMPT, max_tokens=12, client_id="a", quota=quota, resubmitted=True,
                       resume_token_ids=tuple(expected[:5])).request_id
    assert h.streams[resumed].rejection is None
    assert h.core.tenant_usage("a") == TenantUsage(in_flight=2, queued=1)
    h.run()
    assert h.streams[resumed].token_ids == expected[5:]
    refused = h.submit(PROMPT, max_tokens=1, client_id="a", quota=quota)
    assert refused.rejection is not None and refused.rejection.gate is Gate.QUOTA   # the output counts


def _heavy_then_light(authenticated: bool) -> tuple[int, int]:
    """Tenant a's 8 long generations (an n=8 request) fill the batch; b's 3-token
    request arrives. (Steps until b's last token, steps a's first generation took.)"""
    h = _harness(max_batch_size=8)
    assert h.core.config.policy is Policy.AUTO            # the default
    heavy = [h.submit(PROMPT, max_tokens=400, client_id="a", ignore_eos=True,
                      authenticated=authenticated).request_id for _ in range(8)]
    for _ in range(3):
        h.step()
    sent = h.steps
    light = h.submit(tuple(range(500, 512)), max_tokens=3, client_id="b", ignore_eos=True,
                     authenticated=authenticated).request_id
    while not h.streams[light].done:
        h.step()
    light_steps = h.steps - sent
    h.run()
    heavy_steps = min(h.streams[rid].finish_step or 0 for rid in heavy)
    return light_steps, heavy_steps


def test_auto_serves_an_authenticated_tenant_by_vtc_and_others_in_arrival_order() -> None:
    light_steps, heavy_steps = _heavy_then_light(authenticated=True)
    assert light_steps <= 6 and heavy_steps >= 390        # b's request overtakes a's flood
    light_steps, heavy_steps = _heavy_then_light(authenticated=False)
    assert light_steps >= 390                              # FCFS: b waits for a's generations
