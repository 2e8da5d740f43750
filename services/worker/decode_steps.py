"""Multi-step decoding: a decode whose work item asks for `decode_steps` N > 1 runs up to N
times within one scheduler step, so the scheduler's round trip (its planning, the reply's
conversion and transport, the streams' messages) is paid once per N tokens of every
sequence instead of once per token.

    scheduler step k:  [ decode 1 | decode 2 | ... | decode N ]  -> one reply, N tokens a sequence
                         (each decode may verify its drafts, so a sequence brings up to
                          N * (1 + draft_tokens) tokens)

After the step's own run, each further run decodes, one token each (plus drafts), the
sequences that sampled in the run before, did not fail, have runs left and did not sample
an end-of-sequence token; it stops early when `interrupted()` says a step that waits
behind this one brings new sequences (an arrival's prefill should not wait out N decodes).
A step with a time bound (`runs_ms`, the scheduler's quick runs) starts no further run once
the runs' forward time so far, plus their mean for the next, would pass it: the scheduler
plans quick runs from an earlier step's speed, and a load that arrives meanwhile (another
process on the cores) then costs a run past the bound, not several bounds.
A later run's failure for a sequence (its pool ran out of blocks, say) ends its runs and
keeps what the earlier ones sampled: each run commits on its own, and the scheduler takes
fewer tokens than granted as it takes rejected drafts. Pure: `step` is the engine's.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import replace

from common.step import MAX_DECODE_STEPS, SeqResult, StepBatch, StepOutput, WorkItem
from common.types import TokenLogprob


def run_decode_steps(batch: StepBatch, step: Callable[[StepBatch], StepOutput],
                     stop_token_ids: Collection[int],
                     interrupted: Callable[[], bool] = lambda: False) -> StepOutput:
    """Runs `batch` with `step`, then the further decodes its work items ask for.

    Args:
        batch: the scheduler's step.
        step: runs one batch on the engine (its frees and new sequences included).
        stop_token_ids: tokens after which a sequence decodes no further in this step
            (the model's EOS tokens; the scheduler decides what ends a request).
        interrupted: polled between runs; True ends the step's decoding there.
        The step's `runs_ms`, where set, also ends it there (`past_bound`).

    Returns:
        The step's output with each sequence's tokens of every run in its one result, the
        runs' counters summed and the count of runs that ran (`runs`).
    """
    output = replace(step(batch), runs=1)
    runs = min(max((item.decode_steps for item in batch.work), default=1), MAX_DECODE_STEPS)
    if runs <= 1:
        return output
    items = {item.seq_id: item for item in batch.work if item.decode_steps > 1}
    results = {result.seq_id: result for result in output.results}
    latest = dict(results)
    for run in range(1, runs):
        work = next_work(items, latest, results, run, stop_token_ids)
        if not work or interrupted() or past_bound(batch.runs_ms, output.forward_ms, run):
            break
        more = step(StepBatch(step_id=batch.step_id, work=work, epoch=batch.epoch))
        latest = {result.seq_id: result for result in more.results}
        for result in more.results:
            results[result.seq_id] = extend(results[result.seq_id], result)
        output = add_counters(output, more)
    return replace(output, results=tuple(results[result.seq_id] for result in output.results))


def past_bound(runs_ms: float, forward_ms: float, runs_done: int) -> bool:
    """Whether one more run would end past `runs_ms` (0: no bound), the next run taking the
    mean of the `runs_done` runs' `forward_ms`."""
    return runs_ms > 0 and forward_ms + forward_ms / runs_done > runs_ms


def next_work(items: dict[str, WorkItem], latest: dict[str, SeqResult], so_far: dict[str, SeqResult], run: int,
              stop_token_ids: Collection[int]) -> tuple[WorkItem, ...]:
    """The decodes of run `run` (0 is the step's own): one per sequence that asked for more
    runs and sampled, without an error or a stop token, in the run before (`latest`), and whose
    result over the runs so far (`so_far`) holds fewer than its `max_outputs` tokens, verifying
    no more drafts than would pass that cap."""
    work = []
    for seq_id, item in items.items():
        result = latest.get(seq_id)
        if not (item.decode_steps > run and result is not None and result.sampled and not result.error
                and result.token_ids[-1] not in stop_token_ids):
            continue
        drafts = item.draft_tokens
        if item.max_outputs > 0:
            left = item.max_outputs - len(so_far[seq_id].token_ids)
            if left < 1:
                continue
            drafts = min(drafts, left - 1)
        work.append(WorkItem(seq_id, 1, drafts))
    return tuple(work)


def extend(result: SeqResult, more: SeqResult) -> SeqResult:
    """`result` followed by a later run's tokens for the same sequence; a run that failed or
    sampled nothing adds nothing (it changed nothing on the worker)."""
    if more.error or not more.sampled:
        return result
    logprobs = _logprobs(result) + _logprobs(more)
    tokens = result.token_ids + more.token_ids
    return replace(result, more_token_ids=tokens[1:],
                   more_logprobs=logprobs[1:] if any(lp is not None for lp in logprobs) else (),
                   num_computed_tokens=more.num_computed_tokens)


def _logprobs(result: SeqResult) -> tuple[TokenLogprob | None, ...]:
    """One logprob (or None) per token of the result."""
    given = (result.logprob, *result.more_logprobs)
    return (given + (None,) * len(result.token_ids))[:len(result.token_ids)]


def add_counters(output: StepOutput, more: StepOutput) -> StepOutput:
    """`output` with a later run's counters added, that run counted, and its pool figures."""
    return replace(output, pool=more.pool, forward_ms=output.forward_ms + more.forward_ms, runs=output.runs + 1,
                   batch_tokens=output.batch_tokens + more.batch_tokens,
                   prompt_tokens=output.prompt_tokens + more.prompt_tokens,
                   prompt_logits_hits=output.prompt_logits_hits + more.prompt_logits_hits,
                   graph_replayed=output.graph_replayed or more.graph_replayed,
                   draft_tokens=output.draft_tokens + more.draft_tokens,
                   accepted_tokens=output.accepted_tokens + more.accepted_tokens,
                   screened_rows=output.screened_rows + more.screened_rows,
                   full_rows=output.full_rows + more.full_rows)
