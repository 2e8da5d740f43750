"""The burst rule of step/wide_release.py on its own: a burst of wide steps releases once, at
the first narrow step after it; narrow steps alone, the setting at 0 and a quiet point's own
release leave nothing pending."""

from __future__ import annotations

import pytest

from services.worker.engine.step.wide_release import WideRelease


@pytest.mark.parametrize("rows,steps,expected", [
    (256, [2048, 2048, 661, 30, 30], [False, False, False, True, False]),
    (256, [30, 30, 30], [False, False, False]),
    (256, [255, 256, 255], [False, False, True]),      # the setting's rows count as wide
    (256, [2048, 30, 2048, 30], [False, True, False, True]),
    (0, [2048, 30, 2048, 30], [False, False, False, False]),
])
def test_one_release_per_burst_of_wide_steps(rows: int, steps: list[int], expected: list[bool]) -> None:
    release = WideRelease(rows)
    assert [release.after_step(step) for step in steps] == expected


def test_a_release_elsewhere_clears_the_pending_one() -> None:
    release = WideRelease(256)
    release.after_step(2048)
    release.released_elsewhere()
    assert release.after_step(30) is False
