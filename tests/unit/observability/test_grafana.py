import json
from pathlib import Path

import pytest

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from tests.fixtures.grafana import exported_series_names, grafana_metric_names, grafana_queries, promql_metric_names
from common.observability.prometheus_names import (ALL_FAMILIES, GATEWAY_E2E, GATEWAY_INTER_TOKEN, GATEWAY_TPOT, GATEWAY_TTFT,
                                     KVCACHE_HIT_RATE, SCHEDULER_CLIENT_VTC, SCHEDULER_PREEMPTIONS,
                                     SCHEDULER_QUEUE_WAIT, SCHEDULER_REJECTIONS, SCHEDULER_REQUESTS,
                                     WORKER_BATCH_SEQUENCES, WORKER_KV_BLOCKS, WORKER_KV_EVICTIONS, WORKER_STEP,
                                     family_of_series)

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD = ROOT / "monitoring" / "grafana" / "dashboards" / "fairserve.json"
DATASOURCES = ROOT / "monitoring" / "grafana" / "provisioning" / "datasources" / "prometheus.yml"


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.mark.parametrize(("expr", "names"), [
    ('histogram_quantile(0.95, sum by (le, worker) (rate(m_seconds_bucket{worker=~"$worker"}[$__rate_interval])))',
     {"m_seconds_bucket"}),
    ("sum(rate(a_total[5m])) / sum(rate(b_total[5m])) > bool 0", {"a_total", "b_total"}),
    ("sum without (instance) (x) offset 5m * on (worker) group_left (state) y and z unless 1e3", {"x", "y", "z"}),
    ("max_over_time(m[5m:1m])", {"m"}),
    ('label_replace(up{job="a"}, "dst", "$1", "job", "(.*)")', {"up"}),
    ("sum(x) by (le)", {"x"}),
    ('count_values("rate", m)', {"m"}),
    ("vector(1)", set()),
])
def test_promql_metric_names(expr, names):
    assert promql_metric_names(expr) == names


def test_names_come_from_queries_and_variables(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps({
        "templating": {"list": [
            {"type": "query", "query": {"query": "label_values(var_metric, worker)"}},
            {"type": "query", "query": "label_values(worker)"},
            {"type": "custom", "query": "a,b"}]},
        "panels": [
            {"type": "timeseries", "targets": [{"expr": "rate(top_total[1m])"}, {"expr": ""}]},
            {"type": "row", "collapsed": True, "panels": [{"targets": [{"expr": "nested_metric"}]}]},
        ]}))
    assert grafana_metric_names(path) == {"var_metric", "top_total", "nested_metric"}


def test_every_queried_metric_is_catalogued():
    names = grafana_metric_names(DASHBOARD)
    assert names
    assert sorted(name for name in names if family_of_series(name) is None) == []


def test_every_catalogued_family_has_a_panel():
    used = {family_of_series(name).name for name in grafana_metric_names(DASHBOARD)}
    assert sorted(family.name for family in ALL_FAMILIES if family.name not in used) == []


def test_percentiles_come_from_histogram_buckets(dashboard):
    queries = grafana_queries(dashboard)
    for family in (GATEWAY_TTFT, GATEWAY_TPOT, GATEWAY_INTER_TOKEN, GATEWAY_E2E, SCHEDULER_QUEUE_WAIT, WORKER_STEP):
        quantile_queries = [q for q in queries if f"{family.name}_bucket" in q]
        assert quantile_queries, family.name
        assert all("histogram_quantile(" in q and "rate(" in q for q in quantile_queries)
    ttft = " ".join(q for q in queries if "ttft" in q)
    assert all(f"histogram_quantile({q}," in ttft for q in ("0.5", "0.95", "0.99"))


def test_the_issue_panels_are_covered():
    used = {family_of_series(name) for name in grafana_metric_names(DASHBOARD)}
    for family in (SCHEDULER_REQUESTS, WORKER_KV_BLOCKS, WORKER_KV_EVICTIONS, KVCACHE_HIT_RATE,
                   SCHEDULER_PREEMPTIONS, SCHEDULER_REJECTIONS, WORKER_STEP, WORKER_BATCH_SEQUENCES,
                   SCHEDULER_CLIENT_VTC):
        assert family in used, family.name


def test_the_dashboard_imports_anywhere(dashboard):
    """Every query names its datasource through ${DS_PROMETHEUS}: an import
    asks for it (__inputs), and provisioned, the datasource variable resolves
    it to the default Prometheus. No uid of one installation is hard-coded."""
    source = "${DS_PROMETHEUS}"
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    assert dashboard["__inputs"][0]["pluginId"] == "prometheus"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    assert "isDefault: true" in DATASOURCES.read_text()
    uids = {ref["uid"] for ref in _datasource_refs(dashboard)}
    assert uids == {source}
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert panels
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": source}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == source


def _datasource_refs(node):
    if isinstance(node, dict):
        if isinstance(node.get("datasource"), dict):
            yield node["datasource"]
        for value in node.values():
            yield from _datasource_refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _datasource_refs(value)


def test_layout_is_valid(dashboard):
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert dashboard["uid"] and dashboard["title"]
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        ref_ids = [t["refId"] for t in panel.get("targets", [])]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]


def test_exported_series_names_match_what_queries_use():
    registry = CollectorRegistry()
    Histogram(GATEWAY_TTFT.name, "ttft", buckets=GATEWAY_TTFT.buckets, registry=registry).observe(0.1)
    Counter(SCHEDULER_PREEMPTIONS.name, "preemptions", registry=registry).inc()
    exported = exported_series_names(generate_latest(registry).decode())
    assert set(GATEWAY_TTFT.series_names()) <= exported
    assert SCHEDULER_PREEMPTIONS.name in exported
