"""The fairness benchmark's tenants scenario in its quick mode (tiny model):
the script runs end to end, tenant A's rotating sessions and users stay one
fairness client, B is served, and no raw key shows anywhere. No timing is
checked (the TTFT target is for the full run on an idle machine)."""

from __future__ import annotations

import math

import pytest

from benchmarks import fairness_bench


def _gateway_parses_tenant_keys() -> bool:
    """Whether the gateway reads API_KEYS entries of the form name=key into tenants."""
    try:
        from services.gateway.settings import GatewaySettings

        settings = GatewaySettings.from_env({"API_KEYS": "probe=sk-probe-key"})
    except Exception:
        return False
    return getattr(settings, "tenants", None) is not None


pytestmark = pytest.mark.skipif(not _gateway_parses_tenant_keys(),
                                reason="the gateway does not read name=key tenants from API_KEYS")


def test_tenants_scenario_quick(capsys: pytest.CaptureFixture[str]) -> None:
    outcome = fairness_bench.main(["--quick", "--scenario", "tenants"])
    out = capsys.readouterr().out
    assert outcome is not None
    assert outcome.leaks == [], outcome.leaks
    assert "raw keys seen in: none" in out
    load = fairness_bench.QUICK
    assert len(outcome.b_alone) == load.idle_requests and len(outcome.b_contended) == load.light_requests
    assert all(math.isfinite(t) and t > 0 for t in outcome.b_alone + outcome.b_contended)
    assert outcome.a_done > 0 and not outcome.a_refused      # A's top priority is lowered, not refused
    # A's sessions and users never become fairness clients of their own.
    assert {c["client_id"] for c in outcome.clients} == {"a", "b"}
    assert all(c["weight"] == 1.0 for c in outcome.clients)
    assert "| with A |" in out and "target <= 1.5x" in out
