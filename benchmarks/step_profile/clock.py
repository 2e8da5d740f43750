"""Exclusive wall time per category of a step, by manual timers.

`StepClock.timed(category, fn)` wraps a callable: each call's wall time, less the
time of the timed calls nested inside it, goes to `category` under the kind of the
step running (`prefill`: the step holds a prefill chunk; `decode`: decodes only).
The engine's step itself is the outermost timed call, so the categories of a step
add up to its wall time exactly: every instant of the step is counted once, in the
innermost timed call around it. CPU kernels run synchronously on the calling
thread (their worker threads joined before they return), so a call's wall time
is its kernels' time.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

Flops = Callable[..., float]      # the call's arguments -> floating-point operations


class StepClock:
    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self.now = now
        self.kind = "decode"
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)    # (kind, category) -> exclusive s
        self.flops: dict[tuple[str, str], float] = defaultdict(float)
        self.calls: Counter[tuple[str, str]] = Counter()
        self.steps: Counter[str] = Counter()
        self.step_seconds: dict[str, float] = defaultdict(float)
        self.step_rows: dict[str, int] = defaultdict(int)
        self._open: list[float] = []      # per open timed call: the time of the calls nested in it
        self.after_step: Callable[[str, int], None] | None = None   # run after each step, untimed
        self.excluded_s = 0.0             # what `after_step` took: not the run's time

    def timed(self, category: str, fn: Callable[..., Any], flops: Flops | None = None) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self._open.append(0.0)
            started = self.now()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = self.now() - started
                nested = self._open.pop()
                key = (self.kind, category)
                self.seconds[key] += elapsed - nested
                self.calls[key] += 1
                if flops is not None:
                    self.flops[key] += flops(*args, **kwargs)
                if self._open:
                    self._open[-1] += elapsed

        return wrapper

    def step(self, category: str, fn: Callable[..., Any],
             classify: Callable[..., tuple[str, int]]) -> Callable[..., Any]:
        """`fn` as the outermost timed call of a step; `classify(*args)` says the step's
        kind and its rows (tokens)."""
        timed = self.timed(category, fn)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            kind, rows = classify(*args, **kwargs)
            self.kind = kind
            started = self.now()
            try:
                return timed(*args, **kwargs)
            finally:
                self.steps[kind] += 1
                self.step_seconds[kind] += self.now() - started
                self.step_rows[kind] += rows
                if self.after_step is not None:
                    began = self.now()
                    self.after_step(kind, rows)
                    self.excluded_s += self.now() - began

        return wrapper

    def reset(self) -> None:
        """Forgets every figure (between passes); the wrappers keep reporting here."""
        for table in (self.seconds, self.flops, self.calls, self.steps, self.step_seconds, self.step_rows):
            table.clear()
        self.excluded_s = 0.0

    def kinds(self) -> list[str]:
        return [kind for kind in ("prefill", "decode") if self.steps[kind]]
