"""Reads the metric names a Grafana dashboard's PromQL queries use, so tests
can check them against the catalogue (common.prometheus_names) and against
what a running stack exports."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_LABEL_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGES = re.compile(r"\[[^\[\]]*\]")
_LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENTIFIER = re.compile(r"(?<![\w.$:])[a-zA-Z_:][\w:]*")
_KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
             "offset", "bool", "inf", "nan", "atan2", "start", "end"}
_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?:([a-zA-Z_:][\w:]*)\s*(?:\{[^{}]*\})?\s*,)?\s*\w+\s*\)\s*$")
_QUERY_RESULT = re.compile(r"^\s*query_result\((.*)\)\s*$", re.DOTALL)


def promql_metric_names(expr: str) -> set[str]:
    """Metric names an expression selects: identifiers that are neither
    functions, keywords, label names nor Grafana variables."""
    text = _STRING.sub('""', expr)
    text = _LABEL_MATCHERS.sub("", text)
    text = _RANGES.sub("", text)
    text = _LABEL_LISTS.sub("", text)
    names = set()
    for match in _IDENTIFIER.finditer(text):
        name = match.group(0)
        is_call = text[match.end():].lstrip().startswith("(")
        if not is_call and name.lower() not in _KEYWORDS:
            names.add(name)
    return names


def _panels(panels: list[dict]) -> Iterator[dict]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # rows hold their panels when collapsed


def grafana_queries(dashboard: dict) -> list[str]:
    """Every PromQL expression of the panels' targets."""
    return [target["expr"] for panel in _panels(dashboard.get("panels", []))
            for target in panel.get("targets", []) if target.get("expr")]


def _variable_metric_names(dashboard: dict) -> set[str]:
    names: set[str] = set()
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable.get("query")
        query = query.get("query", "") if isinstance(query, dict) else query or ""
        if match := _LABEL_VALUES.match(query):
            names.update(filter(None, [match.group(1)]))
        elif match := _QUERY_RESULT.match(query):
            names |= promql_metric_names(match.group(1))
    return names


def grafana_metric_names(path: str | Path) -> set[str]:
    """The metric (series) names a dashboard JSON file's queries use, as
    written, e.g. fairserve_gateway_ttft_seconds_bucket for a histogram."""
    dashboard = json.loads(Path(path).read_text())
    names = _variable_metric_names(dashboard)
    for expr in grafana_queries(dashboard):
        names |= promql_metric_names(expr)
    return names


def exported_series_names(exposition: str) -> set[str]:
    """Sample names in a Prometheus text exposition (a /metrics body), e.g.
    fairserve_gateway_ttft_seconds_bucket and fairserve_gateway_requests_total."""
    return {sample.name for family in text_string_to_metric_families(exposition) for sample in family.samples}
