"""The packed inputs of one forward: token ids, positions, the KV slot of every row
(the slot mapping), the decodes' block tables and context lengths, each prefill
chunk's context slots, and which rows are sampled.

Rows come in plan order: a plan's chunk tokens, then its drafts. Single-row plans
before the first multi-row one are decodes (attended through padded block tables);
every later plan is a prefill chunk (a contiguous run of rows over its context).
Where the native decode attention serves the step, a decode that verifies drafts
(`verifies_as_decodes`) is decode rows too, one per row, each attending through the
sequence's table up to its own position, so such steps keep the decode kernels (and
the C decode layers) instead of a gathered attention call per sequence.
A chunk of a sequence that asked for prompt logprobs also names its rows that
predict a prompt token (score runs).
Under the hybrid layout (sliding_blocks.py) the slots, tables and context slots are
built twice, in the pool's blocks and in the sliding group's, as two metadata.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from services.worker.engine.step.attention import DecodeKernel, PrefillChunk, StepMetadata
from services.worker.engine.kv.block_pool import BlockPool
from services.worker.engine.kv.h2o_scores import AttentionScores
from services.worker.engine.kv.kv_cache import PagedKVCache
from services.worker.engine.step.planning import Planned
from services.worker.engine.kv.sliding_blocks import SlidingBlocks
from services.worker.engine.step.varlen import VarlenKernel


@dataclass
class StepInputs:
    meta: StepMetadata
    input_ids: torch.Tensor        # [T]
    positions: torch.Tensor        # [T]
    sample_rows: list[int]         # rows whose hidden states are sampled, in order
    sample_plans: list[Planned]    # the plan of each sampled row (one per row; a plan with drafts repeats)
    score_runs: list[ScoreRun] = field(default_factory=list)


@dataclass(frozen=True)
class ScoreRun:
    """Rows first_row .. first_row + count - 1 of a prompt-logprobs plan: each predicts the
    prompt token after its own, the first one the token at `first_target`."""
    plan: Planned
    first_row: int
    count: int
    first_target: int


@dataclass
class _GroupRows:
    """One cache group's part of the inputs: where each row's K/V go and the context each
    attends through, in that group's blocks."""
    table_of: Callable[[Planned, list[int]], list[int]]   # (plan, pool table) -> the group's table
    block_size: int
    scores: AttentionScores
    slots: list[int] = field(default_factory=list)
    decode_tables: list[list[int]] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)


@dataclass
class _Rows:
    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    decode_ctx: list[int] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    sample_plans: list[Planned] = field(default_factory=list)
    score_runs: list[ScoreRun] = field(default_factory=list)


def slot(table: list[int], position: int, block_size: int) -> int:
    """The KV slot of `position` in a sequence with block table `table`."""
    return table[position // block_size] * block_size + position % block_size


def sliding_table(sliding: SlidingBlocks, plan: Planned, table: list[int]) -> list[int]:
    """`plan`'s sliding-group table: its window's entries from the chunk's first query on."""
    return sliding.table(table, sliding.first_in_window(plan.start - plan.seq.evicted))


def build_step_inputs(order: list[Planned], pool: BlockPool, kv: PagedKVCache, cache_layer: list[int],
                      device: torch.device, varlen: VarlenKernel | None = None,
                      decode_kernel: DecodeKernel | None = None,
                      sliding: SlidingBlocks | None = None) -> StepInputs:
    """The inputs of one forward over `order` (decodes first), with the pool's block tables
    (and the sliding group's, under the hybrid layout)."""
    size = pool.block_size
    groups = [_GroupRows(lambda plan, table: table, size, AttentionScores(size))]
    if sliding is not None:
        groups.append(_GroupRows(partial(sliding_table, sliding), size, AttentionScores(size)))
    if any(reports_attention(plan) for plan in order):
        decode_kernel = None    # the C decode layers take no step that must report its attention
    rows = _Rows()
    _pack_rows(order, rows, groups, pool, device, verify_rows=decode_kernel is not None)
    metas = [_metadata(group, rows, kv, cache_layer, device, varlen, decode_kernel) for group in groups]
    if sliding is not None:
        metas[0].sliding = metas[1]
        metas[1].sliding_window = sliding.window
    input_ids = torch.tensor(rows.ids, dtype=torch.long, device=device)
    position_tensor = torch.tensor(rows.positions, dtype=torch.long, device=device)
    return StepInputs(metas[0], input_ids, position_tensor, rows.sample_rows, rows.sample_plans, rows.score_runs)


def _metadata(group: _GroupRows, rows: _Rows, kv: PagedKVCache, cache_layer: list[int], device: torch.device,
              varlen: VarlenKernel | None, decode_kernel: DecodeKernel | None) -> StepMetadata:
    width = max((len(table) for table in group.decode_tables), default=0)
    padded = [table + [0] * (width - len(table)) for table in group.decode_tables]
    decode_ctx = rows.decode_ctx
    return StepMetadata(
        kv=kv, cache_layer=cache_layer, block_size=group.block_size,
        slot_mapping=torch.tensor(group.slots, dtype=torch.long, device=device),
        num_decodes=len(decode_ctx),
        decode_ctx_lens=torch.tensor(decode_ctx, dtype=torch.long, device=device),
        decode_block_tables=torch.tensor(padded, dtype=torch.long, device=device).reshape(len(padded), width),
        decode_ctx_range=(min(decode_ctx, default=0), max(decode_ctx, default=0)),
        prefills=group.prefills, num_tokens=len(rows.ids), varlen=varlen, decode_kernel=decode_kernel,
        scores=group.scores if group.scores else None)


def verifies_as_decodes(plan: Planned) -> bool:
    """A decode that verifies drafts: its rows are the last sampled token and the drafts."""
    return plan.num_tokens == 1 and bool(plan.drafts)


def decode_order(plan: Planned) -> int:
    """The sort key that puts a step's decodes first, then decodes with drafts, then chunks."""
    return 0 if plan.rows == 1 else 1 if verifies_as_decodes(plan) else 2


def reports_attention(plan: Planned) -> bool:
    """Whether the plan's sequence keeps h2o scores, which its step's attention must report."""
    return plan.seq.budget is not None and plan.seq.budget.kind == "h2o"


def _pack_rows(order: list[Planned], rows: _Rows, groups: list[_GroupRows], pool: BlockPool,
               device: torch.device, verify_rows: bool) -> None:
    for plan in order:
        table = pool.table(plan.seq.seq_id)
        row = len(rows.ids)
        rows.ids.extend(plan.seq.tokens[plan.start:plan.end])
        rows.ids.extend(plan.drafts)
        # Positions and slots count from the cache's start (a lossy KV policy's dropped tokens are not in it).
        start = plan.start - plan.seq.evicted
        end = start + plan.rows
        rows.positions.extend(range(start, end))
        decode = (plan.rows == 1 or (verify_rows and verifies_as_decodes(plan))) and not groups[0].prefills
        if decode:
            rows.decode_ctx.extend(range(start + 1, end + 1))
        last_row = len(rows.ids) - 1 - len(plan.drafts)
        for group in groups:
            _pack_group(group, plan, group.table_of(plan, table), row, start, end, decode, last_row, device)
        run = _score_run(plan, row)
        if run is not None:
            rows.score_runs.append(run)
        if plan.samples:
            # The last computed token's row, then one row per draft.
            rows.sample_rows.extend(range(last_row, len(rows.ids)))
            rows.sample_plans.extend([plan] * (1 + len(plan.drafts)))


def _pack_group(group: _GroupRows, plan: Planned, table: list[int], row: int, start: int, end: int,
                decode: bool, last_row: int, device: torch.device) -> None:
    size = group.block_size
    context_slots = None
    if decode:
        for position in range(start, end):
            group.slots.append(slot(table, position, size))
            group.decode_tables.append(table)
    else:
        host_slots = _context_slots(table, end, size)
        group.slots.extend(host_slots[start:].tolist())
        context_slots = host_slots.to(device)
        group.prefills.append(PrefillChunk(row, plan.rows, start, context_slots))
    if reports_attention(plan):
        if context_slots is None:
            context_slots = _context_slots(table, end, size).to(device)
        group.scores.track(plan.seq, last_row, context_slots)


def _context_slots(table: list[int], end: int, block_size: int) -> torch.Tensor:
    """The slots of positions 0 .. end - 1 through `table`."""
    table_tensor = torch.tensor(table[:-(-end // block_size)], dtype=torch.long)
    context = torch.arange(end)
    return table_tensor[context // block_size] * block_size + context % block_size


def _score_run(plan: Planned, first_row: int) -> ScoreRun | None:
    """The rows of `plan` (its chunk starting at `first_row`) that predict a prompt token,
    when its sequence asked for prompt logprobs."""
    if not plan.seq.request.params.prompt_logprobs:
        return None
    last_target = min(plan.end, len(plan.seq.request.prompt_token_ids) - 1)
    count = last_target - plan.start
    return ScoreRun(plan, first_row, count, plan.start + 1) if count > 0 else None
