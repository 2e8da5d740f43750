import re
from pathlib import Path

import yaml

from common.observability.metrics import LATENCY_BUCKETS_S, TOKEN_LATENCY_BUCKETS_S
from common.observability.prometheus_names import (ALL_FAMILIES, COUNTER, EXPORTERS, HISTOGRAM, SERVICES,
                                     families_of, family_of_series)

ROOT = Path(__file__).resolve().parents[3]
DOCS = ROOT / "docs" / "metrics.md"
TABLE_ROW = re.compile(r"^\|\s*`(fairserve_\w+)`\s*\|\s*(\w+)\s*\|\s*([^|]*)\|")


def documented_families() -> dict[str, tuple[str, tuple[str, ...]]]:
    rows = {}
    for line in DOCS.read_text().splitlines():
        if match := TABLE_ROW.match(line):
            labels = tuple(label.strip() for label in match.group(3).split(",") if label.strip() not in ("", "–"))
            assert match.group(1) not in rows, f"{match.group(1)} documented twice"
            rows[match.group(1)] = (match.group(2), labels)
    return rows


def test_names_follow_the_scheme():
    pattern = re.compile(rf"^fairserve_({'|'.join(EXPORTERS)})_[a-z][a-z0-9_]*[a-z0-9]$")
    for family in ALL_FAMILIES:
        assert pattern.match(family.name), family.name
        assert family.name.split("_")[1] == family.service
        assert family.name.endswith("_total") == (family.kind == COUNTER), family.name
        if family.kind == HISTOGRAM:
            assert family.name.endswith("_seconds") and family.buckets, family.name
        assert family.help


def test_names_are_unique_and_every_service_exports_some():
    names = [family.name for family in ALL_FAMILIES]
    assert len(names) == len(set(names))
    assert all(families_of(exporter) for exporter in EXPORTERS)
    assert set(SERVICES) < set(EXPORTERS)


def test_histograms_use_the_shared_buckets():
    for family in ALL_FAMILIES:
        if family.kind == HISTOGRAM:
            assert family.buckets in (LATENCY_BUCKETS_S, TOKEN_LATENCY_BUCKETS_S), family.name


def test_series_names_map_back_to_their_family():
    for family in ALL_FAMILIES:
        for series in family.series_names():
            assert family_of_series(series) == family
    assert family_of_series("fairserve_gateway_ttft_seconds") is None  # histograms expose only suffixed series
    assert family_of_series("something_else") is None


def test_docs_document_every_family_with_its_type_and_labels():
    documented = documented_families()
    assert set(documented) == {family.name for family in ALL_FAMILIES}
    for family in ALL_FAMILIES:
        assert documented[family.name] == (family.kind, family.labels), family.name


def test_docs_describe_the_stats_schema():
    text = DOCS.read_text()
    assert "## /stats schema" in text
    for key in ('"ts"', '"gateway"', '"scheduler"', '"kvcache"', '"latency_ms"', '"workers"', '"clients"',
                '"blocks_by_worker"', '"rejections"', '"holds"'):
        assert key in text, key


def test_prometheus_scrapes_every_exporter() -> None:
    config = yaml.safe_load((ROOT / "monitoring" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == set(EXPORTERS)
    assert jobs["supervisor"]["static_configs"] == [{"targets": ["localhost:9104"]}]
