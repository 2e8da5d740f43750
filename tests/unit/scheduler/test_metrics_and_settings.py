"""Scheduler metrics match the catalogue; settings read and validate env."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from common.observability import prometheus_names as names
from common.settings.env import SettingsError

from services.scheduler.core.types import CoreConfig, Policy, PrefillMode
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.settings import SchedulerSettings

from tests.unit.scheduler.fake_worker import FakeEngine
from tests.unit.scheduler.harness import Harness


def _scrape(metrics: SchedulerMetrics) -> dict[str, list[tuple[dict[str, str], float]]]:
    text = generate_latest(metrics.registry).decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):  # prometheus_client's creation timestamps
                continue
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def test_the_scheduler_exports_exactly_its_catalogued_families() -> None:
    h = Harness(CoreConfig(policy=Policy.VTC, max_queue_len=2), FakeEngine())
    h.submit((1, 2, 3, 4), max_tokens=3, client_id="alice")
    h.submit((1, 2, 3, 4), max_tokens=3, client_id="bob")
    h.submit((1, 2, 3, 4), max_tokens=3)  # rejected by the queue gate
    h.run()
    metrics = SchedulerMetrics()
    metrics.publish(h.core.stats())
    metrics.observe_step("w0", 0.01)
    metrics.observe_queue_waits(h.core.drain_queue_waits())
    samples = _scrape(metrics)
    exported = {names.family_of_series(name) for name in samples}
    assert None not in exported, [n for n in samples if names.family_of_series(n) is None]
    assert exported == set(names.families_of(names.SCHEDULER))
    for name, series in samples.items():
        family = names.family_of_series(name)
        for labels, _ in series:
            assert set(labels) - {"le"} == set(family.labels), name
    assert samples["fairserve_scheduler_admitted_total"] == [({}, 2.0)]
    assert ({"gate": "queue"}, 1.0) in samples["fairserve_scheduler_rejections_total"]
    assert ({"reason": "length"}, 2.0) in samples["fairserve_scheduler_finished_total"]
    assert ({"gate": "cache_pool"}, 0.0) in samples["fairserve_scheduler_holds_total"]
    # Two placed (the third was refused before routing), on the one worker, no cached prefix.
    assert ({"reason": "least_loaded"}, 2.0) in samples["fairserve_scheduler_routed_total"]
    assert ({"reason": "load"}, 0.0) in samples["fairserve_scheduler_routed_total"]
    assert ({"state": "pending"}, 0.0) in samples["fairserve_scheduler_requests"]
    assert ({"policy": "vtc"}, 1.0) in samples["fairserve_scheduler_policy_info"]
    assert ({"worker": "w0"}, 1.0) in samples["fairserve_scheduler_worker_healthy"]
    vtc = dict((labels["client"], value) for labels, value in samples["fairserve_scheduler_client_vtc_tokens"])
    assert vtc["alice"] == vtc["bob"] == 4 + 2 * 3
    assert samples["fairserve_scheduler_queue_wait_seconds_count"] == [({}, 2.0)]
    metrics.forget_worker("w0")
    assert "fairserve_scheduler_worker_step_seconds_count" not in _scrape(metrics)


def test_settings_defaults_and_env() -> None:
    defaults = SchedulerSettings.from_env({})
    assert defaults == SchedulerSettings()
    assert (defaults.host, defaults.port, defaults.metrics_port) == ("127.0.0.1", 50051, 9101)
    assert (defaults.policy, defaults.prefill_mode) == (Policy.AUTO, PrefillMode.MIXED)
    assert (defaults.max_batch_size, defaults.max_batch_tokens, defaults.max_active_kv_tokens) == (32, 2048, 262144)
    assert (defaults.prefill_chunk_size, defaults.max_queue_len, defaults.queue_timeout_s) == (512, 1024, 60.0)
    assert (defaults.kvcache_addr, defaults.worker_heartbeat_timeout_s) == ("127.0.0.1:50071", 10.0)
    assert (defaults.vtc_input_weight, defaults.vtc_output_weight, defaults.log_level) == (1.0, 2.0, "info")
    assert defaults.async_scheduling and defaults.core_config().max_steps_in_flight == 2
    assert SchedulerSettings.from_env({"ASYNC_SCHEDULING": "false"}).core_config().max_steps_in_flight == 1
    custom = SchedulerSettings.from_env({
        "SCHEDULING_POLICY": "VTC", "PREFILL_MODE": "alternating", "MAX_BATCH_SIZE": "8",
        "QUEUE_TIMEOUT_S": "2.5", "WORKER_HEARTBEAT_TIMEOUT_S": "3", "VTC_OUTPUT_WEIGHT": "4",
    })
    config = custom.core_config()
    assert (config.policy, config.prefill_mode, config.max_batch_size) == (Policy.VTC, PrefillMode.ALTERNATING, 8)
    assert (config.queue_timeout_s, config.heartbeat_timeout_s, config.vtc_output_weight) == (2.5, 3.0, 4.0)
    assert custom.heartbeat_interval_s == pytest.approx(1.0)


@pytest.mark.parametrize("name, value", [
    ("SCHEDULING_POLICY", "lottery"), ("PREFILL_MODE", "sometimes"), ("MAX_BATCH_SIZE", "0"),
    ("MAX_BATCH_TOKENS", "many"), ("QUEUE_TIMEOUT_S", "-1"), ("SCHEDULER_PORT", "70000"),
    ("ASYNC_SCHEDULING", "sometimes"),
])
def test_invalid_settings_name_the_variable(name: str, value: str) -> None:
    with pytest.raises(SettingsError, match=name):
        SchedulerSettings.from_env({name: value})


def test_peer_shards_are_counted_by_whether_they_answer() -> None:
    metrics = SchedulerMetrics()

    def peers() -> dict[str, float]:
        return {labels["state"]: value for labels, value in _scrape(metrics)["fairserve_scheduler_peers"]}

    assert peers() == {"answering": 0.0, "silent": 0.0}          # no SCHEDULER_PEERS
    metrics.set_peer_up("s0:50051", True)
    metrics.set_peer_up("s1:50051", False)
    assert peers() == {"answering": 1.0, "silent": 1.0}
    metrics.set_peer_up("s1:50051", True)
    metrics.forget_peer("s0:50051")                               # it was this scheduler itself
    assert peers() == {"answering": 1.0, "silent": 0.0}
