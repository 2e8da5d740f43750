"""The A/B benchmark's arithmetic (benchmarks/ab_stacks.py): settings parsed from NAME=VALUE
with an error naming the flag (serving_bench's parser), the order flipping every round, B / A
paired by round, and the summary's medians, peaks and count of rounds each way. The stacks
themselves run in tests/integration/test_bench_ab.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.ab_stacks import Round, Side, order, paired_ratios, summary
from benchmarks.serving_bench import fairserve_settings


def test_settings_parse_and_a_malformed_one_names_its_flag() -> None:
    assert fairserve_settings(["A=1", "B=x=y", "C="], "--b-env") == {"A": "1", "B": "x=y", "C": ""}
    with pytest.raises(SystemExit, match="--a-env expects NAME=VALUE, got 'NOEQUALS'"):
        fairserve_settings(["NOEQUALS"], "--a-env")
    with pytest.raises(SystemExit, match="--b-env"):
        fairserve_settings(["=1"], "--b-env")


def test_the_order_flips_every_round() -> None:
    assert [order(i) for i in range(4)] == [(0, 1), (1, 0), (0, 1), (1, 0)]


def _round(tok_s: float, tpot: float = 10.0, worker: float = 600.0) -> Round:
    return Round(tok_s, tpot, worker, 240.0)


def test_ratios_pair_rounds_and_skip_an_empty_a() -> None:
    a = [_round(100.0), _round(0.0), _round(200.0)]
    b = [_round(110.0), _round(50.0), _round(180.0)]
    assert paired_ratios(a, b) == pytest.approx([1.1, 0.9])


def test_summary_gives_medians_peaks_and_rounds_each_way() -> None:
    sides = (Side("A", Path("/before"), {}), Side("B", Path("/after"), {"X": "1"}))
    a = [_round(100.0, 12.0, 650.0), _round(120.0, 10.0, 700.0), _round(110.0, 11.0, 640.0)]
    b = [_round(105.0, 11.0, 640.0), _round(126.0, 9.0, 690.0), _round(99.0, 12.0, 705.0)]
    lines = summary(sides, (a, b))
    assert lines[0] == "A (/before): 110.0 tok/s, TPOT p50 11.00 ms (medians of 3), worker peak 700 MB, gateway 240"
    assert lines[1].startswith("B (/after, X=1): 105.0 tok/s, TPOT p50 11.00 ms") and "worker peak 705 MB" in lines[1]
    assert lines[2] == ("B / A output tok/s, paired by round: median 1.050 (0.900-1.050; B higher in 2 of 3):"
                        " 1.050 1.050 0.900")
