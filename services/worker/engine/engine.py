"""Engine: one packed forward per step over prefill chunks and decodes.

Step semantics (see proto/fairserve/v1/worker.proto): frees first, then new
sequences are registered, then each work item computes up to max_tokens of its
sequence's not-yet-computed tokens; when that reaches the end of the known
tokens, one token is sampled and appended. A work item whose blocks cannot be
allocated fails with "out_of_blocks" and changes nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.block_hash import ROOT_HASH, extend_chain, partial_block_hash
from services.worker.engine.cuda import decode_graphs
from services.worker.engine import types as t
from services.worker.engine.cpu import weight_codes
from services.worker.engine.attention import ATTENTION_NAME, PrefillChunk, StepMetadata
from services.worker.engine.block_pool import BlockPool, LayerKVSpec, PagedKVCache, PartialBlock
from services.worker.engine.config import EngineConfig
from services.worker.engine.cpu.cpu_linear import (KernelPlan, PackedLinear, choose_prefill_kernel, pack_linears,
                                               resolve_kernel_plan)
from services.worker.engine.cuda.decode_graphs import CudaGraphCapture, DecodeGraphs, DecodeRows, GraphCapture
from services.worker.engine.cpu.direct_forward import DirectForward
from services.worker.engine.device import dtype_name, free_device_memory, resolve_device, resolve_dtype
from services.worker.engine.eviction import EVICTION_POLICIES
from services.worker.engine.cpu.fused_mlp import fuse_gated_mlps
from services.worker.engine.cpu.fused_norms import fuse_rms_norms
from services.worker.engine.cpu.host_memory import keep_freed_host_memory
from services.worker.engine.cpu.lm_head_screen import LMHeadScreen, load_native_matmul, screening_available
from services.worker.engine.prompt_logits import PromptKey, PromptLogitsCache, prompt_key
from services.worker.engine.sampler import SampledToken, SampleRequest, Sampler, tokens_drawn_from
from services.worker.engine.speculation import NgramIndex, accepted_prefix
from services.worker.engine.cpu.native_build import default_cache_dir as default_kernel_dir
from services.worker.engine.cpu.native_decode import load_decode_kernel
from services.worker.engine.cpu.native_layers import NativeDecodeLayers
from services.worker.engine.cpu.native_ops import NativeElementwise, load_elementwise, load_skinny_linear
from services.worker.engine.cpu.weight_codes import load_coded_linear
from services.worker.engine.cuda.varlen_attention import load_varlen_kernel


@dataclass
class _Sequence:
    seq_id: str
    tokens: list[int]                   # prompt + output; the last one is uncomputed after a sample
    request: SampleRequest
    num_computed: int = 0
    num_registered_blocks: int = 0      # leading full blocks whose hashes the pool knows
    hashes: list[int] = field(default_factory=list)   # chained hashes of full blocks of `tokens`
    started: bool = False
    ngrams: NgramIndex | None = None    # built on the first speculative decode

    def full_block_hashes(self, block_size: int, model_key: str) -> list[int]:
        return extend_chain(self.hashes, self.tokens, block_size, model_key)


@dataclass
class _Planned:
    seq: _Sequence
    start: int
    num_tokens: int
    cached_tokens: int
    result_index: int
    cached_logits: torch.Tensor | None = None   # exact match: sample from these, compute nothing
    drafts: list[int] = field(default_factory=list)   # speculative tokens verified after a decode

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def rows(self) -> int:
        """Rows of the packed batch: the chunk's tokens, then any drafts."""
        return self.num_tokens + len(self.drafts)

    @property
    def prompt_tokens(self) -> int:
        """Tokens of this chunk at prompt positions (a resumed sequence's outputs are not)."""
        return max(0, min(self.end, len(self.seq.request.prompt_token_ids)) - self.start)

    @property
    def samples(self) -> bool:
        return self.end == len(self.seq.tokens)


@dataclass
class _LogitsRows:
    screened: int = 0
    full: int = 0


MIN_PARTIAL_COPY = 2   # shortest run copied from a cached block when the tail differs
LM_HEAD_SCREEN_MODES = ("auto", "on", "off")
CPU_NATIVE_KERNELS_MODES = ("auto", "off")
DIRECT_FORWARD_MODES = ("auto", "off")
CPU_WEIGHT_CODES_MODES = ("auto", "off")
# Rows per step up to which linear layers use the C kernel: past 8 the packed BLAS kernels
# were faster on the AMD EPYC (the C kernel holds up to 8 rows in registers per weight pass).
SKINNY_MAX_ROWS = 8
MIN_SCREENED_VOCAB = 32768   # `auto` screens vocabularies this large, where the LM head dominates a decode
# Screened rows per step at most when LM_HEAD_SCREEN_MAX_ROWS is 0, by the screen's kernel: past
# these the full head was faster on a 2-core AMD EPYC (fbgemm's op costs two rows per row).
DEFAULT_SCREEN_MAX_ROWS = {"native": 32, "fbgemm": 8}

log = logging.getLogger(__name__)


def _require_choice(what: str, value: str, choices: tuple[str, ...]) -> None:
    """Raises ValueError naming `what` when `value` is not one of `choices`."""
    if value not in choices:
        raise ValueError(f"unknown {what} {value!r}; expected one of {', '.join(choices)}")


class Engine:
    def __init__(self, config: EngineConfig, model: torch.nn.Module | None = None,
                 graph_capture: GraphCapture | None = None) -> None:
        self.config = config
        _require_choice("eviction policy", config.eviction_policy, EVICTION_POLICIES)
        if config.torch_threads > 0:
            torch.set_num_threads(config.torch_threads)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if self.device.type == "cpu":
            keep_freed_host_memory()
        self.model = model if model is not None else _load_model(config.model_dir, self.dtype)
        self.model.to(device=self.device, dtype=self.dtype).eval()
        self.model.set_attn_implementation(ATTENTION_NAME)
        # Multimodal checkpoints (Gemma 4) wrap the text decoder; only the text path runs here.
        self.model_config = self.model.config.get_text_config()
        if getattr(self.model_config, "attn_logit_softcapping", None):
            raise ValueError("attention logit softcapping is not supported by the paged attention path")
        base = self.model.base_model
        self._base = getattr(base, "language_model", base)
        self._lm_head = self.model.get_output_embeddings()
        self._kernel_cache_dir = Path(config.kernel_cache_dir) if config.kernel_cache_dir else default_kernel_dir()
        self._native_kernels = self._native_kernels_enabled()
        native_ops = load_elementwise(self._kernel_cache_dir) if self._native_kernels else None
        self.fused_norms = fuse_rms_norms(self._base, native_ops)
        self.fused_mlps = fuse_gated_mlps(self._base, native_ops) if native_ops is not None else 0
        self.linear_kernel = self._packed_kernel_plan()
        if self.linear_kernel is not None:
            pack_linears(self._base, {self.dtype: self.linear_kernel})
            if isinstance(self._lm_head, torch.nn.Linear):
                self._lm_head = PackedLinear(self._lm_head, self.linear_kernel.lm_head_max_rows,
                                             self.linear_kernel.kernel)
        self.native_linears = self._route_few_rows_to_native() if self._native_kernels else 0
        self.prefill_linear_kernel: str | None = None    # the coded linears' packs, when they differ from the plan's
        self.coded_linears = self._route_few_rows_to_codes()
        self._direct = self._direct_forward(native_ops)
        self._softcap = getattr(self.model_config, "final_logit_softcapping", None)
        self._screen: LMHeadScreen | None = None
        self._screen_ready = threading.Event()
        self._start_screen()
        layer_types = getattr(self.model_config, "layer_types", None)
        self._mask_by_type = {kind: None for kind in set(layer_types)} if layer_types else None

        self._varlen = load_varlen_kernel(config.attention_backend, self.device, self.dtype)
        self.block_size = config.block_size
        self._decode_kernel = load_decode_kernel(config.decode_attention, self.device, self.dtype,
                                                 self.block_size, self._kernel_cache_dir)
        specs, self._cache_layer = _layer_kv_layout(self._base)
        num_blocks = config.num_blocks or self._default_num_blocks(specs)
        self.max_model_len = self._max_model_len()
        if graph_capture is None and config.use_cuda_graphs and self.device.type == "cuda":
            graph_capture = CudaGraphCapture()
        # Graphs' padding rows write into one scratch block past the pool's blocks.
        scratch_blocks = 1 if graph_capture is not None else 0
        self.kv = PagedKVCache(specs, num_blocks + scratch_blocks, self.block_size, self.dtype, self.device)
        self.pool = BlockPool(num_blocks, self.block_size, config.enable_prefix_caching, config.eviction_policy)
        self.graphs: DecodeGraphs | None = None
        if graph_capture is not None:
            self.graphs = DecodeGraphs(
                self._hidden_states, self.kv, self._cache_layer, graph_capture, block_size=self.block_size,
                scratch_block=num_blocks, max_batch=config.cuda_graph_max_batch,
                max_context=min(self.max_model_len, config.cuda_graph_max_context),
                device=self.device, min_context=decode_graphs.MIN_CONTEXT_BUCKET)
        self.sampler = Sampler(eos_token_ids=_eos_token_ids(self.model))
        self.prompt_logits = PromptLogitsCache(config.prompt_logits_cache_size
                                               if config.enable_prefix_caching else 0)
        self._sequences: dict[str, _Sequence] = {}
        self._info = t.EngineInfo(
            model_name=config.model_key or getattr(self.model_config, "name_or_path", "") or Path(config.model_dir).name,
            block_size=self.block_size, num_blocks=num_blocks, device=str(self.device),
            dtype=dtype_name(self.dtype), max_model_len=self.max_model_len,
            eos_token_ids=_eos_token_ids(self.model), vocab_size=int(self.model_config.vocab_size))

    # ---- public API ----------------------------------------------------------------------

    @property
    def attention_kernel(self) -> str:
        """What runs the prefill chunks' attention: a fused varlen kernel's name, or sdpa."""
        return self._varlen.name if self._varlen is not None else "sdpa"

    @property
    def decode_attention(self) -> str:
        """What runs the decodes' attention: native (through the block tables) or sdpa (gathered)."""
        return self._decode_kernel.name if self._decode_kernel is not None else "sdpa"

    @property
    def info(self) -> t.EngineInfo:
        return self._info

    def step(self, batch: t.StepBatch) -> t.StepOutput:
        for seq_id in batch.free_seq_ids:
            self._free(seq_id)
        for new in batch.new_sequences:
            self._register(new)
        results: list[t.SeqResult] = []
        planned = self._plan(batch.work, results)
        forward_ms = 0.0
        replays = self.graphs.replays if self.graphs is not None else 0
        accepted = 0
        logits_rows = _LogitsRows()
        if planned:
            started = time.perf_counter()
            sampled = self._forward(planned, logits_rows)
            forward_ms = (time.perf_counter() - started) * 1000.0
            accepted = self._commit(planned, sampled, results)
        return t.StepOutput(results=results, pool=self.pool.stats(), forward_ms=forward_ms,
                            batch_tokens=sum(p.rows for p in planned),
                            prompt_tokens=sum(p.prompt_tokens for p in planned),
                            prompt_logits_hits=sum(1 for p in planned if p.cached_logits is not None),
                            graph_replayed=self.graphs is not None and self.graphs.replays > replays,
                            draft_tokens=sum(len(p.drafts) for p in planned), accepted_tokens=accepted,
                            screened_rows=logits_rows.screened, full_rows=logits_rows.full)

    def drain_events(self) -> list[t.BlockEvent]:
        return self.pool.drain_events()

    def snapshot_chains(self) -> list[tuple[int, list[int]]]:
        return self.pool.cached_chains()

    def snapshot_partials(self) -> list[tuple[int, int]]:
        """(parent_hash, partial_hash) of every whole prompt's partial last block the index may know."""
        return self.pool.cached_partials()

    def pool_stats(self) -> t.PoolStats:
        return self.pool.stats()

    def running_sequences(self) -> int:
        return len(self._sequences)

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        for seq in self._sequences.values():
            table = self.pool.table(seq.seq_id)
            if self.pool.blocks_for(seq.num_computed) > len(table):
                raise AssertionError(f"{seq.seq_id} computed {seq.num_computed} tokens in {len(table)} blocks")

    # ---- step phases ---------------------------------------------------------------------

    def _free(self, seq_id: str) -> None:
        seq = self._sequences.pop(seq_id, None)
        self.pool.free(seq_id, self._partial_block(seq) if seq is not None else None)

    def _partial_block(self, seq: _Sequence) -> PartialBlock | None:
        """The computed head of `seq`'s partly filled last block, if it has one. When the
        prompt ends inside it, it is aliased by the prompt's partial-block hash (the index's
        exact-match key), even if generated tokens follow the prompt's in it."""
        full, used = divmod(seq.num_computed, self.block_size)
        if not used or not self.pool.enable_prefix_caching:
            return None
        parent = seq.full_block_hashes(self.block_size, self.config.model_key)[full - 1] if full else ROOT_HASH
        start = full * self.block_size
        prompt = seq.request.prompt_token_ids
        alias = 0
        if start < len(prompt) <= seq.num_computed:
            alias = partial_block_hash(parent, prompt[start:], self.config.model_key)
        return PartialBlock(full, tuple(seq.tokens[start:seq.num_computed]), parent, alias)

    def _register(self, new: t.NewSequence) -> None:
        self._free(new.seq_id)     # re-registering a sequence starts it over
        tokens = list(new.prompt_token_ids) + list(new.output_token_ids)
        request = SampleRequest(params=new.sampling, prompt_token_ids=list(new.prompt_token_ids),
                                output_token_ids=list(new.output_token_ids),
                                num_sampled=len(new.output_token_ids))
        self._sequences[new.seq_id] = _Sequence(new.seq_id, tokens, request)

    def _plan(self, work: list[t.WorkItem], results: list[t.SeqResult]) -> list[_Planned]:
        planned: list[_Planned] = []
        seen: set[str] = set()
        for item in work:
            seq = self._sequences.get(item.seq_id)
            error = self._work_error(item, seq, seen)
            seen.add(item.seq_id)
            if error:
                computed = seq.num_computed if seq is not None else 0
                results.append(t.SeqResult(item.seq_id, computed, error=error))
                continue
            assert seq is not None
            plan = self._plan_one(seq, item.max_tokens, len(results), item.draft_tokens)
            if plan is None:
                results.append(t.SeqResult(item.seq_id, seq.num_computed, error=t.OUT_OF_BLOCKS))
                continue
            results.append(t.SeqResult(item.seq_id, plan.end, plan.cached_tokens))
            planned.append(plan)
        return planned

    def _work_error(self, item: t.WorkItem, seq: _Sequence | None, seen: set[str]) -> str:
        if seq is None:
            return t.UNKNOWN_SEQUENCE
        if item.seq_id in seen:
            return t.DUPLICATE_WORK
        if item.max_tokens <= 0:
            return t.INVALID_MAX_TOKENS
        if seq.num_computed >= len(seq.tokens):
            return t.NOTHING_TO_COMPUTE
        if len(seq.tokens) > self.max_model_len:
            return t.EXCEEDS_MAX_MODEL_LEN
        return ""

    def _plan_one(self, seq: _Sequence, max_tokens: int, result_index: int,
                  draft_tokens: int = 0) -> _Planned | None:
        if seq.started and draft_tokens > 0 and len(seq.tokens) - seq.num_computed == 1:
            speculative = self._plan_speculative(seq, draft_tokens, result_index)
            if speculative is not None:
                return speculative
        if not seq.started and self.pool.enable_prefix_caching:
            exact = self._plan_exact(seq, result_index)
            if exact is not None:
                return exact
        cached_blocks: list[int] = []
        tail_source: int | None = None
        copied = 0
        start = seq.num_computed
        if not seq.started and self.pool.enable_prefix_caching:
            cached_blocks, tail = self._find_cached(seq)
            start = len(cached_blocks) * self.block_size
            if tail is not None:
                # Keep at least the last token to compute: its logits give the next token.
                rest = len(seq.tokens) - 1 - start
                tail_source, copied = tail[0], min(tail[1], rest)
                # A lone shared token (a BOS) is not worth a copy; a whole tail always is.
                if copied <= 0 or (copied < MIN_PARTIAL_COPY and copied < rest):
                    tail_source, copied = None, 0
        num_tokens = min(max_tokens, len(seq.tokens) - start - copied)
        if not self._allocate(seq, start + copied + num_tokens, cached_blocks, tail_source, copied):
            if tail_source is None:
                return None
            # Holding the copy source can be what leaves the pool one block short.
            tail_source, copied = None, 0
            num_tokens = min(max_tokens, len(seq.tokens) - start)
            if not self._allocate(seq, start + num_tokens, cached_blocks, None, 0):
                return None
        start += copied
        cached_tokens = 0
        if not seq.started:
            seq.started = True
            cached_tokens = start
            seq.num_computed = start
            seq.num_registered_blocks = len(cached_blocks)
            self.pool.record_prefix_query(len(seq.tokens), cached_tokens)
        return _Planned(seq, start, num_tokens, cached_tokens, result_index)

    def _plan_speculative(self, seq: _Sequence, draft_tokens: int, result_index: int) -> _Planned | None:
        """A decode that also verifies n-gram drafts, or None (no draft, or no room for
        their slots: the plain decode is planned instead)."""
        if seq.ngrams is None:
            seq.ngrams = NgramIndex(self.config.ngram_min, self.config.ngram_max)
        # Every verified row stays inside the model's context.
        limit = min(draft_tokens, self.max_model_len - len(seq.tokens))
        drafts = seq.ngrams.propose(seq.tokens, limit)
        if not drafts or not self.pool.allocate(seq.seq_id, len(seq.tokens) + len(drafts)):
            return None
        return _Planned(seq, seq.num_computed, 1, 0, result_index, drafts=drafts)

    def _plan_exact(self, seq: _Sequence, result_index: int) -> _Planned | None:
        """An identical prompt whose last-position logits and every token's K/V are cached:
        its blocks are reused (the partial last one copied) and nothing is computed."""
        key = self._prompt_key(seq)
        if key is None or not self.prompt_logits.contains(key):
            return None
        hashes = seq.full_block_hashes(self.block_size, self.config.model_key)
        full = len(seq.tokens) // self.block_size
        blocks = self.pool.find_cached_prefix(hashes[:full])
        if len(blocks) < full:
            return None
        rest = len(seq.tokens) - full * self.block_size
        tail_source = None
        if rest:
            tail = self.pool.find_longest_tail(key[0], seq.tokens[full * self.block_size:])
            if tail is None or tail[1] < rest:
                return None
            tail_source = tail[0]
        if not self._allocate(seq, len(seq.tokens), blocks, tail_source, rest):
            return None
        logits = self.prompt_logits.get(key)
        assert logits is not None
        seq.started = True
        seq.num_computed = len(seq.tokens)
        seq.num_registered_blocks = full
        self.pool.record_prefix_query(len(seq.tokens), len(seq.tokens))
        return _Planned(seq, len(seq.tokens), 0, len(seq.tokens), result_index, cached_logits=logits)

    def _prompt_key(self, seq: _Sequence) -> PromptKey | None:
        """The logits-cache key of `seq`'s prompt while nothing has been sampled after it."""
        if seq.request.num_sampled or len(seq.tokens) != len(seq.request.prompt_token_ids):
            return None
        hashes = seq.full_block_hashes(self.block_size, self.config.model_key)
        full = len(seq.tokens) // self.block_size
        return prompt_key(hashes[full - 1] if full else ROOT_HASH, seq.tokens[full * self.block_size:])

    def _find_cached(self, seq: _Sequence) -> tuple[list[int], tuple[int, int] | None]:
        """`seq`'s leading cached full blocks, and the cached block (full or a kept partial)
        after them that shares the longest run of `seq`'s next tokens, with that run's
        length: its slots are copied into a block of `seq`'s own. An identical prompt
        copies its whole tail; a prompt that differs inside a block keeps the part before."""
        hashes = seq.full_block_hashes(self.block_size, self.config.model_key)
        # Keep at least the last token to compute: its logits give the next token.
        reusable = (len(seq.tokens) - 1) // self.block_size
        blocks = self.pool.find_cached_prefix(hashes[:reusable])
        start = len(blocks) * self.block_size
        tail = seq.tokens[start:start + self.block_size]
        if len(tail) < 2:
            return blocks, None
        parent = hashes[len(blocks) - 1] if blocks else ROOT_HASH
        return blocks, self.pool.find_longest_tail(parent, tail)

    def _allocate(self, seq: _Sequence, num_tokens: int, cached_blocks: list[int],
                  tail_source: int | None, copied: int) -> bool:
        """Grows `seq`'s table to `num_tokens` tokens; with a tail source, copies its first
        `copied` slots into the block after the cached ones."""
        if tail_source is None:
            return self.pool.allocate(seq.seq_id, num_tokens, cached_blocks)
        self.pool.hold(tail_source)     # the allocation must not evict the block copied from
        allocated = self.pool.allocate(seq.seq_id, num_tokens, cached_blocks)
        if allocated:
            self.kv.copy_slots(tail_source, self.pool.table(seq.seq_id)[len(cached_blocks)], copied)
        self.pool.release(tail_source)
        return allocated

    @torch.inference_mode()
    def _forward(self, planned: list[_Planned], logits_rows: _LogitsRows
                 ) -> list[tuple[_Planned, list[SampledToken]]]:
        """Samples of every plan that samples: one token, or one per verified row. Counts
        the computed logits rows by path into `logits_rows`."""
        computed = [p for p in planned if p.num_tokens]
        sample_plans: list[_Planned] = []
        requests: list[SampleRequest] = []
        rows: list[torch.Tensor] = []
        if computed:
            sample_plans, hidden = self._sampling_hidden_states(computed)
            if sample_plans:
                requests = self._row_requests(sample_plans)
                logits, complete = self._logits(hidden, requests)
                logits_rows.screened = complete.count(False)
                logits_rows.full = len(complete) - logits_rows.screened
                rows.append(logits)
                self._keep_prompt_logits(sample_plans, logits, complete)
        reused = [p for p in planned if p.cached_logits is not None]
        if reused:
            sample_plans += reused
            requests += [p.seq.request for p in reused]
            rows.append(torch.stack([p.cached_logits for p in reused]))
        if not sample_plans:
            return []
        logits = rows[0] if len(rows) == 1 else torch.cat(rows)
        sampled = self.sampler.sample(logits, requests)
        by_plan: dict[int, tuple[_Planned, list[SampledToken]]] = {}
        for plan, token in zip(sample_plans, sampled):
            by_plan.setdefault(id(plan), (plan, []))[1].append(token)
        return list(by_plan.values())

    @staticmethod
    def _row_requests(sample_plans: list[_Planned]) -> list[SampleRequest]:
        """What each sampled row's draw sees; a plan's rows after the first come after its drafts."""
        requests: list[SampleRequest] = []
        row_index: dict[int, int] = {}
        for plan in sample_plans:
            index = row_index.get(id(plan), 0)
            row_index[id(plan)] = index + 1
            requests.append(_row_request(plan.seq.request, plan.drafts[:index]))
        return requests

    def _sampling_hidden_states(self, planned: list[_Planned]) -> tuple[list[_Planned], torch.Tensor]:
        """One packed forward over `planned`; the final hidden states of the rows that sample."""
        # Decodes first (one row each), then prefill chunks and verified drafts as contiguous runs.
        order = sorted(planned, key=lambda p: p.rows != 1)
        rows = self._decode_with_graphs(order)
        if rows is not None:
            return order, rows
        meta, input_ids, positions, sample_rows, sample_plans = self._build_inputs(order)
        hidden = self._hidden_states(input_ids, positions, meta)
        if not sample_plans:
            return [], hidden[:0]
        return sample_plans, hidden[torch.tensor(sample_rows, device=self.device)]

    def _logits(self, hidden: torch.Tensor, requests: list[SampleRequest]) -> tuple[torch.Tensor, list[bool]]:
        """Float32 logits [rows, vocab] of the sampling rows, and which rows are complete.
        Greedy and top-k rows may come from the screen (lm_head_screen.py): exact where
        their draw can land, -inf elsewhere, which is all such a draw reads."""
        screen = self._screen
        picks = [self._screen_pick(screen, request) for request in requests] if screen is not None else []
        screened = [row for row, pick in enumerate(picks) if pick is not None]
        screened_logits = None
        if screen is not None and 0 < len(screened) <= self._screen_max_rows(screen):
            chosen = [pick for pick in picks if pick is not None]
            screened_logits = screen.logits(hidden[screened] if len(screened) < len(requests) else hidden,
                                            [count for count, _ in chosen], [ids for _, ids in chosen])
        if screened_logits is None:
            return self._full_logits(hidden), [True] * len(requests)
        complete = [pick is None for pick in picks]
        if len(screened) == len(requests):
            return screened_logits, complete
        logits = torch.empty(len(requests), screen.vocab_size, device=hidden.device)
        logits[screened] = screened_logits
        full = [row for row, pick in enumerate(picks) if pick is None]
        logits[full] = self._full_logits(hidden[full])
        return logits, complete

    def _screen_max_rows(self, screen: LMHeadScreen) -> int:
        """Screened rows per step at most: the setting, or past where the full head is faster."""
        return self.config.lm_head_screen_max_rows or DEFAULT_SCREEN_MAX_ROWS[screen.kernel]

    def _screen_pick(self, screen: LMHeadScreen, request: SampleRequest) -> tuple[int, list[int]] | None:
        """(how many best tokens the row's draw reads, tokens its sampler adjusts), or None
        when the row needs its full logits."""
        count = tokens_drawn_from(request.params)
        if count is None or count > LMHeadScreen.MAX_TOP_K or count >= screen.vocab_size:
            return None
        adjusted = self.sampler.adjusted_token_ids(request)
        if len(adjusted) > LMHeadScreen.MAX_ADJUSTED_TOKENS:
            return None
        return count, sorted(i for i in adjusted if 0 <= i < screen.vocab_size)

    def _full_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._lm_head(hidden)
        if self._softcap:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits.float()

    def _hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        """The base model's last hidden states of the packed rows, [T, hidden]."""
        if self._direct is not None:
            return self._direct(input_ids, positions, meta)
        return self._base(input_ids=input_ids[None], position_ids=positions[None],
                          attention_mask=self._mask_by_type, use_cache=False,
                          paged_metadata=meta).last_hidden_state[0]

    def _decode_with_graphs(self, order: list[_Planned]) -> torch.Tensor | None:
        """Hidden states of a decode-only step from a captured graph, or None (no graphs,
        not decode-only, no bucket fits, or graphs turned off)."""
        if self.graphs is None or not all(p.rows == 1 and p.samples for p in order):
            return None
        tables = [self.pool.table(p.seq.seq_id) for p in order]
        return self.graphs.run(DecodeRows(
            token_ids=[p.seq.tokens[p.start] for p in order],
            positions=[p.start for p in order],
            slots=[self._slot(table, p.start) for p, table in zip(order, tables)],
            ctx_lens=[p.end for p in order],
            block_tables=tables))

    def _slot(self, table: list[int], position: int) -> int:
        """The KV slot of `position` in a sequence with block table `table`."""
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def _keep_prompt_logits(self, sample_plans: list[_Planned], logits: torch.Tensor,
                            complete: list[bool]) -> None:
        """Keeps complete rows only: a screened row serves its own request's draw, not
        a later identical prompt that may sample differently or want logprobs."""
        if self.prompt_logits.capacity == 0:
            return
        for row, plan in enumerate(sample_plans):
            if not complete[row]:
                continue
            key = self._prompt_key(plan.seq)
            if key is not None:
                self.prompt_logits.put(key, logits[row])

    def _build_inputs(self, order: list[_Planned]
                      ) -> tuple[StepMetadata, torch.Tensor, torch.Tensor, list[int], list[_Planned]]:
        block_size = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_ctx: list[int] = []
        decode_tables: list[list[int]] = []
        prefills: list[PrefillChunk] = []
        sample_rows: list[int] = []
        sample_plans: list[_Planned] = []
        for plan in order:
            table = self.pool.table(plan.seq.seq_id)
            row = len(ids)
            end = plan.end + len(plan.drafts)
            ids.extend(plan.seq.tokens[plan.start:plan.end])
            ids.extend(plan.drafts)
            positions.extend(range(plan.start, end))
            if plan.rows == 1 and not prefills:
                slots.append(self._slot(table, plan.start))
                decode_ctx.append(plan.end)
                decode_tables.append(table)
            else:
                table_tensor = torch.tensor(table[:self.pool.blocks_for(end)], dtype=torch.long)
                context = torch.arange(end)
                context_slots = table_tensor[context // block_size] * block_size + context % block_size
                slots.extend(context_slots[plan.start:].tolist())
                prefills.append(PrefillChunk(row, plan.rows, plan.start, context_slots.to(self.device)))
            if plan.samples:
                # The last computed token's row, then one row per draft.
                sample_rows.extend(range(len(ids) - 1 - len(plan.drafts), len(ids)))
                sample_plans.extend([plan] * (1 + len(plan.drafts)))
        width = max((len(table) for table in decode_tables), default=0)
        padded = [table + [0] * (width - len(table)) for table in decode_tables]
        device = self.device
        meta = StepMetadata(
            kv=self.kv, cache_layer=self._cache_layer, block_size=block_size,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            num_decodes=len(decode_ctx),
            decode_ctx_lens=torch.tensor(decode_ctx, dtype=torch.long, device=device),
            decode_block_tables=torch.tensor(padded, dtype=torch.long, device=device).reshape(len(padded), width),
            decode_ctx_range=(min(decode_ctx, default=0), max(decode_ctx, default=0)),
            prefills=prefills, num_tokens=len(ids), varlen=self._varlen,
            decode_kernel=self._decode_kernel)
        input_ids = torch.tensor(ids, dtype=torch.long, device=device)
        position_tensor = torch.tensor(positions, dtype=torch.long, device=device)
        return meta, input_ids, position_tensor, sample_rows, sample_plans

    def _commit(self, planned: list[_Planned], sampled: list[tuple[_Planned, list[SampledToken]]],
                results: list[t.SeqResult]) -> int:
        """Applies the step to the sequences and results; returns the drafts accepted."""
        accepted = 0
        emitted_by_plan: dict[int, list[SampledToken]] = {}
        for plan, tokens in sampled:
            kept = accepted_prefix(plan.drafts, [token.token_id for token in tokens])
            emitted_by_plan[id(plan)] = tokens[:len(kept)]
            accepted += len(kept) - 1
        for plan in planned:
            seq = plan.seq
            emitted = emitted_by_plan.get(id(plan), [])
            seq.num_computed = plan.end
            if plan.drafts:
                # Kept drafts are computed; rows past the last kept one were computed for nothing.
                seq.num_computed += len(emitted) - 1
                self.pool.shrink(seq.seq_id, seq.num_computed)
                results[plan.result_index].num_computed_tokens = seq.num_computed
            self._register_full_blocks(seq)
            if not emitted:
                continue
            token_ids = [token.token_id for token in emitted]
            seq.tokens.extend(token_ids)
            seq.request.output_token_ids.extend(token_ids)
            seq.request.num_sampled += len(token_ids)
            result = results[plan.result_index]
            result.sampled = True
            result.token_id = token_ids[0]
            result.logprob = emitted[0].logprob
            result.more_token_ids = token_ids[1:]
            result.more_logprobs = [token.logprob for token in emitted[1:]]
        return accepted

    def _register_full_blocks(self, seq: _Sequence) -> None:
        if not self.pool.enable_prefix_caching:
            return
        full = seq.num_computed // self.block_size
        first = seq.num_registered_blocks
        if full <= first:
            return
        hashes = seq.full_block_hashes(self.block_size, self.config.model_key)
        parent = hashes[first - 1] if first else ROOT_HASH
        self.pool.cache_full_blocks(seq.seq_id, first, hashes[first:full], parent, seq.tokens)
        seq.num_registered_blocks = full

    def _start_screen(self) -> None:
        """The LM head screen for float32 CPU engines: built now (`on`), or for large
        vocabularies in the background (`auto`: packing the int8 head takes seconds;
        steps use the full head until it is ready)."""
        mode = self.config.lm_head_screen
        _require_choice("LM head screen mode", mode, LM_HEAD_SCREEN_MODES)
        if self.config.lm_head_screen_max_rows < 0:
            raise ValueError("lm_head_screen_max_rows must be >= 0 (0: by the screen's kernel)")
        head = self.model.get_output_embeddings()
        weight = getattr(head, "weight", None)
        if (mode == "off" or self.device.type != "cpu" or self.dtype != torch.float32
                or weight is None or getattr(head, "bias", None) is not None):
            self._screen_ready.set()
            return
        if mode == "on":
            self._build_screen(weight)
        elif weight.shape[0] >= MIN_SCREENED_VOCAB:
            threading.Thread(target=self._build_screen, args=(weight,), name="lm-head-screen", daemon=True).start()
        else:
            self._screen_ready.set()

    def _build_screen(self, weight: torch.Tensor) -> None:
        try:
            started = time.perf_counter()
            native = load_native_matmul(self._kernel_cache_dir) if self._native_kernels else None
            if native is None and not screening_available():
                return
            self._screen = LMHeadScreen.create(weight, self._softcap, native)
            if self._screen is not None:
                log.info("LM head screen ready in %.1f s (%s kernel)", time.perf_counter() - started,
                         self._screen.kernel)
        except Exception:   # the full head keeps serving; the failure is only logged
            log.exception("LM head screen could not be built; the full LM head serves every row")
        finally:
            self._screen_ready.set()

    def wait_for_screen(self, timeout: float | None = None) -> bool:
        """Blocks until the screen is built or known not to be (benchmarks, tests)."""
        return self._screen_ready.wait(timeout)

    @property
    def lm_head_screened(self) -> bool:
        return self._screen is not None

    def _route_few_rows_to_native(self) -> int:
        """Packed linears (layers and LM head) run steps of at most SKINNY_MAX_ROWS rows
        through the C kernel; returns how many."""
        kernel = load_skinny_linear(self._kernel_cache_dir)
        if kernel is None:
            return 0
        linears = [m for m in (*self._base.modules(), self._lm_head) if isinstance(m, PackedLinear)]
        return sum(1 for linear in linears if linear.use_native(kernel, SKINNY_MAX_ROWS))

    def _route_few_rows_to_codes(self) -> int:
        """Packed linears whose float32 weights are exact 8-bit codes (weight_codes.py) run
        steps of at most weight_codes.MAX_ROWS rows through the coded kernel; returns how many."""
        _require_choice("CPU weight codes mode", self.config.cpu_weight_codes, CPU_WEIGHT_CODES_MODES)
        if self.config.cpu_weight_codes == "off" or not self._native_kernels:
            return 0
        kernel = load_coded_linear(self._kernel_cache_dir)
        if kernel is None:
            return 0
        started = time.perf_counter()
        linears = [m for m in (*self._base.modules(), self._lm_head) if isinstance(m, PackedLinear)]
        coded = [linear for linear in linears if linear.use_codes(kernel, weight_codes.MAX_ROWS)]
        if coded:
            log.info("%d of %d linears kept as exact 8-bit weight codes (%.0f MB) in %.1f s", len(coded),
                     len(linears), sum(linear.coded.nbytes for linear in coded) / 1e6,
                     time.perf_counter() - started)
            # The layers' packs now serve prefill chunks only: the kernel faster there may be
            # another. (The LM head's keeps its kernel: past 32 rows it only serves prompt logprobs.)
            prefill_kernel = choose_prefill_kernel() if self.config.cpu_linear_kernel == "auto" else None
            if prefill_kernel is not None:
                for linear in coded:
                    if linear is not self._lm_head and linear.kernel != prefill_kernel:
                        linear.repack_for_prefill(prefill_kernel)
                self.prefill_linear_kernel = prefill_kernel
        return len(coded)

    def _direct_forward(self, native_ops: NativeElementwise | None) -> DirectForward | None:
        """The base model's forward without transformers' module dispatch (direct_forward.py):
        `auto` on CPU for the layer classes it writes out; None keeps transformers' forward."""
        _require_choice("direct forward mode", self.config.direct_forward, DIRECT_FORWARD_MODES)
        if self.config.direct_forward == "off" or self.device.type != "cpu":
            return None
        direct = DirectForward.create(self._base, native_ops)
        if direct is not None and direct.native_rope and self.coded_linears:
            direct.native_layers = NativeDecodeLayers.create(self._base, direct.layer_types, native_ops,
                                                             self._kernel_cache_dir)
        return direct

    @property
    def direct_forward(self) -> str:
        """What runs the base model: direct (C decode layers), direct (native RoPE), direct, or
        transformers."""
        if self._direct is None:
            return "transformers"
        if self._direct.native_layers is not None:
            return "direct (C decode layers)"
        return "direct (native RoPE)" if self._direct.native_rope else "direct"

    def _native_kernels_enabled(self) -> bool:
        """Whether the C kernels of CPU_NATIVE_KERNELS (norms, gated activations, few-row
        linears, the screen's int8 kernel) may serve: `auto` on CPU in float32."""
        _require_choice("CPU native kernels mode", self.config.cpu_native_kernels, CPU_NATIVE_KERNELS_MODES)
        return self.config.cpu_native_kernels == "auto" and self.device.type == "cpu" and self.dtype == torch.float32

    def _packed_kernel_plan(self) -> KernelPlan | None:
        """Pre-packed weights on CPU (cpu_linear.py: MKL or oneDNN for float32, whichever
        is faster on this CPU, oneDNN for bfloat16): decode batches of a few rows then
        cost about what one row does. None: plain linears."""
        if not self.config.cpu_packed_weights or self.device.type != "cpu":
            return None
        return resolve_kernel_plan(self.config.cpu_linear_kernel, self.dtype)

    # ---- sizing --------------------------------------------------------------------------

    def _default_num_blocks(self, specs: list[LayerKVSpec | None]) -> int:
        per_block = PagedKVCache.bytes_per_block(specs, self.config.block_size, self.dtype)
        fraction = self.config.kv_memory_fraction
        if self.device.type == "cuda":
            budget = int(free_device_memory(self.device) * (fraction or 0.5))
        elif fraction > 0:
            # After the weights are loaded, so the fraction is of what is left.
            budget = int(free_device_memory(self.device) * fraction)
        else:
            budget = self.config.cpu_kv_bytes
        return max(1, budget // per_block)

    def _max_model_len(self) -> int:
        if self.config.max_model_len > 0:
            return self.config.max_model_len
        limit = int(getattr(self.model_config, "max_position_embeddings", 0) or self.config.cpu_max_model_len)
        if self.device.type != "cuda":
            limit = min(limit, self.config.cpu_max_model_len)
        return limit


def _row_request(request: SampleRequest, drafts: list[int]) -> SampleRequest:
    """What sampling the row after `drafts` sees: the request as if they were already
    its output (penalties, min_tokens and the seeded draw index follow them)."""
    if not drafts:
        return request
    return SampleRequest(params=request.params, prompt_token_ids=request.prompt_token_ids,
                         output_token_ids=[*request.output_token_ids, *drafts],
                         num_sampled=request.num_sampled + len(drafts))


def _load_model(model_dir: str, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)


def _layer_kv_layout(base: torch.nn.Module) -> tuple[list[LayerKVSpec | None], list[int]]:
    """Cache shape per layer, and which layer's cache each layer reads: its own, or for
    a KV-shared layer (Gemma 4) the last earlier storing layer of the same attention type."""
    specs: list[LayerKVSpec | None] = []
    cache_layer: list[int] = []
    last_store: dict[object, int] = {}
    for index, layer in enumerate(base.layers):
        attn = layer.self_attn
        kind = getattr(attn, "layer_type", None)
        if getattr(attn, "is_kv_shared_layer", False):
            if kind not in last_store:
                raise ValueError(f"layer {index} shares KV but no earlier {kind} layer stores it")
            specs.append(None)
            cache_layer.append(last_store[kind])
            continue
        head_dim = int(attn.head_dim)
        specs.append(LayerKVSpec(num_kv_heads=attn.k_proj.out_features // head_dim, head_dim=head_dim))
        cache_layer.append(index)
        if getattr(attn, "store_full_length_kv", True):
            last_store[kind] = index
    return specs, cache_layer


def _eos_token_ids(model: torch.nn.Module) -> list[int]:
    generation = getattr(model, "generation_config", None)
    value = getattr(generation, "eos_token_id", None) if generation is not None else None
    if value is None:
        value = getattr(model.config.get_text_config(), "eos_token_id", None)
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]
