"""Protobuf <-> the plain dataclasses of kv_types, both directions (the
server and the clients use the same functions)."""

from __future__ import annotations

from fairserve.v1 import kvindex_pb2

from services.kvcache.kv_types import (
    AllCleared, BlockRemoved, BlockStored, EventBody, IndexStats, KvEvent, LookupQuery,
    LookupResult, PublishBatch, PublishResult, RecordedLookup, WorkerMatch,
)


def chain_from_proto(message: kvindex_pb2.BlockStored) -> BlockStored:
    return BlockStored(message.parent_hash, tuple(message.block_hashes), message.partial_hash)


def chain_to_proto(chain: BlockStored) -> kvindex_pb2.BlockStored:
    return kvindex_pb2.BlockStored(block_hashes=chain.block_hashes,
                                   parent_hash=chain.parent_hash,
                                   partial_hash=chain.partial_hash)


def event_from_proto(message: kvindex_pb2.KvEvent) -> KvEvent:
    kind = message.WhichOneof("kind")
    body: EventBody
    if kind == "stored":
        body = chain_from_proto(message.stored)
    elif kind == "removed":
        body = BlockRemoved(tuple(message.removed.block_hashes))
    elif kind == "cleared":
        body = AllCleared()
    else:
        raise ValueError(f"event {message.seq} has no kind")
    return KvEvent(message.seq, body)


def event_to_proto(event: KvEvent) -> kvindex_pb2.KvEvent:
    body = event.body
    if isinstance(body, BlockStored):
        return kvindex_pb2.KvEvent(seq=event.seq, stored=chain_to_proto(body))
    if isinstance(body, BlockRemoved):
        return kvindex_pb2.KvEvent(
            seq=event.seq, removed=kvindex_pb2.BlockRemoved(block_hashes=body.block_hashes))
    return kvindex_pb2.KvEvent(seq=event.seq, cleared=kvindex_pb2.AllCleared())


def publish_from_proto(request: kvindex_pb2.PublishRequest) -> PublishBatch:
    if request.full_resync:
        return PublishBatch(request.worker_id, full_resync=True,
                            snapshot=tuple(chain_from_proto(c) for c in request.snapshot),
                            snapshot_seq=request.snapshot_seq)
    return PublishBatch(request.worker_id, tuple(event_from_proto(e) for e in request.events))


def publish_to_proto(batch: PublishBatch) -> kvindex_pb2.PublishRequest:
    return kvindex_pb2.PublishRequest(
        worker_id=batch.worker_id,
        events=[event_to_proto(e) for e in batch.events],
        full_resync=batch.full_resync,
        snapshot=[chain_to_proto(c) for c in batch.snapshot],
        snapshot_seq=batch.snapshot_seq,
    )


def publish_result_to_proto(result: PublishResult) -> kvindex_pb2.PublishResponse:
    return kvindex_pb2.PublishResponse(resync_needed=result.resync_needed, next_seq=result.next_seq)


def publish_result_from_proto(message: kvindex_pb2.PublishResponse) -> PublishResult:
    return PublishResult(message.resync_needed, message.next_seq)


def lookup_query_from_proto(request: kvindex_pb2.LookupRequest) -> LookupQuery:
    """Only for block-hash lookups; token lookups go through the service."""
    return LookupQuery(tuple(request.block_hashes), request.partial_hash, request.partial_tokens)


def lookup_result_to_proto(result: LookupResult) -> kvindex_pb2.LookupResponse:
    return kvindex_pb2.LookupResponse(
        matches=[kvindex_pb2.WorkerMatch(worker_id=m.worker_id, matched_blocks=m.matched_blocks,
                                         matched_tokens=m.matched_tokens, exact=m.exact)
                 for m in result.matches],
        block_size=result.block_size,
    )


def lookup_result_from_proto(message: kvindex_pb2.LookupResponse) -> LookupResult:
    return LookupResult(
        tuple(WorkerMatch(m.worker_id, m.matched_blocks, m.matched_tokens, m.exact)
              for m in message.matches),
        message.block_size,
    )


def recorded_lookup_from_proto(message: kvindex_pb2.RecordedLookup) -> RecordedLookup:
    return RecordedLookup(message.prompt_tokens, message.cached_tokens, message.request_id)


def recorded_lookup_to_proto(lookup: RecordedLookup) -> kvindex_pb2.RecordedLookup:
    return kvindex_pb2.RecordedLookup(prompt_tokens=lookup.prompt_tokens, cached_tokens=lookup.cached_tokens,
                                      request_id=lookup.request_id)


def stats_to_proto(stats: IndexStats) -> kvindex_pb2.KvIndexStats:
    return kvindex_pb2.KvIndexStats(
        lookups=stats.lookups, hits=stats.hits, lookup_tokens=stats.lookup_tokens,
        hit_tokens=stats.hit_tokens, nodes=stats.nodes, events=stats.events,
        resyncs=stats.resyncs, blocks_by_worker=stats.blocks_by_worker, backend=stats.backend,
    )


def stats_from_proto(message: kvindex_pb2.KvIndexStats) -> IndexStats:
    return IndexStats(
        lookups=message.lookups, hits=message.hits, lookup_tokens=message.lookup_tokens,
        hit_tokens=message.hit_tokens, nodes=message.nodes, events=message.events,
        resyncs=message.resyncs, blocks_by_worker=dict(message.blocks_by_worker),
        backend=message.backend,
    )
