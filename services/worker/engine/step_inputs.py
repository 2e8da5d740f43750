"""The packed inputs of one forward: token ids, positions, the KV slot of every row
(the slot mapping), the decodes' block tables and context lengths, each prefill
chunk's context slots, and which rows are sampled.

Rows come in plan order: a plan's chunk tokens, then its drafts. Single-row plans
before the first multi-row one are decodes (attended through padded block tables);
every later plan is a prefill chunk (a contiguous run of rows over its context).
A chunk of a sequence that asked for prompt logprobs also names its rows that
predict a prompt token (score runs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from services.worker.engine.attention import PrefillChunk, StepMetadata
from services.worker.engine.block_pool import BlockPool
from services.worker.engine.h2o_scores import AttentionScores
from services.worker.engine.kv_cache import PagedKVCache
from services.worker.engine.planning import Planned

if TYPE_CHECKING:
    from services.worker.engine.cpu.native_decode import NativeDecodeAttention
    from services.worker.engine.cuda.varlen_attention import VarlenKernel


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
class _Rows:
    ids: list[int]
    positions: list[int]
    slots: list[int]
    decode_ctx: list[int]
    decode_tables: list[list[int]]
    prefills: list[PrefillChunk]
    sample_rows: list[int]
    sample_plans: list[Planned]
    score_runs: list[ScoreRun] = field(default_factory=list)


def slot(table: list[int], position: int, block_size: int) -> int:
    """The KV slot of `position` in a sequence with block table `table`."""
    return table[position // block_size] * block_size + position % block_size


def build_step_inputs(order: list[Planned], pool: BlockPool, kv: PagedKVCache, cache_layer: list[int],
                      device: torch.device, varlen: VarlenKernel | None = None,
                      decode_kernel: NativeDecodeAttention | None = None) -> StepInputs:
    """The inputs of one forward over `order` (decodes first), with the pool's block tables."""
    scores = AttentionScores(pool.block_size)
    rows = _pack_rows(order, pool, device, scores)
    if scores:
        decode_kernel = None    # the C decode layers take no step that must report its attention
    width = max((len(table) for table in rows.decode_tables), default=0)
    padded = [table + [0] * (width - len(table)) for table in rows.decode_tables]
    decode_ctx = rows.decode_ctx
    meta = StepMetadata(
        kv=kv, cache_layer=cache_layer, block_size=pool.block_size,
        slot_mapping=torch.tensor(rows.slots, dtype=torch.long, device=device),
        num_decodes=len(decode_ctx),
        decode_ctx_lens=torch.tensor(decode_ctx, dtype=torch.long, device=device),
        decode_block_tables=torch.tensor(padded, dtype=torch.long, device=device).reshape(len(padded), width),
        decode_ctx_range=(min(decode_ctx, default=0), max(decode_ctx, default=0)),
        prefills=rows.prefills, num_tokens=len(rows.ids), varlen=varlen, decode_kernel=decode_kernel,
        scores=scores if scores else None)
    input_ids = torch.tensor(rows.ids, dtype=torch.long, device=device)
    position_tensor = torch.tensor(rows.positions, dtype=torch.long, device=device)
    return StepInputs(meta, input_ids, position_tensor, rows.sample_rows, rows.sample_plans, rows.score_runs)


def _pack_rows(order: list[Planned], pool: BlockPool, device: torch.device, scores: AttentionScores) -> _Rows:
    block_size = pool.block_size
    rows = _Rows([], [], [], [], [], [], [], [])
    for plan in order:
        table = pool.table(plan.seq.seq_id)
        row = len(rows.ids)
        rows.ids.extend(plan.seq.tokens[plan.start:plan.end])
        rows.ids.extend(plan.drafts)
        # Positions and slots count from the cache's start (a lossy KV policy's dropped tokens are not in it).
        start = plan.start - plan.seq.evicted
        end = start + plan.rows
        rows.positions.extend(range(start, end))
        if plan.rows == 1 and not rows.prefills:
            rows.slots.append(slot(table, start, block_size))
            rows.decode_ctx.append(end)
            rows.decode_tables.append(table)
        else:
            table_tensor = torch.tensor(table[:pool.blocks_for(end)], dtype=torch.long)
            context = torch.arange(end)
            context_slots = table_tensor[context // block_size] * block_size + context % block_size
            rows.slots.extend(context_slots[start:].tolist())
            rows.prefills.append(PrefillChunk(row, plan.rows, start, context_slots.to(device)))
        if plan.seq.budget is not None and plan.seq.budget.kind == "h2o":
            context = torch.arange(end)
            table_tensor = torch.tensor(table[:pool.blocks_for(end)], dtype=torch.long)
            last_row = len(rows.ids) - 1 - len(plan.drafts)
            scores.track(plan.seq, last_row, (table_tensor[context // block_size] * block_size
                                              + context % block_size).to(device))
        run = _score_run(plan, row)
        if run is not None:
            rows.score_runs.append(run)
        if plan.samples:
            # The last computed token's row, then one row per draft.
            rows.sample_rows.extend(range(len(rows.ids) - 1 - len(plan.drafts), len(rows.ids)))
            rows.sample_plans.extend([plan] * (1 + len(plan.drafts)))
    return rows


def _score_run(plan: Planned, first_row: int) -> ScoreRun | None:
    """The rows of `plan` (its chunk starting at `first_row`) that predict a prompt token,
    when its sequence asked for prompt logprobs."""
    if not plan.seq.request.params.prompt_logprobs:
        return None
    last_target = min(plan.end, len(plan.seq.request.prompt_token_ids) - 1)
    count = last_target - plan.start
    return ScoreRun(plan, first_row, count, plan.start + 1) if count > 0 else None
