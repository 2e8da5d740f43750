"""Timing for the choices the CPU speed-ups make by measurement at start."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence


def best_alternating(calls: Sequence[Callable[[], object]], repeats: int, warm_up: bool = True) -> list[float]:
    """The best of `repeats` seconds of each call, the calls taking turns (a busy CPU slows
    them alike); each runs once untimed first when `warm_up`."""
    if warm_up:
        for call in calls:
            call()
    best = [float("inf")] * len(calls)
    for _ in range(repeats):
        for side, call in enumerate(calls):
            started = time.perf_counter()
            call()
            best[side] = min(best[side], time.perf_counter() - started)
    return best
