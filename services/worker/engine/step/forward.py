"""One packed forward of a step: the base model's last hidden states of the rows that
sample, from a replayed decode graph (CUDA, decode-only steps), else from the direct
forward (CPU) or transformers' forward, with every attention layer reading and writing
the paged KV cache through the step's metadata (step_inputs.py). The graphs, the direct
forward and the attention kernels are what the engine's accelerators plug in (accelerators.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.worker.engine.accelerators import DecodeReplays, DecodeRows, GroupRows
from services.worker.engine.step.attention import DecodeKernel, StepMetadata
from services.worker.engine.kv.block_pool import BlockPool
from services.worker.engine.kv.kv_cache import PagedKVCache
from services.worker.engine.lora.layers import LoraRows
from services.worker.engine.model import PreparedModel
from services.worker.engine.step.planning import Planned
from services.worker.engine.kv.sliding_blocks import SlidingBlocks
from services.worker.engine.step.step_inputs import (ScoreRun, build_step_inputs, decode_order, reports_attention,
                                               sliding_table, slot)
from services.worker.engine.step.varlen import VarlenKernel

ScoreRows = Callable[[ScoreRun, torch.Tensor], None]


class Forward:
    def __init__(self, prepared: PreparedModel, kv: PagedKVCache, cache_layer: list[int], pool: BlockPool,
                 varlen: VarlenKernel | None, decode_kernel: DecodeKernel | None,
                 sliding: SlidingBlocks | None = None) -> None:
        self.base = prepared.base
        self.direct = prepared.speedups.direct
        self.mask_by_type = prepared.mask_by_type
        self.device = prepared.device
        self.kv = kv
        self.cache_layer = cache_layer
        self.pool = pool
        self.varlen = varlen
        self.decode_kernel = decode_kernel
        self.sliding = sliding
        self.graphs: DecodeReplays | None = None   # set once captured graphs can call hidden_states
        self.lora = prepared.lora_step

    def _lora_rows(self, order: list[Planned]) -> LoraRows | None:
        """The step's rows grouped by adapter (rows come in plan order, `rows` each). A sequence
        whose adapter could not be loaded raises: the step's isolation fails it alone."""
        runs, row = [], 0
        for plan in order:
            seq = plan.seq
            if seq.lora_name and seq.adapter is None:
                raise RuntimeError(f"LoRA adapter {seq.lora_name!r} not served: {seq.adapter_error}")
            runs.append((seq.adapter, row, plan.rows))
            row += plan.rows
        return LoraRows.of(runs, self.device)

    def sampling_hidden_states(self, planned: list[Planned], score: ScoreRows | None = None
                               ) -> tuple[list[Planned], torch.Tensor]:
        """One packed forward over `planned`; the final hidden states of the rows that sample,
        with the plan of each row. The hidden states of the rows that predict a prompt token
        of a prompt-logprobs plan go to `score`, run by run."""
        # Decodes first (one row each), then decodes with drafts, then prefill chunks (step_inputs.py).
        order = sorted(planned, key=decode_order)
        rows = self._decode_with_graphs(order)
        if rows is not None:
            return order, rows
        inputs = build_step_inputs(order, self.pool, self.kv, self.cache_layer, self.device,
                                   varlen=self.varlen, decode_kernel=self.decode_kernel, sliding=self.sliding)
        # Only the rows that sample are read past the last layer, unless a prompt's logprobs
        # read every row: the direct forward finishes that layer for them alone.
        keep = (torch.tensor(inputs.sample_rows, dtype=torch.long, device=self.device)
                if self.direct is not None and self.lora is None and not inputs.score_runs
                and len(inputs.sample_rows) < len(inputs.input_ids) else None)
        if self.lora is not None:
            with self.lora.serving(self._lora_rows(order)):
                hidden = self.hidden_states(inputs.input_ids, inputs.positions, inputs.meta)
        else:
            hidden = self.hidden_states(inputs.input_ids, inputs.positions, inputs.meta, keep)
        for meta in (inputs.meta, inputs.meta.sliding):
            if meta is not None and meta.scores is not None:
                meta.scores.commit()     # each group's layers add to the same block scores
        if score is not None:
            for run in inputs.score_runs:
                score(run, hidden[run.first_row:run.first_row + run.count])
        if not inputs.sample_plans:
            return [], hidden[:0]
        if keep is not None:
            return inputs.sample_plans, hidden
        return inputs.sample_plans, hidden[torch.tensor(inputs.sample_rows, device=self.device)]

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMetadata,
                      keep: torch.Tensor | None = None) -> torch.Tensor:
        """The base model's last hidden states of the packed rows, [T, hidden]; with `keep`
        (row indices; the direct forward only), of those rows alone, in that order."""
        if self.direct is not None:
            return self.direct(input_ids, positions, meta, keep)
        return self.base(input_ids=input_ids[None], position_ids=positions[None],
                         attention_mask=self.mask_by_type, use_cache=False,
                         paged_metadata=meta).last_hidden_state[0]

    def _decode_with_graphs(self, order: list[Planned]) -> torch.Tensor | None:
        """Hidden states of a decode-only step from a captured graph, or None (no graphs,
        not decode-only, no bucket fits, or graphs turned off)."""
        if self.graphs is None or not all(p.rows == 1 and p.samples for p in order):
            return None
        if any(p.seq.lora_name for p in order):
            return None     # graphs hold the base projections only: adapter rows run eagerly
        if any(reports_attention(p) for p in order):
            return None     # h2o reports its attention (h2o_scores.py): no graph replay
        tables = [self.pool.table(p.seq.seq_id) for p in order]
        block_size = self.pool.block_size
        sliding = None
        if self.sliding is not None:
            sliding_tables = [sliding_table(self.sliding, p, table) for p, table in zip(order, tables)]
            sliding = GroupRows(slots=[slot(table, p.start - p.seq.evicted, block_size)
                                       for p, table in zip(order, sliding_tables)], block_tables=sliding_tables)
        return self.graphs.run(DecodeRows(
            token_ids=[p.seq.tokens[p.start] for p in order],
            positions=[p.start - p.seq.evicted for p in order],
            slots=[slot(table, p.start - p.seq.evicted, block_size) for p, table in zip(order, tables)],
            ctx_lens=[p.end - p.seq.evicted for p in order],
            block_tables=tables, sliding=sliding))
