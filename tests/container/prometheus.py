"""Prometheus' HTTP API, and the Grafana dashboard's expressions made into
PromQL Prometheus evaluates (Grafana's own variables filled in as Grafana would)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from tests.fixtures.grafana import grafana_queries

DASHBOARD = Path(__file__).resolve().parents[2] / "monitoring" / "grafana" / "dashboards" / "fairserve.json"
# Grafana's built-in rate window is at least four scrape intervals (5 s here);
# the dashboard's $worker variable, set to All, is its allValue.
GRAFANA_VARIABLES = {"$__rate_interval": "30s", "$worker": ".*"}


def query(base_url: str, expr: str) -> list[dict[str, Any]]:
    """An instant query's result vector; an error status or a non-vector fails."""
    reply = httpx.get(f"{base_url}/api/v1/query", params={"query": expr}, timeout=10)
    # A Prometheus still starting answers 503 in plain text: an assertion callers can wait past.
    assert reply.status_code == 200, (expr, reply.status_code, reply.text[:300])
    body = reply.json()
    assert body["status"] == "success", (expr, body)
    assert body["data"]["resultType"] in ("vector", "scalar"), (expr, body["data"]["resultType"])
    result = body["data"]["result"]
    return result if body["data"]["resultType"] == "vector" else [{"metric": {}, "value": result}]


def up_by_job(base_url: str, jobs: tuple[str, ...]) -> dict[str, list[str]]:
    """Each job's targets that are up == 1, by instance."""
    selector = "|".join(jobs)
    up: dict[str, list[str]] = {job: [] for job in jobs}
    for sample in query(base_url, f'up{{job=~"{selector}"}} == 1'):
        up[sample["metric"]["job"]].append(sample["metric"]["instance"])
    return up


def target_counts(base_url: str, jobs: tuple[str, ...]) -> dict[str, int]:
    """Those jobs' active targets, up or not (from /api/v1/targets)."""
    reply = httpx.get(f"{base_url}/api/v1/targets", params={"state": "active"}, timeout=10)
    counts = Counter(target["labels"]["job"] for target in reply.json()["data"]["activeTargets"])
    return {job: counts[job] for job in jobs}


def dashboard_expressions() -> list[str]:
    return [fill_variables(expr) for expr in grafana_queries(json.loads(DASHBOARD.read_text()))]


def fill_variables(expr: str) -> str:
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, f"a Grafana variable the test does not fill in: {expr}"
    return expr
