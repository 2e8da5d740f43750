"""The burst rule of step/wide_release.py on its own: a burst of wide steps releases once, at
the first narrow step after it, and within it every `max_burst` wide steps; narrow steps alone,
the setting at 0 and a quiet point's own release leave nothing pending; a step of no rows (frees
alone) or a narrow one of prompt tokens alone neither ends a burst nor counts."""

from __future__ import annotations

import pytest

from services.worker.engine.step.wide_release import WideRelease


@pytest.mark.parametrize("rows,steps,expected", [
    (256, [2048, 2048, 661, 30, 30], [False, False, False, True, False]),
    (256, [30, 30, 30], [False, False, False]),
    (256, [255, 256, 255], [False, False, True]),      # the setting's rows count as wide
    (256, [2048, 30, 2048, 30], [False, True, False, True]),
    (0, [2048, 30, 2048, 30], [False, False, False, False]),
    (256, [2048, 0, 0, 30], [False, False, False, True]),   # frees alone: still pending
])
def test_one_release_per_burst_of_wide_steps(rows: int, steps: list[int], expected: list[bool]) -> None:
    release = WideRelease(rows)
    assert [release.after_step(step) for step in steps] == expected


def test_a_long_burst_releases_every_max_burst_wide_steps() -> None:
    release = WideRelease(256, max_burst=3)
    assert [release.after_step(2048) for _ in range(7)] == [False, False, True, False, False, True, False]
    assert release.after_step(30) is True          # the seventh's
    assert release.after_step(30) is False


def test_a_release_elsewhere_clears_the_pending_one() -> None:
    release = WideRelease(256)
    release.after_step(2048)
    release.released_elsewhere()
    assert release.after_step(30) is False


def test_a_narrow_step_of_prompt_tokens_alone_does_not_end_a_burst() -> None:
    release = WideRelease(256)
    assert release.after_step(2048) is False
    assert release.after_step(10, decodes=False) is False      # a cached prompt's last tokens
    assert release.pending == 1
    assert release.after_step(11, decodes=True) is True        # the first decode after it
