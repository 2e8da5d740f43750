"""The engine's running sequences and what a step does to them.

A sequence is its tokens (prompt + output; the last one is uncomputed after a
sample), how many are computed, its sampling request and its chain of full-block
hashes, computed under its hash key: the model key joined by its cache salt, so
sequences with different salts never share a cached block. `Sequences`
registers and frees them (a freed sequence's computed partial last block is
offered to the pool), applies a step's samples (accepted drafts, new tokens,
results) and registers newly computed full blocks with the pool's prefix cache.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from common.block_hash import ROOT_HASH, adapter_id, adapter_salt, extend_chain, parent_of, partial_block_hash, salted_key
from common.model_files.peft_config import AdapterError
from common.step import NewSequence, SeqResult
from services.worker.engine.kv.block_pool import BlockPool, PartialBlock
from services.worker.engine.kv.kv_policy import BlockBudget, block_budget, policy_error
from services.worker.engine.lora.peft_adapter import LoraAdapter
from services.worker.engine.lora.registry import AdapterRef, LoraRegistry
from services.worker.engine.sampling.prompt_logits import PromptKey, prompt_key
from services.worker.engine.sampling.sampler import SampledToken, SampleRequest
from services.worker.engine.sampling.speculation import NgramIndex, accepted_prefix

if TYPE_CHECKING:
    from services.worker.engine.step.planning import Planned

log = logging.getLogger(__name__)


@dataclass
class SequenceState:
    seq_id: str
    tokens: list[int]                   # prompt + output; the last one is uncomputed after a sample
    request: SampleRequest
    num_computed: int = 0
    num_registered_blocks: int = 0      # leading full blocks whose hashes the pool knows
    hashes: list[int] = field(default_factory=list)   # chained hashes of full blocks of `tokens`
    started: bool = False
    ngrams: NgramIndex | None = None    # built on the first speculative decode
    cache_salt: str = ""                # blocks are shared only with sequences of the same salt
    hash_key: str = ""                  # salted_key(model key, cache_salt): what its blocks hash under
    budget: BlockBudget | None = None   # a lossy KV policy's (kv_policy.py); None: keeps everything
    evicted: int = 0                    # tokens its KV policy dropped from the cache
    block_scores: list[float] = field(default_factory=list)   # h2o: attention accumulated per table entry
    lora_name: str = ""                 # its LoRA adapter's name ("" = the base model)
    adapter: LoraAdapter | None = None  # that adapter's weights, held while the sequence lives
    adapter_error: str = ""             # why its adapter could not be loaded (its forward then fails)

    @property
    def cache_len(self) -> int:
        """Computed tokens still in the cache: positions and slots count from the cache's start."""
        return self.num_computed - self.evicted

    @property
    def lossy(self) -> bool:
        return self.budget is not None
    grammar: Any = None                 # grammar.GrammarState of a constrained sequence: advanced by what it keeps

    def full_block_hashes(self, block_size: int) -> list[int]:
        return extend_chain(self.hashes, self.tokens, block_size, self.hash_key)

    def prompt_key(self, block_size: int) -> PromptKey | None:
        """The logits-cache key of the prompt while nothing has been sampled after it."""
        if self.request.num_sampled or len(self.tokens) != len(self.request.prompt_token_ids):
            return None
        hashes = self.full_block_hashes(block_size)
        full = len(self.tokens) // block_size
        return prompt_key(parent_of(hashes, full), self.tokens[full * block_size:], self.cache_salt)


class Sequences:
    def __init__(self, pool: BlockPool, block_size: int, model_key: str,
                 loras: LoraRegistry | None = None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.model_key = model_key
        self.loras = loras
        self._by_id: dict[str, SequenceState] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[SequenceState]:
        return iter(self._by_id.values())

    def get(self, seq_id: str) -> SequenceState | None:
        return self._by_id.get(seq_id)

    def free(self, seq_id: str) -> None:
        seq = self._by_id.pop(seq_id, None)
        if self.loras is not None:
            self.loras.release(seq_id)
        self.pool.free(seq_id, self._partial_block(seq) if seq is not None else None)

    def free_all(self) -> int:
        """Frees every sequence (as free() does: blocks back to the prefix cache); returns how many."""
        seq_ids = list(self._by_id)
        for seq_id in seq_ids:
            self.free(seq_id)
        return len(seq_ids)

    def register(self, new: NewSequence) -> None:
        self.free(new.seq_id)     # re-registering a sequence starts it over
        tokens = list(new.prompt_token_ids) + list(new.output_token_ids)
        request = SampleRequest(params=new.sampling, prompt_token_ids=list(new.prompt_token_ids),
                                output_token_ids=list(new.output_token_ids),
                                num_sampled=len(new.output_token_ids))
        # An adapter's blocks hash apart from the base model's and every other adapter's, whatever
        # salt the sequence came with (adapter_salt is idempotent: the gateway folds it already).
        salt = adapter_salt(new.cache_salt, adapter_id(new.lora_name, new.lora_digest))
        seq = SequenceState(new.seq_id, tokens, request, cache_salt=salt, hash_key=salted_key(self.model_key, salt),
                            budget=self._budget(new), lora_name=new.lora_name)
        if new.lora_name:
            self._hold_adapter(seq, AdapterRef(new.lora_name, new.lora_path, new.lora_digest))
        self._by_id[new.seq_id] = seq

    def _hold_adapter(self, seq: SequenceState, ref: AdapterRef) -> None:
        if self.loras is None:
            seq.adapter_error = "this worker serves no LoRA adapters (LORA_MODULES and LORA_ROOT unset)"
            return
        try:
            seq.adapter = self.loras.acquire(seq.seq_id, ref)
        except (AdapterError, OSError) as error:
            seq.adapter_error = str(error) if isinstance(error, AdapterError) else "its files cannot be read"
            log.warning("LoRA adapter not served: %s", error, extra={"seq_id": seq.seq_id})

    def _budget(self, new: NewSequence) -> BlockBudget | None:
        error = policy_error(new.kv_policy)
        if error:   # the scheduler checks policies; one it let through is served in full
            log.warning("KV policy not served: %s", error, extra={"seq_id": new.seq_id})
            return None
        return block_budget(new.kv_policy, self.block_size)

    def _partial_block(self, seq: SequenceState) -> PartialBlock | None:
        """The computed head of `seq`'s partly filled last block, if it has one. When the
        prompt ends inside it, it is aliased by the prompt's partial-block hash (the index's
        exact-match key), even if generated tokens follow the prompt's in it."""
        full, used = divmod(seq.num_computed, self.block_size)
        if not used or not self.pool.enable_prefix_caching or seq.lossy:
            return None
        parent = seq.full_block_hashes(self.block_size)[full - 1] if full else ROOT_HASH
        start = full * self.block_size
        prompt = seq.request.prompt_token_ids
        alias = 0
        if start < len(prompt) <= seq.num_computed:
            alias = partial_block_hash(parent, prompt[start:], seq.hash_key)
        return PartialBlock(full, tuple(seq.tokens[start:seq.num_computed]), parent, alias, seq.cache_salt)

    def commit(self, planned: list[Planned], sampled: list[tuple[Planned, list[SampledToken]]],
               results: list[SeqResult]) -> int:
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
            if plan.prompt_logprobs:
                results[plan.result_index].prompt_logprobs = plan.prompt_logprobs
                results[plan.result_index].prompt_logprobs_start = plan.prompt_logprobs_start
            if emitted:
                _append_sampled(seq, results[plan.result_index], emitted)
            # After the append: kept drafts are computed tokens that only now are in seq.tokens.
            self._register_full_blocks(seq)
        return accepted

    def _register_full_blocks(self, seq: SequenceState) -> None:
        if not self.pool.enable_prefix_caching or seq.lossy:
            return
        # Only blocks whose tokens are all known hash (a block is never marked registered
        # without its hash reaching the pool).
        full = min(seq.num_computed, len(seq.tokens)) // self.block_size
        first = seq.num_registered_blocks
        if full <= first:
            return
        hashes = seq.full_block_hashes(self.block_size)
        self.pool.cache_full_blocks(seq.seq_id, first, hashes[first:full], parent_of(hashes, first), seq.tokens,
                                    seq.cache_salt)
        seq.num_registered_blocks = full


def _append_sampled(seq: SequenceState, result: SeqResult, emitted: list[SampledToken]) -> None:
    """The tokens a step sampled for `seq`, appended to it and reported in `result`."""
    token_ids = [token.token_id for token in emitted]
    if seq.grammar is not None:
        seq.grammar.advance(token_ids)
    seq.tokens.extend(token_ids)
    seq.request.output_token_ids.extend(token_ids)
    seq.request.num_sampled += len(token_ids)
    result.sampled = True
    result.token_id = token_ids[0]
    result.logprob = emitted[0].logprob
    result.more_token_ids = tuple(token_ids[1:])
    result.more_logprobs = tuple(token.logprob for token in emitted[1:])
