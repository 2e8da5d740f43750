"""Multi-step decoding's allowance: how many times a decode may run in one step (the worker
runs them back to back: services/worker/decode_steps.py) and the blocks their slots take.

A decode of `drafts` drafts brings up to 1 + drafts tokens a run, so R runs bring up to
R * (1 + drafts) and need slots up to position num_computed + R * (1 + drafts):

    held blocks              | blocks the runs may add
    [ . . . . | . . . c r | r r r r | r r r . ]     c: computed  r: a run's slots

Each run brings at least one token, so R is at most the tokens left to max_tokens; where R runs
keeping every draft would bring more, the work item carries the tokens left as its cap
(WorkItem.max_outputs) and the worker ends the runs there and trims the last run's drafts to it,
so a request never passes max_tokens and its last steps are not cut to one run by drafts it
may never keep:

    8 tokens left, 2 drafts a run:   runs 4 (not 8 // 3 = 2), cap 8
    worker:  run 1 keeps 3 -> 3    run 2 keeps 1 -> 4    run 3 keeps 3 -> 7    run 4: 0 drafts -> 8

R never needs more blocks than the step has to spare (its slots counted as if every draft
were kept), and is 1 (one run, as without multi-step) while a request
waits on the worker that a step could take now (prefilling, or queued with a batch slot for it):
its prefill should not wait out the runs. Requests queued behind a full batch do not stop the
runs (they would wait for a slot either way); the runs then end when the running requests that
reach their max_tokens free slots for the queue, or an eighth of the batch
(`runs_until_slots_free`):

    running   a: 5 outputs left   b: 12 left   c: 9 left      pending: d (no slot)
    runs      a a a a a            b b b b b    c c c c c      -> 5 runs, then d is admitted

One request a token from its end does not cut a batch of 64 to one run: until an eighth of the
slots free, the few that freed idle for the rest of the runs (at most an eighth of the batch).

Quick runs take more of them (`quick_runs`, DECODE_STEP_MS): where the worker's last decode-only
step ran its decodes quickly (a few streams), a step may take as many runs as fit in a time
budget, so the round trip's cost, which the other services' work on the worker's cores makes
larger than its own CPU time, is paid once per that many runs; a run's time is scaled up with
the batch's decodes, so a batch that grew takes fewer:

    last decode-only step: 4 runs of 1 decode, 44 ms -> 11 ms a run
    budget 160 ms:   1 decode -> 14 runs    2 decodes -> 7 runs    8 decodes -> decode_steps
"""

from __future__ import annotations

from typing import NamedTuple

from common.step import MAX_DECODE_STEPS

from services.scheduler.core.state import blocks_for


def multi_stepping(decode_steps: int, waiting: bool) -> bool:
    """Whether decodes on a worker may run several times a step: multi-step decoding is on
    (decode_steps > 1) and no request waits there."""
    return decode_steps > 1 and not waiting


def quick_runs(step_ms: float, run_ms: float, run_decodes: int, decodes: int) -> int:
    """The runs of `decodes` decodes that fit in `step_ms` when a run of `run_decodes` took
    `run_ms`, the time scaled up in proportion to the decodes (a run's cost grows more slowly
    than that: the estimate errs towards fewer runs); at most MAX_DECODE_STEPS, 0 when either
    side is unknown or off (a step_ms of 0)."""
    if step_ms <= 0 or run_ms <= 0 or run_decodes <= 0 or decodes <= 0:
        return 0
    estimate = run_ms * max(1.0, decodes / run_decodes)
    return min(MAX_DECODE_STEPS, int(step_ms // estimate))


def runs_until_slots_free(outputs_left: list[int], waiting: int) -> int:
    """The most runs a step may take while `waiting` requests wait for batch slots: those after
    which as many running requests have reached their max_tokens, or an eighth of them (at
    least one; at least one run). A request that ends earlier (EOS, a stop string) frees its
    slot when the step's reply comes, as without runs.

    outputs_left: each running decode's max_tokens minus its outputs once the steps in flight
        have run.
    """
    if not outputs_left:
        return 1
    slots = max(1, min(waiting, len(outputs_left) // 8))     # never more than len(outputs_left)
    return max(1, sorted(outputs_left)[slots - 1])


class RunsAllowance(NamedTuple):
    runs: int           # at least one
    blocks: int         # beyond the blocks the sequence holds
    max_outputs: int    # the tokens the runs may bring in all (WorkItem.max_outputs); 0: no cap needed


def runs_allowance(*, decode_steps: int, drafts: int, outputs_left: int, num_computed: int,
                   held_blocks: int, spare_blocks: int, block_size: int) -> RunsAllowance:
    """The runs of one decode, the blocks their slots take and the cap on their tokens.

    decode_steps: the most runs (CoreConfig.decode_steps).
    drafts: the decode's draft tokens a run.
    outputs_left: max_tokens minus the outputs the request has if everything in flight is kept.
    num_computed: tokens the sequence holds before the decode.
    held_blocks: blocks the sequence holds once one run (its token and drafts) has its slots.
    spare_blocks: the step's available blocks left after that.
    """
    per_run = 1 + drafts
    capacity = (held_blocks + max(spare_blocks, 0)) * block_size - num_computed
    runs = max(1, min(decode_steps, outputs_left, capacity // per_run))
    blocks = max(blocks_for(num_computed + runs * per_run, block_size) - held_blocks, 0)
    return RunsAllowance(runs, blocks, outputs_left if runs * per_run > outputs_left else 0)
