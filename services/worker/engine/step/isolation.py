"""A step whose planning or forward raises: which work items are to blame.

Before a step's work is planned, its sequences are marked (how far each was
computed, how many blocks it held, what its lossy KV policy had dropped and scored);
when planning, the forward or sampling
raises, they are rolled back to the mark (blocks planned for the step go back
to the pool; nothing was committed) and the work runs again in halves, down
to single items. An item that fails alone ends with StepError.INTERNAL; every
other item gets its normal result, computed in a smaller forward. When no
item could be computed at all, the fault is not any one sequence's (a broken
device, a bug in the engine): the first error is raised again and the worker
fails the step as a whole, as before.

Committing a computed step (sequences.commit) is not guarded: it only runs
after the forward and sampling succeeded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from common.sequence_ids import request_id_of
from common.step import SeqResult, StepError, WorkItem
from services.worker.engine.kv.block_pool import BlockPool
from services.worker.engine.step.sequences import Sequences, SequenceState

log = logging.getLogger(__name__)

Compute = Callable[[list[WorkItem]], list[SeqResult]]


@dataclass(frozen=True)
class _SeqMark:
    seq: SequenceState
    had_table: bool
    blocks: int
    started: bool
    num_computed: int
    num_registered_blocks: int
    evicted: int
    block_scores: tuple[float, ...]


@dataclass(frozen=True)
class _Mark:
    sequences: tuple[_SeqMark, ...]
    prefix_query_tokens: int
    prefix_hit_tokens: int


class StepIsolation:
    def __init__(self, sequences: Sequences, pool: BlockPool) -> None:
        self.sequences = sequences
        self.pool = pool
        self._first_error: BaseException | None = None

    def run(self, work: list[WorkItem], compute: Compute) -> list[SeqResult]:
        """compute(work)'s results, with the items that fail alone as INTERNAL;
        raises the first error when no item could be computed."""
        self._first_error = None
        results = self._attempt(work, compute)
        error, self._first_error = self._first_error, None
        if error is not None and not any(result.error == StepError.NONE for result in results):
            raise error
        return results

    def _attempt(self, work: list[WorkItem], compute: Compute) -> list[SeqResult]:
        mark = self._mark(work)
        try:
            return compute(work)
        except Exception as error:
            self._roll_back(mark)
            if self._first_error is None:
                self._first_error = error
            if len(work) == 1:
                return [self._failed(work[0], error)]
            return self._halves(work, compute)

    def _halves(self, work: list[WorkItem], compute: Compute) -> list[SeqResult]:
        """The work again in two halves, in order. A repeated item (DUPLICATE_WORK) stays
        out of them, so that halves cannot compute a sequence twice."""
        seen: set[str] = set()
        unique: list[WorkItem] = []
        for item in work:
            if item.seq_id not in seen:
                seen.add(item.seq_id)
                unique.append(item)
        middle = len(unique) // 2
        computed = iter(self._attempt(unique[:middle], compute) + self._attempt(unique[middle:], compute))
        seen.clear()
        results = []
        for item in work:
            if item.seq_id in seen:
                seq = self.sequences.get(item.seq_id)
                results.append(SeqResult(item.seq_id, seq.num_computed if seq is not None else 0,
                                           error=StepError.DUPLICATE_WORK))
            else:
                seen.add(item.seq_id)
                results.append(next(computed))
        return results

    def _failed(self, item: WorkItem, error: Exception) -> SeqResult:
        seq = self.sequences.get(item.seq_id)
        log.warning("a sequence failed alone in a step", exc_info=error, extra={
            "request_id": request_id_of(item.seq_id), "seq_id": item.seq_id, "error": repr(error)})
        return SeqResult(item.seq_id, seq.num_computed if seq is not None else 0, error=StepError.INTERNAL)

    def _mark(self, work: list[WorkItem]) -> _Mark:
        marks = []
        for item in work:
            seq = self.sequences.get(item.seq_id)
            if seq is not None:
                marks.append(_SeqMark(seq, self.pool.has_sequence(seq.seq_id), len(self.pool.table(seq.seq_id)),
                                      seq.started, seq.num_computed, seq.num_registered_blocks,
                                      seq.evicted, tuple(seq.block_scores)))
        return _Mark(tuple(marks), self.pool.prefix_query_tokens, self.pool.prefix_hit_tokens)

    def _roll_back(self, mark: _Mark) -> None:
        """Puts the marked sequences back as they were: blocks planned since go back to
        the pool (cached ones stay cached), and so do their counters. Blocks a lossy
        policy dropped are back in their tables already (the engine undid the drops)."""
        for seq_mark in mark.sequences:
            seq = seq_mark.seq
            if not seq_mark.had_table:
                self.pool.free(seq.seq_id)
            else:
                self.pool.shrink(seq.seq_id, seq_mark.blocks * self.pool.block_size)
            seq.started = seq_mark.started
            seq.num_computed = seq_mark.num_computed
            seq.num_registered_blocks = seq_mark.num_registered_blocks
            seq.evicted = seq_mark.evicted
            seq.block_scores = list(seq_mark.block_scores)
        self.pool.prefix_query_tokens = mark.prefix_query_tokens
        self.pool.prefix_hit_tokens = mark.prefix_hit_tokens
