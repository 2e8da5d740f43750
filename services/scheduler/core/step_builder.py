"""One step under construction: the sequences it registers, frees and computes,
and what is left of its token budget and of the worker's blocks.

Invariants while a step is built:
- token_budget == the step's max_batch_tokens minus, over its work, the tokens
  to compute plus the draft tokens granted (drafts are verified in the same
  forward, so they cost budget like computed tokens);
- available_blocks == the pool estimate the step started from, plus the blocks
  of sequences freed in it, minus the blocks its work takes;
- drop() undoes add() exactly, so a sequence preempted while the step is
  built gives back everything it was planned to take.
"""

from __future__ import annotations

from typing import NamedTuple

from common.step import NewSequence, StepBatch, WorkItem


class _Planned(NamedTuple):
    num_tokens: int     # tokens to compute this step
    blocks: int         # pool blocks they take beyond what the sequence holds
    is_decode: bool
    drafts: int         # speculative tokens the decode may verify
    decode_steps: int   # times the decode may run in the step (allowances/decode_steps.py)
    max_outputs: int = 0    # the tokens those runs may bring in all (0: no cap but theirs)


class StepBuilder:
    def __init__(self, step_id: int, available_blocks: int, token_budget: int,
                 frees: list[str]) -> None:
        self.step_id = step_id
        self.available_blocks = available_blocks
        self.token_budget = token_budget
        self.frees = frees
        self.new_sequences: list[NewSequence] = []
        self._work: dict[str, _Planned] = {}
        self.runs_ms = 0.0      # quick runs' time bound for the worker (StepBatch.runs_ms); 0: none

    def add(self, seq_id: str, num_tokens: int, blocks: int, is_decode: bool, drafts: int = 0,
            decode_steps: int = 1) -> None:
        self._work[seq_id] = _Planned(num_tokens, blocks, is_decode, drafts, decode_steps)
        self.token_budget -= num_tokens + drafts
        self.available_blocks -= blocks

    def drop(self, seq_id: str) -> None:
        planned = self._work.pop(seq_id, _Planned(0, 0, False, 0, 1))
        self.token_budget += planned.num_tokens + planned.drafts
        self.available_blocks += planned.blocks

    def free(self, seq_id: str, blocks_held: int) -> None:
        """Frees a sequence in this step: its planned work is dropped and the
        blocks it held count as available to the rest of the step."""
        self.drop(seq_id)
        self.frees.append(seq_id)
        self.available_blocks += blocks_held

    def grant_runs(self, seq_id: str, runs: int, more_blocks: int, max_outputs: int = 0) -> None:
        """Lets the planned work of `seq_id` (a decode, or a chunk that ends its prompt) decode
        `runs` times in the step, taking `more_blocks` beyond what it was planned with, and
        bringing at most `max_outputs` tokens in all (0: no cap but the runs')."""
        planned = self._work[seq_id]
        self._work[seq_id] = planned._replace(blocks=planned.blocks + more_blocks, decode_steps=runs,
                                              max_outputs=max_outputs)
        self.available_blocks -= more_blocks

    def planned(self, seq_id: str) -> tuple[int, int, bool, int] | None:
        """(num_tokens, blocks, is_decode, drafts) of the planned work of `seq_id`, if any."""
        planned = self._work.get(seq_id)
        return None if planned is None else (planned.num_tokens, planned.blocks, planned.is_decode, planned.drafts)

    def planned_blocks(self, seq_id: str) -> int:
        """Blocks this step's work for `seq_id` takes (0 when it has none)."""
        planned = self._work.get(seq_id)
        return planned.blocks if planned is not None else 0

    @property
    def has_work(self) -> bool:
        return bool(self._work)

    @property
    def has_prefill(self) -> bool:
        return any(not planned.is_decode for planned in self._work.values())

    @property
    def has_decode(self) -> bool:
        return any(planned.is_decode for planned in self._work.values())

    def build(self, after_step_id: int = 0, epoch: int = 0) -> StepBatch | None:
        """The step to send (in the worker's registration `epoch`), or None when it would do nothing."""
        if not (self._work or self.frees or self.new_sequences):
            return None
        work = tuple(WorkItem(seq_id, planned.num_tokens, planned.drafts, planned.decode_steps, planned.max_outputs)
                     for seq_id, planned in self._work.items())
        return StepBatch(step_id=self.step_id, new_sequences=tuple(self.new_sequences), work=work,
                        free_seq_ids=tuple(self.frees), after_step_id=after_step_id, epoch=epoch,
                        runs_ms=self.runs_ms)
