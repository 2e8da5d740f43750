"""Which tokens each work item of a step computes, and the blocks they need.

A work item is checked (known sequence, once per step, something to compute,
inside the model's context), then planned: a started decode may verify n-gram
drafts; a new sequence first tries the exact-match path (an identical prompt's
cached K/V and last logits: nothing is computed), else reuses its leading
cached full blocks and copies the longest shared run of a cached block after
them (not when its prompt is scored for logprobs: that computes every position);
then the pool grows its block table to cover the chunk. Under the hybrid layout
(sliding_blocks.py) a reused prefix must have its last window in the sliding group,
and every plan attaches sliding blocks for the window its chunk attends through. A
plan the pool (or the sliding group) cannot cover fails the item with
"out_of_blocks" and changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.block_hash import parent_of
from common.types import TokenLogprob
from common.step import SeqResult, StepError, WorkItem
from services.worker.engine.kv.block_pool import BlockPool
from services.worker.engine.kv.kv_cache import SLIDING_GROUP, PagedKVCache
from services.worker.engine.kv.kv_policy import KvEvictor
from services.worker.engine.sampling.prompt_logits import KeptPrompt, PromptLogitsCache
from services.worker.engine.step.sequences import Sequences, SequenceState
from services.worker.engine.kv.sliding_blocks import SlidingBlocks
from services.worker.engine.sampling.speculation import NgramIndex

MIN_PARTIAL_COPY = 2   # shortest run copied from a cached block when the tail differs


@dataclass
class Planned:
    seq: SequenceState
    start: int
    num_tokens: int
    cached_tokens: int
    result_index: int
    # Exact match: the prompt's kept last position (its final hidden state, rows of logits).
    kept: KeptPrompt | None = None
    drafts: list[int] = field(default_factory=list)   # speculative tokens verified after a decode
    # The chunk's scored prompt tokens (prompt_logprobs.py), from position prompt_logprobs_start on.
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs_start: int = 0

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


@dataclass(frozen=True)
class PlanLimits:
    block_size: int
    max_model_len: int
    ngram_min: int
    ngram_max: int


class StepPlanner:
    def __init__(self, sequences: Sequences, pool: BlockPool, kv: PagedKVCache, prompt_logits: PromptLogitsCache,
                 limits: PlanLimits, evictor: KvEvictor | None = None,
                 sliding: SlidingBlocks | None = None) -> None:
        self.sequences = sequences
        self.sliding = sliding
        self.evictor = evictor if evictor is not None else KvEvictor(pool, None, limits.block_size)
        self.pool = pool
        self.kv = kv
        self.prompt_logits = prompt_logits
        self.limits = limits
        self.block_size = limits.block_size

    def plan(self, work: list[WorkItem], results: list[SeqResult]) -> list[Planned]:
        """The plans of `work`, in order; appends every item's result (or error) to `results`."""
        planned: list[Planned] = []
        seen: set[str] = set()
        for item in work:
            seq = self.sequences.get(item.seq_id)
            error = self._work_error(item, seq, seen)
            seen.add(item.seq_id)
            if error:
                computed = seq.num_computed if seq is not None else 0
                results.append(SeqResult(item.seq_id, computed, error=error))
                continue
            assert seq is not None
            plan = self._plan_one(seq, item.num_tokens, len(results), item.draft_tokens)
            if plan is None:
                results.append(SeqResult(item.seq_id, seq.num_computed, error=StepError.OUT_OF_BLOCKS))
                continue
            results.append(SeqResult(item.seq_id, plan.end, plan.cached_tokens))
            planned.append(plan)
        return planned

    def _work_error(self, item: WorkItem, seq: SequenceState | None, seen: set[str]) -> StepError:
        if seq is None:
            return StepError.UNKNOWN_SEQUENCE
        if item.seq_id in seen:
            return StepError.DUPLICATE_WORK
        if item.num_tokens <= 0:
            return StepError.INVALID_NUM_TOKENS
        if seq.num_computed >= len(seq.tokens):
            return StepError.NOTHING_TO_COMPUTE
        if len(seq.tokens) > self.limits.max_model_len and not seq.lossy:
            return StepError.EXCEEDS_MAX_MODEL_LEN
        return StepError.NONE

    def _plan_one(self, seq: SequenceState, budget: int, result_index: int,
                  draft_tokens: int = 0) -> Planned | None:
        if seq.started and draft_tokens > 0 and len(seq.tokens) - seq.num_computed == 1 and not seq.lossy:
            speculative = self._plan_speculative(seq, draft_tokens, result_index)
            if speculative is not None:
                return speculative
        # A prompt scored for its logprobs computes every position: nothing is reused.
        # A lossy sequence's blocks are its own (kv_policy.py).
        fresh = (not seq.started and self.pool.enable_prefix_caching
                 and not seq.request.params.prompt_logprobs and not seq.lossy)
        if fresh:
            exact = self._plan_exact(seq, result_index)
            if exact is not None:
                return exact
        cached_blocks, tail_source, copied = self._reusable(seq) if fresh else ([], None, 0)
        start = len(cached_blocks) * self.block_size if fresh else seq.num_computed
        num_tokens = self._sliding_room(seq, start, min(budget, len(seq.tokens) - start - copied))
        if seq.lossy:
            num_tokens = self.evictor.make_room(seq, num_tokens)
        first = start - seq.evicted
        if not self._allocate(seq, first + copied + num_tokens, cached_blocks, tail_source, copied, first):
            if tail_source is None:
                return None
            # Holding the copy source can be what leaves the pool one block short.
            tail_source, copied = None, 0
            num_tokens = self._sliding_room(seq, start, min(budget, len(seq.tokens) - start))
            if not self._allocate(seq, start + num_tokens, cached_blocks, None, 0, start):
                return None
        start += copied
        cached_tokens = 0
        if not seq.started:
            seq.started = True
            cached_tokens = start
            seq.num_computed = start
            seq.num_registered_blocks = len(cached_blocks)
            self.pool.record_prefix_query(len(seq.tokens), cached_tokens)
        return Planned(seq, start, num_tokens, cached_tokens, result_index)

    def _reusable(self, seq: SequenceState) -> tuple[list[int], int | None, int]:
        """A new sequence's leading cached blocks, and the block (or None) whose first slots
        are copied after them, with how many."""
        cached_blocks, tail = self._find_cached(seq)
        if tail is None:
            return cached_blocks, None, 0
        # Keep at least the last token to compute: its logits give the next token.
        rest = len(seq.tokens) - 1 - len(cached_blocks) * self.block_size
        copied = min(tail[1], rest)
        # A lone shared token (a BOS) is not worth a copy; a whole tail always is.
        if copied <= 0 or (copied < MIN_PARTIAL_COPY and copied < rest):
            return cached_blocks, None, 0
        return cached_blocks, tail[0], copied

    def _plan_speculative(self, seq: SequenceState, draft_tokens: int, result_index: int) -> Planned | None:
        """A decode that also verifies n-gram drafts, or None (no draft, or no room for
        their slots: the plain decode is planned instead)."""
        if seq.ngrams is None:
            seq.ngrams = NgramIndex(self.limits.ngram_min, self.limits.ngram_max)
        # Every verified row stays inside the model's context.
        limit = min(draft_tokens, self.limits.max_model_len - len(seq.tokens))
        drafts = seq.ngrams.propose(seq.tokens, limit)
        if not drafts or not self._allocate(seq, len(seq.tokens) + len(drafts), [], None, 0, seq.num_computed):
            return None
        return Planned(seq, seq.num_computed, 1, 0, result_index, drafts=drafts)

    def _plan_exact(self, seq: SequenceState, result_index: int) -> Planned | None:
        """An identical prompt whose last position's final hidden state and every token's K/V
        are cached: its blocks are reused (the partial last one copied) and only its logits
        are computed (sampling.py)."""
        key = seq.prompt_key(self.block_size)
        if key is None or not self.prompt_logits.contains(key):
            return None
        hashes = seq.full_block_hashes(self.block_size)
        full = len(seq.tokens) // self.block_size
        blocks = self._usable(self.pool.find_cached_prefix(hashes[:full]))
        if len(blocks) < full:
            return None
        rest = len(seq.tokens) - full * self.block_size
        tail_source = None
        if rest:
            tail = self._attached_tail(self.pool.find_longest_tail(key[0], seq.tokens[full * self.block_size:],
                                                                   seq.cache_salt))
            if tail is None or tail[1] < rest:
                return None
            tail_source = tail[0]
        if not self._allocate(seq, len(seq.tokens), blocks, tail_source, rest, full * self.block_size):
            return None
        kept = self.prompt_logits.get(key)
        assert kept is not None
        seq.started = True
        seq.num_computed = len(seq.tokens)
        seq.num_registered_blocks = full
        self.pool.record_prefix_query(len(seq.tokens), len(seq.tokens))
        return Planned(seq, len(seq.tokens), 0, len(seq.tokens), result_index, kept=kept)

    def _find_cached(self, seq: SequenceState) -> tuple[list[int], tuple[int, int] | None]:
        """`seq`'s leading cached full blocks, and the cached block (full or a kept partial)
        after them that shares the longest run of `seq`'s next tokens, with that run's
        length: its slots are copied into a block of `seq`'s own. An identical prompt
        copies its whole tail; a prompt that differs inside a block keeps the part before."""
        hashes = seq.full_block_hashes(self.block_size)
        # Keep at least the last token to compute: its logits give the next token.
        reusable = (len(seq.tokens) - 1) // self.block_size
        blocks = self._usable(self.pool.find_cached_prefix(hashes[:reusable]))
        start = len(blocks) * self.block_size
        tail = seq.tokens[start:start + self.block_size]
        if len(tail) < 2:
            return blocks, None
        return blocks, self._attached_tail(self.pool.find_longest_tail(parent_of(hashes, len(blocks)), tail,
                                                                       seq.cache_salt))

    def _usable(self, blocks: list[int]) -> list[int]:
        """The leading cached `blocks` whose last window the sliding group still holds."""
        return blocks if self.sliding is None else blocks[:self.sliding.usable_prefix(blocks)]

    def _attached_tail(self, tail: tuple[int, int] | None) -> tuple[int, int] | None:
        """`tail` unless its block's sliding-group K/V are gone."""
        if tail is None or self.sliding is None or self.sliding.attached(tail[0]):
            return tail
        return None

    def _sliding_room(self, seq: SequenceState, start: int, num_tokens: int) -> int:
        """`num_tokens`, cut so that the chunk's window fits the sliding group at all."""
        if self.sliding is None:
            return num_tokens
        first = start - seq.evicted
        room = (self.sliding.num_blocks + self.sliding.first_in_window(first)) * self.block_size - first
        return max(1, min(num_tokens, room))

    def _allocate(self, seq: SequenceState, num_tokens: int, cached_blocks: list[int],
                  tail_source: int | None, copied: int, first_query: int) -> bool:
        """Grows `seq`'s table to `num_tokens` tokens (cache positions), and the sliding
        group's cover to the window from `first_query` on; with a tail source, copies its
        first `copied` slots into the block after the cached ones."""
        sources = () if tail_source is None else (tail_source,)
        window_start = self.sliding.first_in_window(first_query) if self.sliding is not None else 0
        if self.sliding is not None and not self._sliding_fits(seq, num_tokens, cached_blocks, sources,
                                                               window_start, first_query):
            return False
        for source in sources:
            self.pool.hold(source)     # the allocation must not evict the block copied from
        try:
            if not self.pool.allocate(seq.seq_id, num_tokens, cached_blocks):
                return False
            table = self.pool.table(seq.seq_id)
            if self.sliding is not None and not self.sliding.cover(seq.seq_id, table[window_start:], sources):
                raise AssertionError("the sliding group could not cover what it said it could")
            if tail_source is not None:
                self._copy_tail(tail_source, table[len(cached_blocks)], copied)
        finally:
            for source in sources:
                self.pool.release(source)
        return True

    def _sliding_fits(self, seq: SequenceState, num_tokens: int, cached_blocks: list[int],
                      sources: tuple[int, ...], window_start: int, first_query: int) -> bool:
        """Whether the sliding group can cover `seq`'s window from entry `window_start` once
        its table covers `num_tokens` tokens; raises when a computed window block lost its copy."""
        assert self.sliding is not None
        table = self.pool.table(seq.seq_id) or cached_blocks
        new = max(0, self.pool.blocks_for(num_tokens) - len(table))
        if not new and not sources and self.sliding.covers(seq.seq_id, table[window_start:]):
            return True     # most decodes: the window pinned last step, nothing to attach
        computed = table[window_start:self.pool.blocks_for(first_query)]
        if not all(self.sliding.attached(block) for block in computed):
            raise RuntimeError(f"{seq.seq_id}: the sliding layers' K/V of its window are gone")
        return self.sliding.can_cover(table[window_start:], new, sources, seq.seq_id)

    def _copy_tail(self, source: int, target: int, copied: int) -> None:
        self.kv.copy_slots(source, target, copied)
        if self.sliding is not None:
            self.kv.copy_slots(self.sliding.sliding_of(source), self.sliding.sliding_of(target), copied,
                               SLIDING_GROUP)
