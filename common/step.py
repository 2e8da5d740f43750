"""The step contract as plain values: what the scheduler sends a worker for one forward and what
comes back (worker.proto's Step). The scheduler's core and the worker's engine both use these
types; each service's convert.py maps them to and from protobuf.

Semantics (the worker runs them in this order): frees, then new sequences, then each work item
computes up to `num_tokens` of its sequence's not-yet-computed tokens; when that reaches the end
of the known tokens, the worker samples one token (plus any speculative drafts it kept). A work
item that fails carries a StepError and changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from common.types import SamplingParams, TokenLogprob


class StepError(StrEnum):
    """Why a work item failed; worker.proto's StepError, member for member (NONE is its 0)."""

    NONE = ""
    OUT_OF_BLOCKS = "out_of_blocks"            # the pool cannot hold it; nothing changed (preempt)
    UNKNOWN_SEQUENCE = "unknown_sequence"      # no such sequence on this worker
    NOTHING_TO_COMPUTE = "nothing_to_compute"  # every known token is already computed
    DUPLICATE_WORK = "duplicate_work"          # a second work item for one sequence in a step
    INVALID_NUM_TOKENS = "invalid_num_tokens"  # num_tokens <= 0
    EXCEEDS_MAX_MODEL_LEN = "exceeds_max_model_len"
    INTERNAL = "internal"                      # the worker failed this sequence (or sent an unknown code)


KV_POLICIES = ("full", "window", "sink", "h2o")


@dataclass(frozen=True)
class KvPolicy:
    """What a sequence's KV cache keeps once it holds `budget_tokens` (lossy policies only):
    window  the most recent tokens;
    sink    the first `sink_tokens` (the attention sinks) plus the most recent;
    h2o     the blocks with the most accumulated attention plus the most recent.
    Block granular (the worker rounds both up to whole blocks); positions are assigned
    within the cache (StreamingLLM), so such a sequence can run past the model's context.
    "full" keeps everything (the default)."""

    kind: str = "full"
    budget_tokens: int = 0
    sink_tokens: int = 0

    @property
    def lossy(self) -> bool:
        return self.kind != "full"

    def sink_blocks(self, block_size: int) -> int:
        return -(-self.sink_tokens // block_size) if self.kind == "sink" else 0

    def cache_blocks(self, block_size: int) -> int:
        """The most blocks a lossy sequence holds (0 for "full": no bound): its budget in whole
        blocks, and at least its sinks plus two (the partial last block and one to drop)."""
        if not self.lossy:
            return 0
        return max(-(-self.budget_tokens // block_size), self.sink_blocks(block_size) + 2)


@dataclass(frozen=True)
class NewSequence:
    """A sequence's full data; it travels once (again when resumed after a preemption, with the
    tokens it had already generated)."""

    seq_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...] = ()
    sampling: SamplingParams = SamplingParams()
    cache_salt: str = ""    # mixed into its block hashes: other salts never share its cached blocks
    kv_policy: KvPolicy = KvPolicy()
    # A LoRA adapter serving it (empty: the base model): its name, the directory it loads from
    # when the worker does not know the name (inside the worker's LORA_ROOT) and its weights' digest.
    lora_name: str = ""
    lora_path: str = ""
    lora_digest: str = ""


MAX_DECODE_STEPS = 64   # the most runs a worker serves in one step; a larger ask is served as this many


@dataclass(frozen=True)
class WorkItem:
    seq_id: str
    num_tokens: int         # compute at most this many of the sequence's not-yet-computed tokens
    draft_tokens: int = 0   # a decode may also verify up to this many speculative tokens
    # A decode may run up to this many times in the step (multi-step decoding,
    # services/worker/decode_steps.py), each verifying up to draft_tokens drafts.
    decode_steps: int = 1
    # The most tokens its result may carry over all its runs (0: no cap but the runs' own): the
    # worker starts no run once the result holds this many and lets a run verify no more drafts
    # than would pass it, so runs need not be counted at their worst case against max_tokens.
    max_outputs: int = 0

    @property
    def extra_tokens(self) -> int:
        """The most tokens its result may carry beyond the one sampled token."""
        most = self.decode_steps * (1 + self.draft_tokens)
        return (min(most, self.max_outputs) if self.max_outputs > 0 else most) - 1


@dataclass(frozen=True)
class StepBatch:
    step_id: int = 0
    new_sequences: tuple[NewSequence, ...] = ()
    work: tuple[WorkItem, ...] = ()
    free_seq_ids: tuple[str, ...] = ()
    after_step_id: int = 0  # run only after that step of this scheduler has finished (0: none in flight)
    # The worker's registration with the scheduler; a larger one than the worker
    # has seen frees its sequences of earlier epochs first (their scheduler is gone).
    epoch: int = 0
    # Quick runs: no further run once the next would end past this many ms of the step's
    # runs (services/worker/decode_steps.py); 0: no bound.
    runs_ms: float = 0.0

    @property
    def num_tokens(self) -> int:
        return sum(item.num_tokens for item in self.work)


@dataclass
class SeqResult:
    """One work item's outcome. The worker fills in what it sampled as the step commits."""

    seq_id: str
    num_computed_tokens: int = 0     # tokens of the sequence with K/V in the pool
    num_cached_tokens: int = 0       # of those, taken from the prefix cache in this step
    sampled: bool = False
    token_id: int = -1
    logprob: TokenLogprob | None = None
    error: StepError = StepError.NONE
    # Accepted speculative tokens and the one sampled after them, following token_id.
    more_token_ids: tuple[int, ...] = ()
    more_logprobs: tuple[TokenLogprob | None, ...] = ()
    # A request with prompt_logprobs: the logprobs of its prompt tokens at positions
    # prompt_logprobs_start, prompt_logprobs_start + 1, ... that this step's chunk scored
    # (each token given the ones before it; position 0 never has one).
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs_start: int = 0

    @property
    def token_ids(self) -> tuple[int, ...]:
        """Every token this result sampled, in order."""
        return (self.token_id, *self.more_token_ids) if self.sampled else ()


@dataclass(frozen=True)
class PoolStats:
    total_blocks: int
    free_blocks: int           # unreferenced and holding no published prefix (partial blocks included)
    cached_blocks: int         # unreferenced, still holding a reusable prefix the KV index knows
    used_blocks: int           # referenced by at least one sequence
    evictions: int = 0         # cached blocks evicted since the worker started
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0

    @property
    def available_blocks(self) -> int:
        """Blocks an allocation can take: never used, or evictable."""
        return self.free_blocks + self.cached_blocks


@dataclass(frozen=True)
class StepOutput:
    """A step's reply. The counters after step_id are what the engine measured for the worker's
    own metrics; they do not travel to the scheduler."""

    results: tuple[SeqResult, ...]
    pool: PoolStats
    forward_ms: float = 0.0
    # The runs the step ran (multi-step decoding: fewer than asked where every sequence stopped
    # early); 0: not counted (a worker before this field), read as the runs asked for.
    runs: int = 0
    step_id: int = 0
    batch_tokens: int = 0
    prompt_tokens: int = 0      # of batch_tokens, those at prompt positions (prefill, not decode)
    prompt_logits_hits: int = 0 # sequences that sampled from kept prompt logits, computing nothing
    graph_replayed: bool = False  # the forward replayed a captured decode graph
    draft_tokens: int = 0       # speculative tokens verified
    accepted_tokens: int = 0    # of those, the ones kept
    screened_rows: int = 0      # sampled rows whose logits came from the LM head screen
    full_rows: int = 0          # sampled rows whose logits came from the full LM head
