"""The chaos suite's pure parts: a stream against its undisturbed reference,
the counts per fault, the table and the exit code."""

from __future__ import annotations

import pytest

from benchmarks.chaos import ChaosSettings, _take, parse_args
from benchmarks.chaos_report import (FaultReport, StreamResult, classify, exit_code, fault_report,
                                     markdown_table)

REFERENCE = "the sea was calm"


def done(text: str, status: int = 200) -> StreamResult:
    return StreamResult(status=status, text=text, chunks=len(text), finish_reason="length")


@pytest.mark.parametrize(("result", "kind"), [
    (done(REFERENCE), "ok"),
    (done(REFERENCE + " was calm"), "duplicated"),
    (done("the sea was warm"), "differed"),
    (done("the sea"), "differed"),
    (StreamResult(status=200, text="the sea", chunks=2), "lost"),
    (StreamResult(status=200, text="the sea", finish_reason="length", error='{"code": 503}'), "lost"),
    (StreamResult(status=503, error="busy"), "5xx"),
    (StreamResult(status=0, error="ConnectError"), "rejected"),
    (StreamResult(status=429), "rejected"),
])
def test_classify(result: StreamResult, kind: str) -> None:
    assert classify(result, REFERENCE) == kind


def test_fault_report_counts_each_kind_and_describes_the_bad_ones() -> None:
    results = [done(REFERENCE), done(REFERENCE + "!"), done("x"), StreamResult(status=200),
               StreamResult(status=502)]
    report = fault_report("worker", results, [REFERENCE] * 5, [3, 4, 5, 6, 7], 1.234, 9.87)
    assert (report.streams, report.accepted, report.completed) == (5, 4, 3)
    assert (report.lost, report.differed, report.duplicated, report.server_errors) == (1, 1, 1, 1)
    assert not report.ok and report.recovery_s == 1.23 and len(report.details) == 4
    assert report.details[0].startswith("stream 1: duplicated") and "first difference at char 16" in \
        report.details[0]
    assert report.to_json()["ok"] is False


def test_a_clean_fault_is_ok_and_the_exit_code_follows_every_fault() -> None:
    clean = fault_report("kvcache", [done(REFERENCE)] * 2, [REFERENCE] * 2, [4, 5], 1.0, 2.0)
    assert clean.ok and exit_code([clean]) == 0
    assert exit_code([clean, FaultReport("redis", streams=1)]) == 1   # nothing completed
    assert exit_code([]) == 1


def test_markdown_table_has_a_row_per_fault() -> None:
    clean = fault_report("scheduler", [done(REFERENCE)], [REFERENCE], [8], 2.5, 3.0)
    bad = fault_report("worker", [StreamResult(status=500)], [REFERENCE], [], 0.0, 1.0)
    lines = markdown_table([clean, bad]).splitlines()
    assert lines[0].startswith("| fault | streams |") and len(lines) == 4
    assert lines[2] == "| scheduler | 1 | 1 | 1 | 0 | 0 | 0 | 0 | 8–8 | 2.5 | yes |"
    assert lines[3].endswith("| 1 | - | 0.0 | **no** |")


def test_sse_events_are_gathered_into_the_stream() -> None:
    seen = StreamResult(status=200)
    _take(seen, {"choices": [{"text": "a", "finish_reason": None}]})
    _take(seen, {"choices": [{"text": "b", "finish_reason": "length"}]})
    assert (seen.text, seen.chunks, seen.finish_reason, seen.error) == ("ab", 2, "length", None)
    _take(seen, {"error": {"message": "scheduler unavailable"}})
    assert "scheduler unavailable" in seen.error


def test_arguments() -> None:
    quick = parse_args(["--quick", "--redis", "no", "--tokens", "30"])
    assert (quick.quick, quick.streams, quick.tokens, quick.redis) == (True, 4, 30, False)
    full = parse_args([])
    assert full == ChaosSettings() and (full.streams, full.tokens, full.redis) == (12, 128, None)
