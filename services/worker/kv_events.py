"""Forwards the engine's KV block events to the index service."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable

from services.kvcache.kv_types import BlockStored
from services.kvcache.publisher import KvEventPublisher
from services.worker.engine.types import CLEARED, REMOVED, STORED, BlockEvent

# The engine's cache now: (parent, hashes) chains, and (parent, partial hash) of
# whole prompts' partial last blocks.
CacheSnapshot = tuple[list[tuple[int, list[int]]], list[tuple[int, int]]]
SnapshotFn = Callable[[], Awaitable[CacheSnapshot]]


def add_events(publisher: KvEventPublisher, events: Iterable[BlockEvent]) -> None:
    for event in events:
        if event.kind == STORED:
            publisher.stored(event.parent_hash, event.hashes, event.partial_hash)
        elif event.kind == REMOVED:
            publisher.removed(event.hashes)
        elif event.kind == CLEARED:
            publisher.cleared()


def snapshot_source(cache: SnapshotFn) -> Callable[[], Awaitable[list[BlockStored]]]:
    """Adapts the engine's chains and partial blocks to the publisher's snapshot."""
    async def snapshot() -> list[BlockStored]:
        chains, partials = await cache()
        return ([BlockStored(parent, tuple(hashes)) for parent, hashes in chains if hashes]
                + [BlockStored(parent, (), partial) for parent, partial in partials])
    return snapshot
