"""Forwards the engine's KV block events to the index service."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable

from services.kvcache.kv_types import BlockStored
from services.kvcache.publisher import KvEventPublisher
from services.worker.engine.types import CLEARED, REMOVED, STORED, BlockEvent

ChainsFn = Callable[[], Awaitable[list[tuple[int, list[int]]]]]


def add_events(publisher: KvEventPublisher, events: Iterable[BlockEvent]) -> None:
    for event in events:
        if event.kind == STORED:
            publisher.stored(event.parent_hash, event.hashes)
        elif event.kind == REMOVED:
            publisher.removed(event.hashes)
        elif event.kind == CLEARED:
            publisher.cleared()


def snapshot_source(chains: ChainsFn) -> Callable[[], Awaitable[list[BlockStored]]]:
    """Adapts the engine's (parent, hashes) chains to the publisher's snapshot."""
    async def snapshot() -> list[BlockStored]:
        return [BlockStored(parent, tuple(hashes)) for parent, hashes in await chains() if hashes]
    return snapshot
