"""Plain data shared by the index core, its backends, the service and the
workers' publisher. No protobuf here: convert.py translates at the edge."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BlockStored:
    """A chain of full blocks hanging off `parent_hash` (0: the root), in
    prefix order, optionally ending in a whole prompt's partial last block."""

    parent_hash: int
    block_hashes: tuple[int, ...]
    partial_hash: int = 0

    @property
    def last_hash(self) -> int:
        return self.block_hashes[-1] if self.block_hashes else self.parent_hash


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class AllCleared:
    pass


EventBody = BlockStored | BlockRemoved | AllCleared


@dataclass(frozen=True)
class KvEvent:
    seq: int
    body: EventBody


@dataclass(frozen=True)
class PublishBatch:
    """One Publish call: incremental events, or a full resync that replaces
    everything the index holds for the worker."""

    worker_id: str
    events: tuple[KvEvent, ...] = ()
    full_resync: bool = False
    snapshot: tuple[BlockStored, ...] = ()
    snapshot_seq: int = 0


@dataclass(frozen=True)
class PublishResult:
    resync_needed: bool
    next_seq: int


@dataclass(frozen=True)
class LookupQuery:
    block_hashes: tuple[int, ...]
    partial_hash: int = 0
    partial_tokens: int = 0

    def num_tokens(self, block_size: int) -> int:
        return len(self.block_hashes) * block_size + self.partial_tokens


@dataclass(frozen=True)
class WorkerMatch:
    worker_id: str
    matched_blocks: int
    matched_tokens: int
    exact: bool = False


@dataclass(frozen=True)
class LookupResult:
    matches: tuple[WorkerMatch, ...]  # longest first
    block_size: int

    @property
    def best(self) -> WorkerMatch | None:
        return self.matches[0] if self.matches else None

    def for_worker(self, worker_id: str) -> WorkerMatch | None:
        return next((m for m in self.matches if m.worker_id == worker_id), None)


@dataclass(frozen=True)
class RecordedLookup:
    """A lookup nobody needed to ask (one worker: nothing to route), recorded after the fact:
    the request's prompt and what its worker took from the prefix cache."""
    prompt_tokens: int
    cached_tokens: int
    request_id: str = ""

    def check(self) -> None:
        """ValueError unless 0 <= cached_tokens <= prompt_tokens."""
        if not 0 <= self.cached_tokens <= self.prompt_tokens:
            raise ValueError(f"a recorded lookup needs 0 <= cached_tokens <= prompt_tokens, got "
                             f"{self.cached_tokens} of {self.prompt_tokens}")


@dataclass(frozen=True)
class IndexStats:
    lookups: int = 0
    hits: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    nodes: int = 0
    events: int = 0
    resyncs: int = 0
    blocks_by_worker: dict[str, int] = field(default_factory=dict)
    backend: str = ""

    @property
    def hit_rate_tokens(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0
