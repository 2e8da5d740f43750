"""The screen-plane benchmark's table from recorded timings, and its exit where no plane was built
(the run itself needs the default model's Q8_0 head and AVX2: docs/benchmarks.md)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks import screen_plane_bench
from benchmarks.screen_plane_bench import Timings, table


def recorded() -> Timings:
    timings = Timings()
    for kind, codes, plane in (("decode", 9.0, 7.5), ("cached prefix", 16.0, 15.0)):
        timings.steps[(kind, False)] = [codes, codes + 1.0, codes - 1.0]
        timings.steps[(kind, True)] = [plane, plane + 1.0, plane - 1.0]
        timings.screens[(kind, False)] = [4.0, 4.2]
        timings.screens[(kind, True)] = [2.6, 2.8]
    timings.panels["decode"] = [3, 3, 7670]
    timings.panels["cached prefix"] = [1200, 1300]
    return timings


def test_the_table_gives_each_steps_medians_their_ratio_and_the_panels_left() -> None:
    out = table(recorded(), same_tokens=True, plane_bytes=83_886_080)
    assert "| decode (n = 3 each) | 9.00 / 7.50 | 4.10 / 2.70 | **1.20x** | 3, 7670 |" in out
    assert "| cached prefix (n = 3 each) | 16.00 / 15.00 | 4.10 / 2.70 | **1.07x** | 1250, 1300 |" in out
    assert "Plane 84 MB; the same greedy tokens with and without it: yes." in out


def test_different_tokens_are_reported() -> None:
    assert "with and without it: NO" in table(recorded(), same_tokens=False, plane_bytes=1)


def test_an_engine_without_a_plane_stops_the_run_with_why() -> None:
    engine = SimpleNamespace(prepared=SimpleNamespace(screen=SimpleNamespace(screen_for=lambda rows: None)))
    with pytest.raises(SystemExit, match="AVX2"):
        screen_plane_bench._one_row_screen(engine)
