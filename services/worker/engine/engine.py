"""Engine: one packed forward per step over prefill chunks and decodes.

Step semantics (see proto/fairserve/v1/worker.proto): frees first, then new
sequences are registered, then each work item computes up to num_tokens of its
sequence's not-yet-computed tokens; when that reaches the end of the known
tokens, one token is sampled and appended. A work item whose blocks cannot be
allocated fails with "out_of_blocks" and changes nothing.

`Engine` puts the parts together: the prepared model (model.py), the KV pool
(block_pool.py, sized by sizing.py), the sequences (sequences.py), step
planning (planning.py), the forward (forward.py) and sampling (sampling.py).
The device's speed-ups (kernels, the LM head screen, decode graphs) are what the
`Accelerators` it is built with plug in (accelerators.py); without, none.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from services.worker.engine import types as t
from common.step import PoolStats, SeqResult, StepBatch, StepOutput, WorkItem
from services.worker.engine.accelerators import Accelerators, DecodeReplays, GraphCapture, LinearKernelPlan
from services.worker.engine.kv.block_pool import BlockPool
from services.worker.engine.config import EngineConfig, require_choice
from services.worker.engine.device import dtype_name
from services.worker.engine.kv.eviction import EVICTION_POLICIES
from services.worker.engine.step.forward import Forward
from services.worker.engine.sampling.grammar import (GRAMMAR_TOKENIZER_MODES, Grammars, GrammarTokenizer,
                                            tokenizer_from_model_dir)
from services.worker.engine.sampling.grammar_masks import GrammarMasker
from services.worker.engine.step.isolation import StepIsolation
from services.worker.engine.kv.kv_cache import PagedKVCache
from services.worker.engine.kv.kv_policy import KvEvictor
from services.worker.engine.kv.kv_rotation import KeyRotation
from services.worker.engine.lora.registry import LoraRegistry
from services.worker.engine.model import prepare_model
from services.worker.engine.step.planning import Planned, PlanLimits, StepPlanner
from services.worker.engine.sampling.prompt_logits import PromptLogitsCache
from services.worker.engine.sampling.prompt_logprobs import PromptScorer
from services.worker.engine.sampling.sampler import SampledToken, Sampler
from services.worker.engine.sampling.sampling import LogitsRows, StepSampler
from services.worker.engine.step.sequences import Sequences
from services.worker.engine.step.wide_release import WideRelease
from services.worker.engine.kv.sizing import kv_layout, layer_kv_layout, max_model_len
from services.worker.engine.kv.sliding_blocks import SlidingBlocks

log = logging.getLogger(__name__)


@dataclass
class _StepTotals:
    """What a step's computed parts add up to (more than one when a failure was isolated)."""
    planned: list[Planned] = field(default_factory=list)
    forward_ms: float = 0.0
    accepted: int = 0
    logits_rows: LogitsRows = field(default_factory=LogitsRows)


class Engine:
    # A step's work items that ask for several decode runs (WorkItem.decode_steps) are run by
    # the worker's loop (services/worker/decode_steps.py), one step() a run.
    runs_decode_steps = False

    def __init__(self, config: EngineConfig, model: torch.nn.Module | None = None,
                 graph_capture: GraphCapture | None = None, accelerators: Accelerators | None = None) -> None:
        """An engine over `model` (else config.model_dir's checkpoint) with the speed-ups that
        `accelerators` plug in (none by default; the worker's are services/worker/wiring.py's).
        `graph_capture`: capture decode graphs with it (needs accelerators.decode_graphs)."""
        self.config = config
        self.accelerators = accelerators = accelerators if accelerators is not None else Accelerators()
        require_choice("eviction policy", config.eviction_policy, EVICTION_POLICIES)
        self.prepared = prepared = prepare_model(config, model, accelerators)
        self.model, self.model_config = prepared.model, prepared.model_config
        self.device, self.dtype = prepared.device, prepared.dtype
        self.block_size = config.block_size
        self.wide_release = WideRelease(config.host_memory_release_rows if self.device.type == "cpu" else 0)
        varlen = accelerators.prefill_kernel(config.attention_backend, self.device, self.dtype,
                                             prepared.kernel_cache_dir)
        decode_kernel = accelerators.decode_kernel(config.decode_attention, self.device, self.dtype,
                                                   self.block_size, prepared.kernel_cache_dir)
        specs, cache_layer = layer_kv_layout(prepared.base)
        self.kv_layout = layout = kv_layout(prepared.base, specs, config, self.device, self.dtype)
        num_blocks = layout.num_blocks
        self.max_model_len = max_model_len(config, self.model_config, self.device)
        graph_capture = self._graph_capture(graph_capture)
        # Graphs' padding rows write into one scratch block past the pool's blocks.
        scratch_blocks = 1 if graph_capture is not None else 0
        self.kv = PagedKVCache(specs, num_blocks + scratch_blocks, self.block_size, self.dtype, self.device,
                               layout.sliding, layout.sliding_blocks + scratch_blocks)
        self.pool = BlockPool(num_blocks, self.block_size, config.enable_prefix_caching, config.eviction_policy)
        self.sliding = (SlidingBlocks(layout.sliding_blocks, self.block_size, layout.window)
                        if layout.window is not None else None)
        self.pool.listener = self.sliding
        self.forward = Forward(prepared, self.kv, cache_layer, self.pool, varlen, decode_kernel, self.sliding)
        if graph_capture is not None:
            self.forward.graphs = self._decode_graphs(graph_capture, cache_layer, num_blocks)
        self.prompt_logits = PromptLogitsCache(config.prompt_logits_cache_size
                                               if config.enable_prefix_caching else 0)
        self.sampling = StepSampler(prepared, Sampler(eos_token_ids=prepared.eos_token_ids), self.prompt_logits,
                                    self.block_size)
        self.prompt_scorer = PromptScorer(prepared.lm_head, prepared.softcap)
        self.loras = (LoraRegistry(config.lora, prepared.lora_shapes or {}, self.device, self.dtype)
                      if prepared.lora_step is not None else None)
        if self.loras is not None:
            self.loras.preload()
        self.sequences = Sequences(self.pool, self.block_size, config.model_key, self.loras)
        vocab_size = int(self.model_config.vocab_size)
        # Structured output: the grammar tokenizer builds in the background (seconds on 262k tokens,
        # ~185 MB resident), at start or when the first constrained sequence registers
        # (GRAMMAR_TOKENIZER). Its build's temporaries (~0.3 GB on 262k tokens) are handed back
        # once it is built.
        require_choice("GRAMMAR_TOKENIZER", config.grammar_tokenizer, GRAMMAR_TOKENIZER_MODES)
        self.grammars = Grammars(GrammarTokenizer(
            tokenizer_from_model_dir(config.model_dir, vocab_size, prepared.eos_token_ids),
            background=config.grammar_tokenizer == "start" and (Path(config.model_dir) / "tokenizer.json").is_file(),
            on_built=self.release_host_memory if self.device.type == "cpu" else None),
            vocab_size, prepared.eos_token_ids)
        self.grammar_masks = GrammarMasker()
        self.epoch = 0    # the scheduler registration served (adopt_epoch)
        self.isolation = StepIsolation(self.sequences, self.pool)
        self.evictor = KvEvictor(self.pool, KeyRotation.of(prepared.base, self.kv, self.sliding), self.block_size)
        self.planner = StepPlanner(self.sequences, self.pool, self.kv, self.prompt_logits, PlanLimits(
            self.block_size, self.max_model_len, config.ngram_min, config.ngram_max), self.evictor, self.sliding)
        self._info = t.EngineInfo(
            model_name=config.model_key or getattr(self.model_config, "name_or_path", "") or Path(config.model_dir).name,
            block_size=self.block_size, num_blocks=num_blocks, device=str(self.device),
            dtype=dtype_name(self.dtype), max_model_len=self.max_model_len,
            eos_token_ids=prepared.eos_token_ids, vocab_size=int(self.model_config.vocab_size))

    def _graph_capture(self, given: GraphCapture | None) -> GraphCapture | None:
        """What captures decode graphs: `given`, else under USE_CUDA_GRAPHS on CUDA the
        accelerators' capture; None: no graphs."""
        accelerators = self.accelerators
        if (given is None and self.config.use_cuda_graphs and self.device.type == "cuda"
                and accelerators.graph_capture is not None):
            given = accelerators.graph_capture()
        if given is not None and accelerators.decode_graphs is None:
            raise ValueError("decode graphs need a decode graphs factory in the engine's accelerators")
        return given

    def _decode_graphs(self, capture: GraphCapture, cache_layer: list[int], num_blocks: int) -> DecodeReplays:
        assert self.accelerators.decode_graphs is not None
        return self.accelerators.decode_graphs(
            self.forward.hidden_states, self.kv, cache_layer, capture, block_size=self.block_size,
            scratch_block=num_blocks, max_batch=self.config.cuda_graph_max_batch,
            max_context=min(self.max_model_len, self.config.cuda_graph_max_context),
            device=self.device, sliding_scratch_block=self.kv_layout.sliding_blocks if self.sliding is not None else None,
            sliding_window=self.kv_layout.window or 0)

    # ---- public API ----------------------------------------------------------------------

    @property
    def info(self) -> t.EngineInfo:
        return self._info

    def step(self, batch: StepBatch) -> StepOutput:
        """Runs one scheduler step: adopts its epoch, frees and registers sequences, then
        plans, computes (one packed forward), samples and commits every work item.

        Args:
            batch: the scheduler's step (common/step.py): its registration epoch, the
                sequences to free, the new sequences, and one work item per sequence
                (a prefill chunk, or a decode with its drafts).

        Returns:
            A result per work item (tokens, logprobs, or the sequence's own error: a
            sequence that fails fails alone), the pool's stats after the step, and the
            step's counters (forward time, rows, cached-logits hits, drafts accepted).

        Raises:
            StaleEpoch: the step belongs to an older scheduler registration.
        """
        self.adopt_epoch(batch.epoch)
        for seq_id in batch.free_seq_ids:
            self.sequences.free(seq_id)
        for new in batch.new_sequences:
            self.sequences.register(new)
            if new.sampling.constraint is not None:
                self.grammars.tokenizer.start()     # needed by its first sampled token
                # A resumed sequence's matcher replays the tokens it already generated.
                self.sequences.get(new.seq_id).grammar = self.grammars.state(new.sampling.constraint,
                                                                             new.output_token_ids)
        replays = self.graphs.replays if self.graphs is not None else 0
        totals = _StepTotals()
        # A sequence whose planning or forward raises fails alone (isolation.py).
        results = self.isolation.run(list(batch.work), lambda work: self._compute(work, totals))
        planned, logits_rows = totals.planned, totals.logits_rows
        rows = sum(p.rows for p in planned)
        if self.wide_release.after_step(rows, decodes=any(p.prompt_tokens < p.rows for p in planned)):
            # A burst of wide steps' buffers would otherwise stay resident, and later wide
            # steps' land elsewhere in the heap (HOST_MEMORY_RELEASE_ROWS; step/wide_release.py).
            self.accelerators.release_freed_host_memory()
        return StepOutput(results=tuple(results), pool=self.pool_stats(), forward_ms=totals.forward_ms,
                            batch_tokens=rows,
                            prompt_tokens=sum(p.prompt_tokens for p in planned),
                            prompt_logits_hits=sum(1 for p in planned if p.kept is not None),
                            graph_replayed=self.graphs is not None and self.graphs.replays > replays,
                            draft_tokens=sum(len(p.drafts) for p in planned), accepted_tokens=totals.accepted,
                            screened_rows=logits_rows.screened, full_rows=logits_rows.full)

    def _compute(self, work: list[WorkItem], totals: _StepTotals) -> list[SeqResult]:
        """Plans, computes and commits `work`, adding to `totals`; an exception before the
        commit takes back the lossy policies' drops (drop_journal.py) and leaves the
        sequences for the isolation to roll back."""
        results: list[SeqResult] = []
        try:
            planned = self.planner.plan(work, results)
            if planned:
                logits_rows = LogitsRows()
                started = time.perf_counter()
                sampled = self._forward(planned, logits_rows)
                totals.forward_ms += (time.perf_counter() - started) * 1000.0
        except Exception:
            self.evictor.undo()
            raise
        self.evictor.settle()
        if planned:
            totals.accepted += self.sequences.commit(planned, sampled, results)
            totals.planned.extend(planned)
            totals.logits_rows.screened += logits_rows.screened
            totals.logits_rows.full += logits_rows.full
        return results

    def adopt_epoch(self, epoch: int) -> int:
        """Serves the scheduler registration `epoch` (every step's StepBatch.epoch). A
        larger one than before frees every sequence held, planned under an earlier
        registration whose scheduler is gone (their blocks stay cached, so resuming
        them is cheap), and returns how many; a smaller one raises StaleEpoch. step() calls it
        first: the one check of a step's epoch (the worker's StepOrder only orders by it)."""
        if epoch < self.epoch:
            raise t.StaleEpoch(f"a step of epoch {epoch}, older than this worker's {self.epoch}")
        if epoch == self.epoch:
            return 0
        self.epoch = epoch
        freed = self.sequences.free_all()
        if freed:
            log.info("freed the sequences of an earlier scheduler registration",
                     extra={"sequences": freed, "epoch": epoch})
        return freed

    def drain_events(self) -> list[t.BlockEvent]:
        return self.pool.drain_events()

    def snapshot_chains(self) -> list[tuple[int, list[int]]]:
        return self.pool.cached_chains()

    def snapshot_partials(self) -> list[tuple[int, int]]:
        """(parent_hash, partial_hash) of every whole prompt's partial last block the index may know."""
        return self.pool.cached_partials()

    def pool_stats(self) -> PoolStats:
        """The pool's figures; under the hybrid layout, what an allocation can take (free
        plus cached) is capped at the sliding blocks that can be attached, since every block
        of a sequence shorter than the window needs one: the scheduler then admits what
        the tighter of the two caches holds (a long sequence needs far fewer sliding blocks
        than pool blocks, so for it the cap is conservative)."""
        stats = self.pool.stats()
        if self.sliding is None:
            return stats
        over = stats.available_blocks - self.sliding.num_available()
        if over <= 0:
            return stats
        free_cut = min(over, stats.free_blocks)
        return replace(stats, free_blocks=stats.free_blocks - free_cut,
                       cached_blocks=stats.cached_blocks - (over - free_cut))

    def running_sequences(self) -> int:
        return len(self.sequences)

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        tables = {seq.seq_id: self.pool.table(seq.seq_id) for seq in self.sequences}
        for seq in self.sequences:
            table = tables[seq.seq_id]
            if self.pool.blocks_for(seq.cache_len) > len(table):
                raise AssertionError(f"{seq.seq_id} computed {seq.num_computed} tokens in {len(table)} blocks")
        if self.sliding is not None:
            self.sliding.check_invariants(tables)

    def release_host_memory(self) -> None:
        """Hands what the process holds without using it back to the system (CPU; nothing
        elsewhere): the heap's freed pages and the shared libraries' clean pages. For quiet points
        (a background build done, an idle worker): the next steps fault in what they use."""
        self.accelerators.release_freed_host_memory()
        self.accelerators.release_library_pages()
        self.wide_release.released_elsewhere()

    @property
    def holds_wide_step_memory(self) -> bool:
        """Whether a wide step ran since the last release (what `release_wide_step_memory` gives back)."""
        return self.wide_release.pending > 0

    def release_wide_step_memory(self) -> bool:
        """Hands back what the wide steps since the last release freed, if any ran (CPU): for a
        worker's quiet moment, nothing running and no step come for a while (server.py), so
        that the release delays no step (step/wide_release.py). False when there was nothing
        to hand back."""
        if not self.holds_wide_step_memory:
            return False
        self.accelerators.release_freed_host_memory()
        self.wide_release.released_elsewhere()
        return True

    def wait_for_screen(self, timeout: float | None = None) -> bool:
        """Blocks until the screen is built or known not to be (benchmarks, tests)."""
        return self.prepared.screen.wait(timeout)

    # ---- what serves: kernels, speed-ups, graphs ------------------------------------------

    @property
    def sampler(self) -> Sampler:
        return self.sampling.sampler

    @sampler.setter
    def sampler(self, sampler: Sampler) -> None:
        self.sampling.sampler = sampler

    @property
    def graphs(self) -> DecodeReplays | None:
        return self.forward.graphs

    @property
    def attention_kernel(self) -> str:
        """What runs the prefill chunks' attention: a fused varlen kernel's name, or sdpa."""
        return self.forward.varlen.name if self.forward.varlen is not None else "sdpa"

    @property
    def decode_attention(self) -> str:
        """What runs the decodes' attention: native (through the block tables) or sdpa (gathered)."""
        return self.forward.decode_kernel.name if self.forward.decode_kernel is not None else "sdpa"

    @property
    def direct_forward(self) -> str:
        """What runs the base model: direct (C decode layers), direct (native RoPE), direct, or
        transformers."""
        direct = self.prepared.speedups.direct
        if direct is None:
            return "transformers"
        if direct.native_layers is not None:
            return "direct (C decode layers)"
        return "direct (native RoPE)" if direct.native_rope else "direct"

    @property
    def lm_head_screened(self) -> bool:
        return self.prepared.screen.screen is not None

    @property
    def linear_kernel(self) -> LinearKernelPlan | None:
        return self.prepared.speedups.linear_kernel

    @property
    def prefill_linear_kernel(self) -> str | None:
        """The coded linears' packs' kernel, when it differs from the plan's."""
        return self.prepared.speedups.prefill_linear_kernel

    @property
    def fused_norms(self) -> int:
        return self.prepared.speedups.fused_norms

    @property
    def fused_mlps(self) -> int:
        return self.prepared.speedups.fused_mlps

    @property
    def native_linears(self) -> int:
        return self.prepared.speedups.native_linears

    @property
    def coded_linears(self) -> int:
        return self.prepared.speedups.coded_linears

    @torch.inference_mode()
    def _forward(self, planned: list[Planned], logits_rows: LogitsRows) -> list[tuple[Planned, list[SampledToken]]]:
        """Samples of every plan that samples: one forward over the plans that compute, then
        the draws (exact-match plans draw from their cached logits)."""
        computed = [p for p in planned if p.num_tokens]
        masks = self.grammar_masks.start(planned)   # computed while the forward runs
        sample_plans, hidden = (self.forward.sampling_hidden_states(computed, self.prompt_scorer)
                                if computed else ([], None))
        return self.sampling.sample(planned, sample_plans, hidden, logits_rows, masks)
