"""The scale benchmark's parts: the simulated engine keeps the step contract (chunked prefill, one
sampled token per finished chunk, errors, frees, epochs), and `--quick` runs the real scheduler and
kvcache with two simulated workers registering under WORKER_TOKEN, publishing their cached blocks to
the index, and writes its rows."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from benchmarks.scale_bench import default_shards, main, parse, with_ideal
from benchmarks.sim_engine import SimEngine, StepCosts, sim_token
from benchmarks.sim_workers import SimEngineThread
from common.step import NewSequence, StepBatch, StepError, WorkItem
from services.worker.engine.types import StaleEpoch


def test_the_default_layout_is_one_scheduler_until_its_measured_limit_then_shards() -> None:
    h200 = StepCosts()          # a decode step of 20 ms for 64 sequences: 3,200 tokens/s a worker
    assert [default_shards(n, h200) for n in (1, 16, 34, 64)] == [1, 1, 2, 2]     # sixteen runs a step
    assert [default_shards(n, h200, decode_steps=1) for n in (1, 8, 9, 16, 64)] == [1, 1, 2, 2, 8]
    assert default_shards(64, h200, decode_steps=8) == 4     # the figure measured at four runs
    assert default_shards(128, h200.scaled(32)) == 1        # 32x slower workers: one keeps up
    assert default_shards(2, StepCosts(decode_ms=1, decode_batch=1000)) == 2   # never more than workers
    assert parse(["--workers", "64"]).shards == "auto" and parse(["--shards", "3"]).shards == "3"
    with pytest.raises(SystemExit):
        parse(["--shards", "0"])


def test_sim_engine_prefills_in_chunks_then_decodes() -> None:
    engine = SimEngine(StepCosts(decode_ms=20, decode_batch=2, prefill_tok_s=1000))
    first = engine.step(StepBatch(new_sequences=(NewSequence("a", tuple(range(10))),),
                                  work=(WorkItem("a", 6),)))
    assert not first.results[0].sampled and first.results[0].num_computed_tokens == 6
    assert engine.pending_s == pytest.approx(0.006)
    second = engine.step(StepBatch(work=(WorkItem("a", 6),)))
    assert second.results[0].sampled and second.results[0].num_computed_tokens == 10
    engine.pending_s = 0.0     # as the engine thread takes it after each step
    decode = engine.step(StepBatch(work=(WorkItem("a", 1), WorkItem("a", 1), WorkItem("b", 1))))
    assert [r.error for r in decode.results] == [StepError.NONE, StepError.DUPLICATE_WORK,
                                                StepError.UNKNOWN_SEQUENCE]
    assert engine.pending_s == pytest.approx(0.020)
    engine.step(StepBatch(free_seq_ids=("a",)))
    assert engine.running_sequences() == 0 and engine.pool_stats().used_blocks == 0


def test_sim_engine_runs_a_steps_decode_runs_as_a_device_would() -> None:
    engine = SimEngine(StepCosts(decode_ms=20, decode_batch=2, prefill_tok_s=1000), num_blocks=5, block_size=4)
    engine.step(StepBatch(new_sequences=(NewSequence("a", tuple(range(7))), NewSequence("b", (1, 2, 3))),
                          work=(WorkItem("a", 7), WorkItem("b", 3))))
    engine.pending_s = 0.0
    out = engine.step(StepBatch(work=(WorkItem("a", 1, 0, 8), WorkItem("b", 1, 0, 2))))
    a, b = out.results
    assert len(b.token_ids) == 2 and b.num_computed_tokens == 5
    assert a.token_ids == tuple(sim_token(position) for position in range(8, 12))   # the pool ends its runs
    assert a.num_computed_tokens == 11
    assert engine.pending_s == pytest.approx(0.020 * 4)   # two runs of both, two of a alone
    assert engine.pool_stats().used_blocks == 5


def test_sim_engine_runs_all_at_once_when_the_pool_holds_them_as_one_by_one() -> None:
    outputs = []
    for num_blocks in (5, 64):       # 5: one run at a time (the test above); 64: all at once
        engine = SimEngine(StepCosts(decode_ms=20, decode_batch=2, prefill_tok_s=1000), num_blocks=num_blocks,
                           block_size=4)
        engine.step(StepBatch(new_sequences=(NewSequence("a", tuple(range(7))), NewSequence("b", (1, 2, 3))),
                              work=(WorkItem("a", 7), WorkItem("b", 3))))
        engine.pending_s = 0.0
        out = engine.step(StepBatch(work=(WorkItem("a", 1, 0, 3), WorkItem("b", 1, 0, 2))))
        outputs.append(([(r.token_ids, r.num_computed_tokens) for r in out.results], engine.pending_s,
                        engine.pool_stats().used_blocks))
    assert outputs[0] == outputs[1]
    assert outputs[1][1] == pytest.approx(0.020 * 3)


def test_a_step_that_reached_the_worker_early_starts_when_the_one_before_ends() -> None:
    """The simulated device starts a queued step at the previous one's end, not when the event
    loop (shared by every simulated worker) gets to it; a step arriving later starts then."""
    engine = SimEngine(StepCosts(decode_ms=20, decode_batch=2, prefill_tok_s=1000))
    thread = SimEngineThread(engine)
    first = StepBatch(new_sequences=(NewSequence("a", tuple(range(60))),), work=(WorkItem("a", 60),), step_id=1)

    async def scenario() -> None:
        thread.arrived(1)
        running = asyncio.ensure_future(thread.run(lambda: engine.step(first)))   # 60 ms modelled
        await asyncio.sleep(0.01)
        thread.arrived(2)               # while the first runs
        await running
        time.sleep(0.05)                # the shared loop busy elsewhere when the first ends
        await thread.run(lambda: engine.step(StepBatch(work=(WorkItem("a", 1),), step_id=2)))
        await asyncio.sleep(0.03)
        thread.arrived(3)               # after the second ended: the device idled meanwhile
        await thread.run(lambda: engine.step(StepBatch(work=(WorkItem("a", 1),), step_id=3)))

    asyncio.run(scenario())
    (start1, _, took1), (start2, gap2, _), (_, gap3, _) = thread.steps
    assert start2 == pytest.approx(start1 + took1) and gap2 == 0.0
    assert gap3 >= 0.02


def test_sim_engine_refuses_an_older_epoch_and_frees_on_a_newer() -> None:
    engine = SimEngine()
    engine.adopt_epoch(2)
    engine.step(StepBatch(new_sequences=(NewSequence("a", (1, 2, 3)),), epoch=2))
    assert engine.adopt_epoch(3) == 1 and engine.running_sequences() == 0
    with pytest.raises(StaleEpoch):
        engine.adopt_epoch(1)


def test_ideal_is_one_workers_rate_times_the_count() -> None:
    rows = with_ideal([{"workers": 1, "output_tok_s": 100.0}, {"workers": 4, "output_tok_s": 360.0}])
    assert rows[1]["ideal_tok_s"] == 400.0 and rows[1]["efficiency"] == 0.9


def test_quick_mode_measures_real_scheduler_with_simulated_workers(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    main(["--quick", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [row["workers"] for row in rows] == [1, 2]
    for row in rows:
        assert row["output_tok_s"] > 0 and row["errors"] == 0
        assert {"ideal_tok_s", "efficiency", "scheduler_cpu_ms_per_step", "ttft_ms_p99"} <= row.keys()
        # Every prompt starts with its tenant's 32 of 48 tokens: the workers serve those from their
        # caches, and the index holds the blocks they published and finds them for the routing.
        assert row["cached_token_share"] > 0.5 and row["index_hit_token_share"] > 0.5 and row["index_blocks"] > 0


def test_quick_mode_with_two_shards_each_serving_its_workers(tmp_path: Path) -> None:
    """Two schedulers (SCHEDULER_PEERS each other), a worker each, the load through GenerateMany
    to each shard; tenant-0 pinned to the first shard, VTC ordering: both shards serve, and every
    tenant gets tokens."""
    out = tmp_path / "rows.json"
    main(["--quick", "--shards", "2", "--pin-tenant", "--vtc", "--out", str(out)])
    two = json.loads(out.read_text())["rows"][1]
    assert two["shards"] == 2 and two["exchange"] and two["errors"] == 0 and two["output_tok_s"] > 0
    assert len(two["scheduler_cpu_util_by_shard"]) == 2 and all(u > 0 for u in two["scheduler_cpu_util_by_shard"])
    assert set(two["tenant_token_shares"]) == {f"tenant-{n}" for n in range(4)}


class FakeManyCall:
    """A GenerateMany call: answers each submit with two token events and a finish, a request
    whose id starts with "refuse" with a refusal; a cancel is noted."""

    def __init__(self) -> None:
        self.out: asyncio.Queue = asyncio.Queue()
        self.cancelled: list[int] = []

    async def write(self, message) -> None:
        from fairserve.v1 import scheduler_pb2
        self.cancelled += list(message.cancel)
        for submit in message.submit:
            if submit.request.request_id.startswith("refuse"):
                events = [scheduler_pb2.StreamEvent(stream=submit.stream, refusal=scheduler_pb2.StreamRefusal(
                    code=8, message="over quota"))]
            elif submit.request.request_id.startswith("hang"):
                events = []
            else:
                events = [scheduler_pb2.StreamEvent(stream=submit.stream, event=scheduler_pb2.GenerateEvent(
                    tokens=[scheduler_pb2.TokenEvent(token_id=t) for t in (5, 6)])),
                    scheduler_pb2.StreamEvent(stream=submit.stream, event=scheduler_pb2.GenerateEvent(
                        finish=scheduler_pb2.FinishEvent(finish_reason="length")))]
            await self.out.put(scheduler_pb2.StreamEvents(events=events))

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.out.get()

    def cancel(self) -> None:
        pass


def test_lean_streams_hand_each_event_to_its_request_and_raise_a_refusal() -> None:
    from fairserve.v1 import scheduler_pb2
    from benchmarks.lean_streams import LeanStreams, StreamRefused
    call = FakeManyCall()

    class Stub:
        def GenerateMany(self):
            return call

    async def scenario() -> tuple[list, str, list[int]]:
        streams = LeanStreams(Stub())
        seen: list = []
        await streams.generate(scheduler_pb2.GenerateRequest(request_id="a"), seen.append)
        with pytest.raises(StreamRefused) as refused:
            await streams.generate(scheduler_pb2.GenerateRequest(request_id="refuse-1"), seen.append)
        hanging = asyncio.ensure_future(streams.generate(scheduler_pb2.GenerateRequest(request_id="hang"),
                                                         seen.append))
        await asyncio.sleep(0.01)
        hanging.cancel()
        await asyncio.sleep(0.01)
        await streams.close()
        return seen, str(refused.value), call.cancelled

    seen, refusal, cancelled = asyncio.run(scenario())
    assert [list(event.tokens) != [] for event in seen] == [True, False] and seen[1].finish.finish_reason == "length"
    assert refusal == "RESOURCE_EXHAUSTED: over quota"
    assert cancelled == [3]          # the request left early is cancelled on the call
