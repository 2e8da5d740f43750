"""A step that fails after a lossy KV policy's drop (kv_policy.py, drop_journal.py) leaves
the sequence as it was before the step: its table (the dropped blocks back in their
places, their K/V intact), its keys (rotated back), its evicted count and h2o scores, and
the pool; the step run again computes what it would have without the failure."""

from __future__ import annotations

import pytest
import torch

from common.step import KvPolicy, NewSequence, StepBatch, WorkItem, StepError
from common.types import SamplingParams
from services.worker.engine.engine import Engine
from tests.unit.worker.engine_helpers import RecordingSampler, make_engine, prompt_of

BLOCK = 4
PROMPT = prompt_of(10, 1)
POLICIES = [KvPolicy("sink", budget_tokens=16, sink_tokens=4), KvPolicy("window", budget_tokens=16),
            KvPolicy("h2o", budget_tokens=16)]
POISON = 383


class Injected(RuntimeError):
    pass


def started(kind: str, policy: KvPolicy) -> tuple[Engine, RecordingSampler]:
    """An engine whose sequence "s" fills its budget: its next decode step drops a block."""
    engine = make_engine(kind, block_size=BLOCK)
    recorder = RecordingSampler(engine.sampler)
    engine.sampler = recorder
    new = [NewSequence("s", tuple(PROMPT), (), SamplingParams(), kv_policy=policy)]
    engine.step(StepBatch(new_sequences=new, work=[WorkItem("s", 1024)]))
    while engine.sequences.get("s").cache_len < 16:
        engine.step(StepBatch(work=[WorkItem("s", 1)]))
    return engine, recorder


def snapshot(engine: Engine) -> dict[str, object]:
    seq = engine.sequences.get("s")
    table = list(engine.pool.table("s"))
    slots = torch.tensor([block * BLOCK + offset for block in table for offset in range(BLOCK)])
    return {"num_computed": seq.num_computed, "evicted": seq.evicted, "table": table,
            "scores": list(seq.block_scores), "used": engine.pool_stats().used_blocks,
            "dropped": engine.evictor.evicted_blocks,
            "keys": [keys.index_select(0, slots).clone() for keys in engine.kv.keys if keys is not None],
            "values": [values.index_select(0, slots).clone() for values in engine.kv.values if values is not None]}


def assert_same(before: dict[str, object], after: dict[str, object]) -> None:
    for name in ("num_computed", "evicted", "table", "used", "dropped"):
        assert after[name] == before[name], name
    assert after["scores"] == pytest.approx(before["scores"], rel=1e-6)
    for was, now in zip(before["values"], after["values"]):
        assert torch.equal(was, now)
    for was, now in zip(before["keys"], after["keys"]):     # rotated there and back
        torch.testing.assert_close(now, was, atol=1e-5, rtol=0)


def fail_next_forward(engine: Engine) -> None:
    inner = engine.forward.hidden_states

    def failing(input_ids, positions, meta, keep=None):
        engine.forward.hidden_states = inner      # once
        inner(input_ids, positions, meta, keep)   # K/V written, then the failure
        raise Injected("the forward failed")

    engine.forward.hidden_states = failing


@pytest.mark.parametrize("policy", POLICIES, ids=lambda policy: policy.kind)
def test_a_failed_step_takes_its_drop_back(kind: str, policy: KvPolicy) -> None:
    engine, recorder = started(kind, policy)
    clean, clean_recorder = started(kind, policy)
    before = snapshot(engine)
    fail_next_forward(engine)
    with pytest.raises(Injected):
        engine.step(StepBatch(work=[WorkItem("s", 1)]))
    engine.check_invariants()
    assert_same(before, snapshot(engine))
    for _ in range(6):      # the same steps as without the failure: the same logits
        seen, clean_seen = len(recorder.rows), len(clean_recorder.rows)
        engine.step(StepBatch(work=[WorkItem("s", 1)]))
        clean.step(StepBatch(work=[WorkItem("s", 1)]))
        engine.check_invariants()
        torch.testing.assert_close(recorder.rows[seen][0], clean_recorder.rows[clean_seen][0], atol=1e-5, rtol=0)
    assert engine.sequences.get("s").evicted == clean.sequences.get("s").evicted > before["evicted"]
    engine.step(StepBatch(free_seq_ids=["s"]))
    assert engine.pool_stats().used_blocks == 0


@pytest.mark.parametrize("policy", POLICIES, ids=lambda policy: policy.kind)
def test_a_poisoned_neighbour_costs_the_lossy_sequence_nothing(kind: str, policy: KvPolicy) -> None:
    """The step runs again in halves (isolation.py): the drop is taken back, then made again."""
    engine, recorder = started(kind, policy)
    clean, clean_recorder = started(kind, policy)
    inner = engine.forward.hidden_states

    def guarded(input_ids, positions, meta, keep=None):
        if bool((input_ids == POISON).any()):
            raise Injected("a poisoned row")
        return inner(input_ids, positions, meta, keep)

    engine.forward.hidden_states = guarded
    poisoned = NewSequence("p", tuple(prompt_of(6, 2) + [POISON]), ())
    seen, clean_seen = len(recorder.rows), len(clean_recorder.rows)
    out = engine.step(StepBatch(new_sequences=[poisoned], work=[WorkItem("s", 1), WorkItem("p", 1024)]))
    clean.step(StepBatch(work=[WorkItem("s", 1)]))
    engine.check_invariants()
    assert [result.error for result in out.results] == [StepError.NONE, StepError.INTERNAL]
    torch.testing.assert_close(recorder.rows[-1][0], clean_recorder.rows[clean_seen][0], atol=1e-5, rtol=0)
    assert len(recorder.rows) > seen
    assert engine.sequences.get("s").evicted == clean.sequences.get("s").evicted
    assert engine.pool.table("s") and engine.evictor.evicted_blocks == clean.evictor.evicted_blocks


def test_the_journal_keeps_dropped_blocks_until_settled_and_gives_them_back() -> None:
    from services.worker.engine.kv.block_pool import BlockPool
    from services.worker.engine.kv.drop_journal import DropJournal

    pool = BlockPool(8, BLOCK, False, "lru")
    pool.allocate("s", 5 * BLOCK)
    table = list(pool.table("s"))
    journal = DropJournal(pool)
    drop = journal.park("s", table, [1, 2])
    pool.drop("s", [1, 2])
    drop.taken = True
    pool.allocate("s", 4 * BLOCK)                   # the chunk's block: not a dropped one
    assert pool.table("s")[-1] not in table[1:3] and pool.stats().free_blocks == 2
    pool.check_invariants()
    journal.undo(None)
    assert pool.table("s") == table + [pool.table("s")[-1]] and pool.stats().free_blocks == 2
    pool.check_invariants()
    pool.shrink("s", 5 * BLOCK)                     # the isolation's roll back
    assert pool.table("s") == table and pool.stats().free_blocks == 3
    journal.park("s", table, [0])
    pool.drop("s", [0])
    journal.settle()
    pool.check_invariants()
    assert pool.stats().free_blocks == 4 and pool.table("s") == table[1:]
