"""The scheduler's records of lookups it did not ask (lookup_records.py): they wait and go
together every interval, a call's limit at a time; a batch that fails is dropped and logged
(statistics hold nothing up); past `max_pending` the oldest go; a worker's cached tokens are
kept within the prompt."""

from __future__ import annotations

import asyncio
import logging

import pytest

from services.scheduler.lookup_records import RECORDS_PER_CALL, LookupRecords, Record


class Index:
    def __init__(self, fail: bool = False) -> None:
        self.calls: list[list[Record]] = []
        self.fail = fail

    async def send(self, batch: list[Record]) -> None:
        if self.fail:
            raise ConnectionError("the index is away")
        self.calls.append(batch)


async def test_records_go_together_each_interval() -> None:
    index = Index()
    records = LookupRecords(index.send, interval_s=0.05)
    records.add(1496, 1486, "r1")
    records.add(40, 0, "r2")
    runner = asyncio.create_task(records.run())
    try:
        for _ in range(100):
            if index.calls:
                break
            await asyncio.sleep(0.01)
        assert index.calls == [[Record(1496, 1486, "r1"), Record(40, 0, "r2")]]
        records.add(10, 4, "r3")
        await asyncio.sleep(0.2)
        assert index.calls[1:] == [[Record(10, 4, "r3")]]      # one call for it, none while idle
    finally:
        runner.cancel()


async def test_a_flush_sends_a_calls_limit_at_a_time() -> None:
    index = Index()
    records = LookupRecords(index.send, max_pending=3 * RECORDS_PER_CALL)
    for i in range(RECORDS_PER_CALL + 5):
        records.add(8, 0, f"r{i}")
    await records.flush()
    assert [len(batch) for batch in index.calls] == [RECORDS_PER_CALL, 5] and records.pending == []


async def test_a_failed_batch_is_dropped_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    records = LookupRecords(Index(fail=True).send)
    records.add(8, 4, "r1")
    with caplog.at_level(logging.WARNING, logger="services.scheduler.lookup_records"):
        await records.flush()
    assert records.pending == [] and records.dropped == 1
    assert "recording lookups in the kv index failed" in caplog.text


def test_past_max_pending_the_oldest_go_and_cached_stays_within_the_prompt() -> None:
    records = LookupRecords(Index().send, max_pending=2)
    records.add(8, 9, "r1")       # a worker cannot reuse more than the prompt
    records.add(8, -1, "r2")
    records.add(8, 4, "r3")
    assert records.pending == [Record(8, 0, "r2"), Record(8, 4, "r3")] and records.dropped == 1
