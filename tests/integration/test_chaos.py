"""The chaos suite's quick mode (tiny model, two workers and then one, 4 streams
of 100 tokens, long enough that every kill comes mid-stream): a worker, the
scheduler, the KV index service, the gateway (background /v1/responses streams
the client resumes) and Redis (when
redis-server is installed; two workers) each killed with SIGKILL mid-stream and
started again lose no stream, change no stream's text, repeat no token and give
no 5xx."""

from __future__ import annotations

import shutil

import pytest

from benchmarks.chaos import ChaosSettings, run_suite
from benchmarks.chaos_report import FaultReport


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, FaultReport]:
    settings = ChaosSettings.quick_mode(out_dir=tmp_path_factory.mktemp("chaos"))
    return {report.fault: report for report in run_suite(settings)}


@pytest.mark.parametrize("fault", ["worker", "scheduler", "kvcache", "gateway", "redis", "worker (1 worker)",
                                   "scheduler (1 worker)", "kvcache (1 worker)", "gateway (1 worker)"])
def test_a_fault_loses_changes_and_repeats_nothing(reports: dict[str, FaultReport], fault: str) -> None:
    if fault == "redis" and shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed")
    report = reports[fault]
    assert report.streams == 4 and all(count < 100 for count in report.chunks_at_kill), report
    assert (report.accepted, report.completed) == (4, 4), report.details
    assert (report.lost, report.differed, report.duplicated, report.server_errors) == (0, 0, 0, 0), \
        report.details
