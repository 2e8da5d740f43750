"""Plain values in and out of Engine.step; the worker's convert.py maps them to protobuf."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.types import SamplingParams, TokenLogprob


@dataclass
class NewSequence:
    seq_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)   # already generated (resume after preemption)
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class WorkItem:
    seq_id: str
    max_tokens: int     # compute at most this many not-yet-computed tokens
    draft_tokens: int = 0  # a decode may also verify up to this many speculative tokens


@dataclass
class StepBatch:
    new_sequences: list[NewSequence] = field(default_factory=list)
    work: list[WorkItem] = field(default_factory=list)
    free_seq_ids: list[str] = field(default_factory=list)


# Error strings a SeqResult may carry.
OUT_OF_BLOCKS = "out_of_blocks"
UNKNOWN_SEQUENCE = "unknown_sequence"
NOTHING_TO_COMPUTE = "nothing_to_compute"
DUPLICATE_WORK = "duplicate_work"
INVALID_MAX_TOKENS = "invalid_max_tokens"
EXCEEDS_MAX_MODEL_LEN = "exceeds_max_model_len"


@dataclass
class SeqResult:
    seq_id: str
    num_computed_tokens: int
    num_cached_tokens: int = 0
    sampled: bool = False
    token_id: int = -1
    logprob: TokenLogprob | None = None
    error: str = ""
    # Accepted speculative tokens and the one sampled after them, following token_id.
    more_token_ids: list[int] = field(default_factory=list)
    more_logprobs: list[TokenLogprob | None] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        """Every token this result sampled, in order."""
        return [self.token_id, *self.more_token_ids] if self.sampled else []


@dataclass(frozen=True)
class PoolStats:
    total_blocks: int
    free_blocks: int        # unreferenced and holding no published prefix (partial blocks included)
    cached_blocks: int      # unreferenced, still holding a reusable prefix the KV index knows
    used_blocks: int        # referenced by at least one sequence
    evictions: int
    prefix_hit_tokens: int
    prefix_query_tokens: int


STORED = "stored"
REMOVED = "removed"
CLEARED = "cleared"


@dataclass(frozen=True)
class BlockEvent:
    kind: str                          # STORED | REMOVED | CLEARED
    hashes: tuple[int, ...] = ()       # STORED: in prefix order
    parent_hash: int = 0               # STORED: hash of the block before hashes[0] (0 = root)
    partial_hash: int = 0              # STORED: a whole prompt's partial last block after the chain

    @staticmethod
    def stored(hashes: list[int], parent_hash: int, partial_hash: int = 0) -> BlockEvent:
        return BlockEvent(STORED, tuple(hashes), parent_hash, partial_hash)

    @staticmethod
    def removed(hashes: list[int]) -> BlockEvent:
        return BlockEvent(REMOVED, tuple(hashes))

    @staticmethod
    def cleared() -> BlockEvent:
        return BlockEvent(CLEARED)


@dataclass
class StepOutput:
    results: list[SeqResult]
    pool: PoolStats
    forward_ms: float = 0.0
    batch_tokens: int = 0
    prompt_tokens: int = 0      # of batch_tokens, those at prompt positions (prefill, not decode)
    prompt_logits_hits: int = 0 # sequences that sampled from kept prompt logits, computing nothing
    graph_replayed: bool = False  # the forward replayed a captured decode graph
    draft_tokens: int = 0       # speculative tokens verified
    accepted_tokens: int = 0    # of those, the ones kept
    screened_rows: int = 0      # sampled rows whose logits came from the LM head screen
    full_rows: int = 0          # sampled rows whose logits came from the full LM head


@dataclass(frozen=True)
class EngineInfo:
    model_name: str
    block_size: int
    num_blocks: int
    device: str
    dtype: str
    max_model_len: int
    eos_token_ids: list[int]
    vocab_size: int
