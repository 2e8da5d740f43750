"""The SLO rules (monitoring/rules/fairserve.rules.yml): valid for promtool,
their promtool unit tests pass (each alert fires on a bad stack and stays
quiet on a healthy one), they read only catalogued metrics, and the compose
Prometheus loads them. promtool comes from Debian's `prometheus` package."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from common.observability.prometheus_names import family_of_series
from tests.fixtures.grafana import promql_metric_names

ROOT = Path(__file__).resolve().parents[3]
RULES = ROOT / "monitoring" / "rules" / "fairserve.rules.yml"
RULE_TESTS = RULES.with_name("fairserve.rules.test.yml")
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None,
                                    reason="no promtool (Debian: apt-get install prometheus)")
SLO_ALERTS = {"FairserveTTFTHigh", "FairserveTPOTHigh", "FairserveErrorRatioHigh", "FairserveQueueDeep",
              "FairserveSchedulerDown", "FairserveWorkerDown", "FairserveKvPoolFull",
              "FairserveSchedulerPeerSilent"}


def rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


@needs_promtool
def test_promtool_accepts_the_rules() -> None:
    result = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_promtool_unit_tests_pass() -> None:
    result = subprocess.run([PROMTOOL, "test", "rules", RULE_TESTS.name], cwd=RULES.parent,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_slo_has_an_alert_and_every_alert_is_tested() -> None:
    alerts = {rule["alert"] for rule in rules() if "alert" in rule}
    assert alerts == SLO_ALERTS
    tested = {case["alertname"] for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
              for case in test.get("alert_rule_test", ())}
    assert tested == alerts
    for rule in rules():
        if "alert" in rule:
            assert rule["labels"]["severity"] in ("warning", "critical") and rule["annotations"]["summary"]


def test_the_rules_read_only_catalogued_metrics() -> None:
    recorded = {rule["record"] for rule in rules() if "record" in rule}
    read = set().union(*(promql_metric_names(rule["expr"]) for rule in rules()))
    unknown = {name for name in read - recorded - {"up"} if family_of_series(name) is None}
    assert unknown == set()


def test_the_compose_prometheus_loads_them() -> None:
    config = yaml.safe_load((ROOT / "monitoring" / "prometheus.yml").read_text())
    compose = yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())
    (path,) = config["rule_files"]
    assert f"../monitoring/rules/{RULES.name}:{path}:ro" in compose["services"]["prometheus"]["volumes"]
