"""Each client's weight travels from the core's stats to /stats."""

from __future__ import annotations

from services.gateway.convert import scheduler_stats_to_dict
from services.scheduler import convert
from services.scheduler.core.types import CoreConfig, Policy

from tests.unit.scheduler.fake_worker import FakeEngine
from tests.unit.scheduler.harness import Harness


def test_the_client_weight_reaches_the_stats_page() -> None:
    h = Harness(CoreConfig(policy=Policy.VTC), FakeEngine())
    h.submit((1, 2, 3, 4), max_tokens=2, client_id="gold", user="u1", weight=2.5)
    h.submit((5, 6, 7, 8), max_tokens=2, client_id="plain")
    h.run()
    message = convert.stats_to_proto(h.core.stats())
    assert {c.client_id: c.weight for c in message.clients} == {"gold": 2.5, "plain": 1.0}
    clients = {c["client_id"]: c for c in scheduler_stats_to_dict(message)["clients"]}
    assert clients["gold"] == {"client_id": "gold", "counter": (4 + 2 * 2) / 2.5, "served_tokens": 6, "weight": 2.5}
    assert clients["plain"]["weight"] == 1.0
