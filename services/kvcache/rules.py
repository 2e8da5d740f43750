"""Rules every index backend shares: event validation, the order in which a
resync snapshot is applied, and how prefix matches become lookup results."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from common.block_hash import ROOT_HASH
from services.kvcache.kv_types import (
    BlockRemoved, BlockStored, EventBody, KvEvent, LookupQuery, WorkerMatch,
)


def validate_chain(chain: BlockStored) -> None:
    """Raises ValueError for a chain no worker can hold: a zero hash, or a
    hash repeated (a chained hash cannot come back)."""
    blocks = chain.block_hashes
    if any(block == ROOT_HASH for block in blocks):
        raise ValueError("block hash 0 is reserved for the root")
    if len(set(blocks)) != len(blocks) or chain.parent_hash in blocks:
        raise ValueError("a chain repeats a block hash")


def validate_event(body: EventBody) -> None:
    if isinstance(body, BlockStored):
        validate_chain(body)
    elif isinstance(body, BlockRemoved) and ROOT_HASH in body.block_hashes:
        raise ValueError("block hash 0 is reserved for the root")


def order_chains(chains: Iterable[BlockStored]) -> tuple[list[BlockStored], int]:
    """Orders a snapshot so that every chain comes after the one holding its
    parent. Chains whose parent no chain holds cannot be reached from the
    root and are dropped; returns (ordered, number dropped)."""
    waiting: dict[int, list[BlockStored]] = {}
    ready: list[BlockStored] = []
    total = 0
    for chain in chains:
        total += 1
        if chain.parent_hash == ROOT_HASH:
            ready.append(chain)
        else:
            waiting.setdefault(chain.parent_hash, []).append(chain)
    ordered: list[BlockStored] = []
    while ready:
        chain = ready.pop()
        ordered.append(chain)
        for block in chain.block_hashes:
            ready.extend(waiting.pop(block, ()))
    return ordered, total - len(ordered)


@dataclass(frozen=True)
class SeqPlan:
    """What to do with an incremental batch given the worker's last seq."""

    apply: tuple[KvEvent, ...]
    gap: bool


def plan_events(last_seq: int | None, events: Sequence[KvEvent]) -> SeqPlan:
    """Duplicates (seq <= last) are skipped, the next seqs applied in order,
    and the first gap stops the batch. An unknown worker (None) must resync
    first: the index may have lost what it published before."""
    if last_seq is None:
        return SeqPlan((), True)
    expected = last_seq + 1
    to_apply: list[KvEvent] = []
    for event in events:
        if event.seq < expected:
            continue
        if event.seq != expected:
            return SeqPlan(tuple(to_apply), True)
        to_apply.append(event)
        expected += 1
    return SeqPlan(tuple(to_apply), False)


def combine_matches(prefix: Mapping[str, int], partial_holders: Iterable[str],
                    query: LookupQuery, block_size: int) -> list[WorkerMatch]:
    """Per worker: the longest cached prefix of the query, longest first.
    A match is exact when the worker holds every full block and, if the
    prompt has a partial last block, that block too."""
    num_blocks = len(query.block_hashes)
    holders = set(partial_holders)
    matches: list[WorkerMatch] = []
    for worker, blocks in prefix.items():
        if blocks <= 0:
            continue
        exact = blocks == num_blocks and (worker in holders if query.partial_hash else True)
        matches.append(_match(worker, blocks, exact, query, block_size))
    if num_blocks == 0 and query.partial_hash:
        matches.extend(_match(worker, 0, True, query, block_size) for worker in holders)
    return sort_matches(matches)


def _match(worker: str, blocks: int, exact: bool, query: LookupQuery,
           block_size: int) -> WorkerMatch:
    with_partial = exact and query.partial_hash != 0
    tokens = blocks * block_size + (query.partial_tokens if with_partial else 0)
    return WorkerMatch(worker, blocks, tokens, exact)


def sort_matches(matches: Iterable[WorkerMatch]) -> list[WorkerMatch]:
    return sorted(matches, key=lambda m: (-m.matched_tokens, not m.exact, m.worker_id))
