"""Lossy KV policies through the scheduling core: the request's kv_policy (else the
deployment's KV_POLICY) travels to the worker with the deployment's budget and sinks; a
lossy request may run past the model's context and is accounted at most its cap of
blocks; an unknown policy is refused; the settings read KV_POLICY, KV_BUDGET_TOKENS and
KV_SINK_TOKENS."""

from __future__ import annotations

import pytest

from common.settings.env import SettingsError
from common.step import KvPolicy
from services.scheduler.core.types import CoreConfig, FinishReason, Gate
from services.scheduler.core.room import blocks_to_grow, tokens_that_fit
from services.scheduler.settings import SchedulerSettings

from tests.unit.scheduler.fake_worker import FakeEngine
from tests.unit.scheduler.harness import Harness

PROMPT = tuple(range(10, 30))
SINK = KvPolicy("sink", budget_tokens=16, sink_tokens=4)


def test_the_policy_reaches_the_worker_with_the_deployment_budget() -> None:
    h = Harness(CoreConfig(kv_policy=KvPolicy("full", 16, 4)), FakeEngine(max_model_len=64))
    named = h.submit(PROMPT, max_tokens=4, kv_policy="sink").request_id
    default = h.submit(PROMPT, max_tokens=4).request_id
    h.run()
    sent = {new.prompt_token_ids: new.kv_policy for plan in h.plans["w0"] for new in plan.new_sequences}
    assert sent[PROMPT] in (SINK, KvPolicy("full", 16, 4))
    policies = [new.kv_policy for plan in h.plans["w0"] for new in plan.new_sequences]
    assert SINK in policies and KvPolicy("full", 16, 4) in policies
    assert h.streams[named].finish.reason is FinishReason.LENGTH
    assert h.streams[default].finish.reason is FinishReason.LENGTH


def test_a_lossy_request_may_run_past_the_context_and_the_pool() -> None:
    # The fake worker holds every token (it drops nothing): the pool is large enough for it,
    # but the model's context (48) and a pool the scheduler believes in are not.
    h = Harness(CoreConfig(kv_policy=SINK, max_tokens_limit=1000), FakeEngine(num_blocks=64, max_model_len=48))
    lossy = h.submit(PROMPT, max_tokens=100, kv_policy="sink")
    full = h.submit(PROMPT, max_tokens=100, kv_policy="full")
    assert lossy.rejection is None
    assert full.rejection is not None and full.rejection.gate is Gate.NEVER_FIT
    assert "model context" in full.rejection.message


def test_an_unknown_policy_is_refused() -> None:
    h = Harness(CoreConfig(), FakeEngine())
    result = h.submit(PROMPT, max_tokens=4, kv_policy="lru")
    assert result.rejection is not None and result.rejection.gate is Gate.INVALID
    assert "kv_policy" in result.rejection.message


def test_a_capped_sequence_never_needs_more_than_its_cap() -> None:
    assert blocks_to_grow(10, 10, 4, cap_tokens=16) == 1
    assert blocks_to_grow(40, 1, 4, cap_tokens=16) == 0
    assert tokens_that_fit(40, 0, 4, 64, cap_tokens=16) == 64
    assert tokens_that_fit(4, 1, 4, 64, cap_tokens=16) == 4
    assert blocks_to_grow(14, 10, 4) == 2


def test_settings_read_the_kv_policy() -> None:
    settings = SchedulerSettings.from_env({"KV_POLICY": "sink", "KV_BUDGET_TOKENS": "512", "KV_SINK_TOKENS": "8"})
    assert settings.core_config().kv_policy == KvPolicy("sink", 512, 8)
    assert SchedulerSettings.from_env({}).core_config().kv_policy == KvPolicy("full", 1024, 4)
    with pytest.raises(SettingsError, match="KV_POLICY"):
        SchedulerSettings.from_env({"KV_POLICY": "lru"})
    with pytest.raises(SettingsError, match="KV_BUDGET_TOKENS"):
        SchedulerSettings.from_env({"KV_BUDGET_TOKENS": "0"})
