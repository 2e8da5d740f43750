"""MAX_TOKENS_LIMIT in the scheduling core (defence in depth behind the gateway): under
every KV policy a request asking for more output tokens than the limit (by default the
worker's context length) is refused with INVALID, never clamped, so a continuation resumes
to exactly the length it was promised; max_tokens <= 0 stays bounded; the setting is read
and validated."""

from __future__ import annotations

import pytest

from common.settings.env import SettingsError
from common.step import KvPolicy
from services.scheduler.core.types import CoreConfig, FinishReason, Gate
from services.scheduler.core.gates import output_limit
from services.scheduler.settings import SchedulerSettings

from tests.unit.scheduler.fake_worker import FakeEngine
from tests.unit.scheduler.harness import Harness

PROMPT = tuple(range(10, 30))
SINK = KvPolicy("sink", 16, 4)


@pytest.mark.parametrize("named", ["sink", "window", "h2o", ""])
def test_an_endless_lossy_request_is_refused_at_once(named: str) -> None:
    h = Harness(CoreConfig(kv_policy=SINK), FakeEngine(num_blocks=64, max_model_len=48))
    result = h.submit(PROMPT, max_tokens=2**31 - 1, kv_policy=named, ignore_eos=True)
    assert result.rejection is not None and result.rejection.gate is Gate.INVALID
    assert "max_tokens (2147483647)" in result.rejection.message and "48" in result.rejection.message


def test_the_default_limit_is_the_context_and_a_lossy_request_may_still_reach_it() -> None:
    h = Harness(CoreConfig(kv_policy=SINK), FakeEngine(num_blocks=64, max_model_len=48))
    assert h.submit(PROMPT, max_tokens=48, kv_policy="sink").rejection is None
    refused = h.submit(PROMPT, max_tokens=49, kv_policy="sink").rejection
    assert refused is not None and refused.gate is Gate.INVALID


def test_an_explicit_limit_refuses_below_the_context_under_every_policy() -> None:
    h = Harness(CoreConfig(max_tokens_limit=8), FakeEngine(max_model_len=512))
    for policy in ("full", "sink"):
        refused = h.submit(PROMPT, max_tokens=9, kv_policy=policy).rejection
        assert refused is not None and refused.gate is Gate.INVALID and "of 8 tokens" in refused.message
    accepted = h.submit(PROMPT, max_tokens=8, ignore_eos=True).request_id
    h.run()
    assert h.streams[accepted].finish.reason is FinishReason.LENGTH
    assert len(h.streams[accepted].tokens) == 8


def test_a_continuation_within_the_limit_resumes_to_its_exact_length() -> None:
    h = Harness(CoreConfig(max_tokens_limit=8), FakeEngine(max_model_len=512))
    resumed = h.submit(PROMPT, max_tokens=8, ignore_eos=True, resume_token_ids=(1, 2, 3)).request_id
    h.run()
    assert h.streams[resumed].finish.reason is FinishReason.LENGTH
    assert len(h.streams[resumed].tokens) == 8 - 3


def test_unbounded_asks_stay_within_the_context_and_the_limit() -> None:
    assert output_limit(0, 20, 48) == 28
    assert output_limit(-1, 20, 48, limit=10) == 10
    assert output_limit(5, 20, 48, limit=10) == 5


def test_settings_read_max_tokens_limit() -> None:
    assert SchedulerSettings.from_env({}).core_config().max_tokens_limit == 0
    assert SchedulerSettings.from_env({"MAX_TOKENS_LIMIT": "4096"}).core_config().max_tokens_limit == 4096
    with pytest.raises(SettingsError, match="MAX_TOKENS_LIMIT"):
        SchedulerSettings.from_env({"MAX_TOKENS_LIMIT": "-1"})
