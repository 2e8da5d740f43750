"""A fake worker engine that keeps the Step contract and real block
accounting (reference counts, a prefix cache of full blocks with LRU
eviction, shared only between sequences with the same cache salt) without a
model. Its "greedy" token is a pure function of the
sequence's tokens, so outputs can be compared across schedules."""

from __future__ import annotations

import zlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from common.types import TokenLogprob

from common.step import PoolStats, SeqResult, StepBatch, StepError, StepOutput
from services.scheduler.core.types import WorkerSpec

EOS_TOKEN_ID = 1
VOCAB_SIZE = 1000


def hashed_next_token(tokens: Sequence[int]) -> int:
    """Never EOS: ids 2..VOCAB_SIZE-1, a function of the whole prefix."""
    digest = zlib.crc32(array("i", tokens).tobytes())
    return 2 + digest % (VOCAB_SIZE - 2)


def reference_output(prompt: Sequence[int], num_tokens: int,
                     next_token: Callable[[Sequence[int]], int] = hashed_next_token) -> list[int]:
    tokens = list(prompt)
    for _ in range(num_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


@dataclass
class FakeSequence:
    tokens: list[int]
    want_logprobs: bool
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    reported: bool = False
    cache_salt: str = ""


BlockKey = tuple[str, tuple[int, ...]]   # (cache salt, the tokens up to the block's end)


class FakeEngine:
    def __init__(self, num_blocks: int = 64, block_size: int = 4, max_model_len: int = 4096,
                 next_token: Callable[[Sequence[int]], int] = hashed_next_token,
                 prefix_caching: bool = True, overstate_free_blocks: int = 0,
                 accepted_drafts: int = 0) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.next_token = next_token
        self.prefix_caching = prefix_caching
        # Makes the reported pool look bigger than it is, so that the
        # scheduler's estimate is wrong and the worker answers out_of_blocks.
        self.overstate_free_blocks = overstate_free_blocks
        # Speculation: of the drafts a decode may verify, this many are "accepted"
        # (they are the true next tokens, so outputs do not change).
        self.accepted_drafts = accepted_drafts
        self.refcount = [0] * num_blocks
        self.block_key: list[BlockKey | None] = [None] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.cached_blocks: OrderedDict[int, None] = OrderedDict()  # LRU first
        self.by_key: dict[BlockKey, int] = {}
        self.seqs: dict[str, FakeSequence] = {}
        self.steps: list[StepBatch] = []
        self.out_of_blocks_errors = 0

    def spec(self, worker_id: str = "w0", address: str = "fake") -> WorkerSpec:
        return WorkerSpec(worker_id=worker_id, address=address, block_size=self.block_size,
                          num_blocks=self.num_blocks, max_model_len=self.max_model_len,
                          eos_token_ids=frozenset({EOS_TOKEN_ID}))

    # ---- the Step contract ----

    def step(self, plan: StepBatch) -> StepOutput:
        self.steps.append(plan)
        for seq_id in plan.free_seq_ids:
            self._free(seq_id)
        for new in plan.new_sequences:
            self._register(new.seq_id, [*new.prompt_token_ids, *new.output_token_ids],
                           new.sampling.logprobs, new.cache_salt)
        results = tuple(self._work(item.seq_id, item.num_tokens, item.draft_tokens) for item in plan.work)
        self.check_invariants()
        return StepOutput(step_id=plan.step_id, results=results, pool=self.pool(), forward_ms=1.0)

    def pool(self) -> PoolStats:
        used = sum(1 for r in self.refcount if r > 0)
        return PoolStats(total_blocks=self.num_blocks,
                            free_blocks=len(self.free_blocks) + self.overstate_free_blocks,
                            cached_blocks=len(self.cached_blocks), used_blocks=used)

    # ---- internals ----

    def _register(self, seq_id: str, tokens: list[int], want_logprobs: bool, cache_salt: str = "") -> None:
        if seq_id in self.seqs:
            self._free(seq_id)
        seq = FakeSequence(tokens=tokens, want_logprobs=want_logprobs, cache_salt=cache_salt)
        if self.prefix_caching:
            # At least one token stays uncomputed so that the step can sample.
            for index in range((len(tokens) - 1) // self.block_size):
                block = self.by_key.get((cache_salt, tuple(tokens[: (index + 1) * self.block_size])))
                if block is None:
                    break
                self._take_ref(block)
                seq.blocks.append(block)
            seq.computed = seq.cached_tokens = len(seq.blocks) * self.block_size
        self.seqs[seq_id] = seq

    def _work(self, seq_id: str, max_tokens: int, draft_tokens: int = 0) -> SeqResult:
        seq = self.seqs.get(seq_id)
        if seq is None:
            return SeqResult(seq_id=seq_id, error=StepError.UNKNOWN_SEQUENCE)
        count = min(max_tokens, len(seq.tokens) - seq.computed)
        if count <= 0:
            return SeqResult(seq_id=seq_id, error=StepError.NOTHING_TO_COMPUTE)
        needed = -(-(seq.computed + count) // self.block_size) - len(seq.blocks)
        if needed > len(self.free_blocks) + len(self.cached_blocks):
            self.out_of_blocks_errors += 1
            return SeqResult(seq_id=seq_id, num_computed_tokens=seq.computed, error=StepError.OUT_OF_BLOCKS)
        drafts = min(draft_tokens, self.accepted_drafts) if len(seq.tokens) - seq.computed == 1 else 0
        extra = -(-(seq.computed + count + drafts) // self.block_size) - len(seq.blocks) - needed
        if drafts and needed + extra > len(self.free_blocks) + len(self.cached_blocks):
            drafts, extra = 0, 0
        for _ in range(needed + extra):
            seq.blocks.append(self._allocate())
        seq.computed += count
        more: list[int] = []
        for _ in range(drafts):
            more.append(self.next_token(seq.tokens + more))
        seq.tokens.extend(more)
        seq.computed += drafts
        self._publish_full_blocks(seq)
        cached = 0 if seq.reported else seq.cached_tokens
        seq.reported = True
        if seq.computed < len(seq.tokens):
            return SeqResult(seq_id=seq_id, num_computed_tokens=seq.computed, num_cached_tokens=cached)
        token = self.next_token(seq.tokens)
        seq.tokens.append(token)
        logprob = TokenLogprob(logprob=-0.5) if seq.want_logprobs else None
        emitted = [*more, token]
        return SeqResult(seq_id=seq_id, num_computed_tokens=seq.computed, num_cached_tokens=cached,
                         sampled=True, token_id=emitted[0], logprob=logprob,
                         more_token_ids=tuple(emitted[1:]),
                         more_logprobs=tuple(logprob for _ in emitted[1:]) if logprob is not None else ())

    def _publish_full_blocks(self, seq: FakeSequence) -> None:
        if not self.prefix_caching:
            return
        for index in range(seq.computed // self.block_size):
            block = seq.blocks[index]
            if self.block_key[block] is not None:
                continue
            key = (seq.cache_salt, tuple(seq.tokens[: (index + 1) * self.block_size]))
            if key not in self.by_key:
                self.by_key[key] = block
                self.block_key[block] = key

    def _allocate(self) -> int:
        if self.free_blocks:
            block = self.free_blocks.popleft()
        else:
            block, _ = self.cached_blocks.popitem(last=False)
            key = self.block_key[block]
            assert key is not None
            del self.by_key[key]
            self.block_key[block] = None
        self.refcount[block] = 1
        return block

    def _take_ref(self, block: int) -> None:
        if self.refcount[block] == 0:
            del self.cached_blocks[block]
        self.refcount[block] += 1

    def _free(self, seq_id: str) -> None:
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            return
        for block in seq.blocks:
            self.refcount[block] -= 1
            if self.refcount[block] == 0:
                if self.block_key[block] is not None:
                    self.cached_blocks[block] = None
                else:
                    self.free_blocks.append(block)

    def check_invariants(self) -> None:
        held = [0] * self.num_blocks
        for seq in self.seqs.values():
            for block in seq.blocks:
                held[block] += 1
        assert held == self.refcount, "reference counts disagree with the sequences' blocks"
        free, cached = set(self.free_blocks), set(self.cached_blocks)
        used = {b for b in range(self.num_blocks) if self.refcount[b] > 0}
        assert not (free & cached) and not (free & used) and not (cached & used)
        assert len(free) + len(cached) + len(used) == self.num_blocks, "a block was lost"
        assert all(self.block_key[b] is not None for b in cached)
