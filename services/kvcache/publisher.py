"""Worker side of the index protocol: numbers the worker's block events,
sends them in batches, and answers a resync request with a full snapshot.

The transport is an injected async callable (PublishBatch -> PublishResult)
and the snapshot an injected callable (plain or async) returning the chains
the worker holds now, so this class runs without gRPC or an engine.

Protocol: every event gets the next seq. The first flush is always a full
resync (snapshot_seq = the last seq handed out), so a restarted worker
replaces whatever the index remembered about it. Events stay pending until
the index acknowledges them (next_seq); re-sending after a transport error is
safe because the index skips seqs it already applied. When the index answers
resync_needed, pending events are dropped: the snapshot covers them.

An index that restarted without its state (in memory, or a Redis that lost
its data) knows nothing of this worker and answers the next publish with
resync_needed. So that an idle worker is re-indexed too, run() sends an empty
batch when nothing has reached the index for keepalive_s: the same answer
comes back, and the snapshot follows.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from collections.abc import Awaitable, Callable, Iterable, Sequence

from services.kvcache.kv_types import (
    AllCleared, BlockRemoved, BlockStored, EventBody, KvEvent, PublishBatch, PublishResult,
)

log = logging.getLogger(__name__)

SendFn = Callable[[PublishBatch], Awaitable[PublishResult]]
# The chains the worker holds now; may be a coroutine (e.g. run on the engine's thread).
SnapshotFn = Callable[[], Iterable[BlockStored] | Awaitable[Iterable[BlockStored]]]


class KvEventPublisher:
    def __init__(self, worker_id: str, send: SendFn, snapshot: SnapshotFn,
                 max_batch_events: int = 512, max_pending_events: int = 50_000,
                 max_resyncs_per_flush: int = 3, keepalive_s: float = 2.0) -> None:
        self.worker_id = worker_id
        self._send = send
        self._snapshot = snapshot
        self._max_batch = max_batch_events
        self._max_pending = max_pending_events
        self._max_resyncs = max_resyncs_per_flush
        self._keepalive_s = keepalive_s
        self._last_contact = float("-inf")   # loop time of the index's last answer
        # Events may come from the engine's thread while a flush runs on the loop.
        self._lock = threading.Lock()
        self._flush_lock = asyncio.Lock()
        self._pending: list[KvEvent] = []
        self._next_seq = 1
        self._needs_resync = True
        self.resyncs_sent = 0
        self.events_sent = 0

    # ------------------------------------------------------------- producing

    def stored(self, parent_hash: int, block_hashes: Sequence[int], partial_hash: int = 0) -> None:
        if block_hashes or partial_hash:
            self.add(BlockStored(parent_hash, tuple(block_hashes), partial_hash))

    def removed(self, block_hashes: Sequence[int]) -> None:
        if block_hashes:
            self.add(BlockRemoved(tuple(block_hashes)))

    def cleared(self) -> None:
        self.add(AllCleared())

    def add(self, body: EventBody) -> None:
        with self._lock:
            event = KvEvent(self._next_seq, body)
            self._next_seq += 1
            if self._needs_resync:
                return  # the coming snapshot covers it
            if len(self._pending) >= self._max_pending:
                log.warning("kv event backlog full, falling back to a resync",
                            extra={"worker_id": self.worker_id, "pending": len(self._pending)})
                self._pending.clear()
                self._needs_resync = True
                return
            self._pending.append(event)

    # ------------------------------------------------------------- state

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    @property
    def unacknowledged(self) -> int:
        """Events the index has not acknowledged yet; a resync still due counts as one."""
        with self._lock:
            return len(self._pending) + (1 if self._needs_resync else 0)

    @property
    def next_seq(self) -> int:
        with self._lock:
            return self._next_seq

    @property
    def needs_resync(self) -> bool:
        with self._lock:
            return self._needs_resync

    def request_resync(self) -> None:
        """Makes the next flush send a full snapshot (e.g. after the index
        restarted and lost its state)."""
        with self._lock:
            self._needs_resync = True
            self._pending.clear()

    # ------------------------------------------------------------- sending

    async def flush(self, probe: bool = False) -> bool:
        """Sends everything pending. True when the index acknowledged all of
        it; False when it kept asking for resyncs. Transport errors propagate
        and leave the events pending for the next flush. With `probe` and
        nothing else to send, an empty batch asks whether the index still
        knows this worker."""
        async with self._flush_lock:
            resyncs = 0
            while True:
                if self.needs_resync:
                    if resyncs >= self._max_resyncs:
                        return False
                    resyncs += 1
                    await self._send_snapshot()
                    probe = False
                    continue
                with self._lock:
                    batch = tuple(self._pending[:self._max_batch])
                if not batch and not probe:
                    return True
                probe = False
                result = await self._contact(PublishBatch(self.worker_id, batch))
                self.events_sent += len(batch)
                with self._lock:
                    if result.resync_needed:
                        log.info("index asked for a resync",
                                 extra={"worker_id": self.worker_id, "next_seq": result.next_seq})
                        self._needs_resync = True
                        self._pending.clear()
                    else:
                        self._pending = [e for e in self._pending if e.seq >= result.next_seq]

    async def _send_snapshot(self) -> None:
        # The seq is taken before the snapshot: events handed out later may
        # already be in it, and replaying them on top is harmless (stores and
        # removals are idempotent), whereas an event at or below snapshot_seq
        # missing from the snapshot would be lost.
        with self._lock:
            snapshot_seq = self._next_seq - 1
            self._pending.clear()
            self._needs_resync = False
        try:
            chains = self._snapshot()
            if inspect.isawaitable(chains):
                chains = await chains
            result = await self._contact(PublishBatch(self.worker_id, full_resync=True,
                                                      snapshot=tuple(chains),
                                                      snapshot_seq=snapshot_seq))
        except BaseException:
            self.request_resync()
            raise
        self.resyncs_sent += 1
        if result.resync_needed:
            self.request_resync()

    async def _contact(self, batch: PublishBatch) -> PublishResult:
        result = await self._send(batch)
        self._last_contact = asyncio.get_running_loop().time()
        return result

    async def run(self, interval_s: float, stop: asyncio.Event, max_backoff_s: float = 5.0) -> None:
        """Flushes every interval_s until `stop` is set, then once more. While
        the index is unreachable it backs off and logs once, not every time."""
        failures = 0
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            probe = loop.time() - self._last_contact >= self._keepalive_s
            failures = await self._flush_logged(failures, probe)
            delay = min(interval_s * (2 ** min(failures, 16)), max(max_backoff_s, interval_s))
            try:
                await asyncio.wait_for(stop.wait(), timeout=delay)
            except TimeoutError:
                pass
        await self._flush_logged(failures)

    async def _flush_logged(self, failures: int, probe: bool = False) -> int:
        """One flush; returns the updated count of consecutive failures."""
        try:
            await self.flush(probe)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # a dead index must not stop the worker
            if failures == 0:
                log.warning("publishing kv events failed; retrying with backoff",
                            extra={"worker_id": self.worker_id, "error": str(error)})
            return failures + 1
        if failures:
            log.info("publishing kv events recovered", extra={"worker_id": self.worker_id})
        return 0
