"""Which of two screens of one head serves a step, by its rows (LM_HEAD_SCREEN_ACTIVATIONS=auto).

A head screened from its 8-bit codes can round hidden states to int16 or to int8 (one scale per
block of the codes; codes_screen_int8.py). Which is faster depends on the step's rows, not only
on the kernels: the int16 screen runs its rounding, top-k, bound and exact logits in one C call
around the kernel (native/screen_pick.c), where the int8 screen does that part in torch ops. On a
2-core AMD EPYC Zen 5 both kernels took the same time at 1-8 rows, but a batch-1 decode step ran
1.12x faster through the int16 screen (and 1.05x faster than no screen at all), while at 30-32
rows the int8 kernel is ~1.5x faster. So where the int8 kernel runs, `auto` keeps both screens
(they share the codes and their reused rows: the int16 one adds its half-float scales and
norms, ~17 MB on Gemma 3's head) and times both whole screens at start on rows whose winner is clear (the head's own rows,
scaled): the int16 screen serves steps of up to `few_rows` rows, the largest timed count up to
which it was faster at every count, and the int8 screen the wider ones.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.worker.engine.cpu.screen.lm_head_screen import LMHeadScreen

ROW_COUNTS = (1, 2, 4, 8, 16, 32)     # the step widths both screens are timed at
ROUNDS = 5                            # best of this many calls each, alternating
HIDDEN_SCALE = 40.0                   # head rows this many times over: one clear winner a row


@dataclass(frozen=True)
class RowSplit:
    """Steps of up to `few_rows` rows take `few`, wider ones `many`."""
    few: LMHeadScreen
    many: LMHeadScreen
    few_rows: int

    def screen_for(self, rows: int) -> LMHeadScreen:
        return self.few if rows <= self.few_rows else self.many


def probe_rows(screen: LMHeadScreen, rows: int) -> torch.Tensor:
    """[rows, hidden] float32 hidden states whose best token is clear: rows of the head itself
    (from its codes), spread over the vocabulary, scaled by HIDDEN_SCALE."""
    assert screen._coded is not None
    ids = torch.linspace(0, screen.vocab_size - 1, rows).long()
    return screen._coded.rows(ids) * HIDDEN_SCALE


def few_rows_limit(few: LMHeadScreen, many: LMHeadScreen, clock: Callable[[], float] = time.perf_counter,
                   row_counts: tuple[int, ...] = ROW_COUNTS) -> int:
    """The largest of `row_counts` up to which `few` took less time than `many` at every count
    (greedy rows, best of ROUNDS calls each, alternating); 0 where it was not faster at the first."""
    limit = 0
    for rows in row_counts:
        hidden = probe_rows(many, rows)
        best = {id(few): float("inf"), id(many): float("inf")}
        for _ in range(ROUNDS):
            for screen in (few, many):
                started = clock()
                screen.logits(hidden, [1] * rows, [[]] * rows)
                best[id(screen)] = min(best[id(screen)], clock() - started)
        if best[id(few)] >= best[id(many)]:
            break
        limit = rows
    return limit


def split_by_rows(many: LMHeadScreen, make_few: Callable[[], LMHeadScreen | None],
                  clock: Callable[[], float] = time.perf_counter) -> RowSplit | None:
    """A split where `many` screens with int8 activations and the screen `make_few` builds (int16)
    was faster on the narrowest steps; None otherwise (`many` serves every step)."""
    if many.activations != "int8" or many._coded is None:
        return None
    few = make_few()
    if few is None or few.activations != "int16":
        return None
    few.share_rows(many)
    limit = few_rows_limit(few, many, clock)
    many.release_rows()         # grown to the widest timed step; serving regrows them to its own
    return RowSplit(few, many, limit) if limit > 0 else None
