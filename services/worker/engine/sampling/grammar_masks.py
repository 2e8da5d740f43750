"""The grammar masks of a step's sampled rows, computed while the forward runs.

A row's mask goes to the sampler as an additive float32 bias (0 where the grammar allows, -inf
where it forbids), made in the thread too: the sampler's part is one numpy add per row.

The engine starts them before the forward, in one background thread (llguidance lets go of the
GIL while it computes a mask, and torch while it runs the forward), and the sampler waits for
them only after the logits are computed: the masks cost the step nothing unless they take
longer than the forward. A plan's rows are its decode row and one row after each draft.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from common.grammar import panic_error, panics_as

from services.worker.engine.sampling.sampler import SampleRequest

if TYPE_CHECKING:
    from services.worker.engine.step.planning import Planned


class PendingMasks:
    def __init__(self, future: Future[dict[int, list[np.ndarray]]]) -> None:
        self._future = future

    def attach(self, plans: list[Planned], requests: list[SampleRequest]) -> list[SampleRequest]:
        """`requests` (one per sampled row, `plans` the row's plan) with their grammar masks;
        waits for the masks. A plan's rows come in order: the decode row, then after each draft."""
        masks = self._future.result()
        row_index: dict[int, int] = {}
        attached: list[SampleRequest] = []
        for plan, request in zip(plans, requests, strict=True):
            rows = masks.get(id(plan))
            index = row_index.get(id(plan), 0)
            row_index[id(plan)] = index + 1
            attached.append(request if rows is None else dataclasses.replace(request, grammar_bias=rows[index]))
        return attached


class GrammarMasker:
    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None

    def start(self, planned: list[Planned]) -> PendingMasks | None:
        """Starts the masks of the constrained plans that sample this step; None when there are none."""
        jobs = [plan for plan in planned
                if plan.seq.grammar is not None and (plan.samples or plan.kept is not None)]
        if not jobs:
            return None
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")
        return PendingMasks(self._executor.submit(_masks, jobs))


_FORBIDDEN, _ALLOWED = np.float32(-np.inf), np.float32(0.0)


def _masks(jobs: list[Planned]) -> dict[int, list[np.ndarray]]:
    # A panic of the grammar library becomes an error the step's isolation can pin on one
    # sequence (isolation.py catches Exception; a panic is a BaseException).
    with panics_as(panic_error("a mask")):
        return {id(plan): [np.where(banned, _FORBIDDEN, _ALLOWED)
                           for banned in plan.seq.grammar.banned_rows(plan.drafts)]
                for plan in jobs}
