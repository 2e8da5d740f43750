"""A sequence whose forward raises fails alone: it gets StepError.INTERNAL,
the step's other sequences get the tokens they would have got without it, and
the pool stays consistent. A fault no sequence can be blamed for (every item
fails alone) still fails the whole step, with nothing left half-done."""

from __future__ import annotations

import pytest

from services.worker.engine.engine import Engine
from common.step import NewSequence, StepBatch, WorkItem, StepError

from tests.unit.worker.engine_helpers import Driver, make_engine, prompt_of

POISON = 383        # a token id inside the vocabulary that makes the forward raise
NEW_TOKENS = 6


class Poisoned(RuntimeError):
    pass


def poison_forward(engine: Engine, always: bool = False) -> list[int]:
    """Makes the engine's forward raise whenever a step's rows hold POISON (or always);
    returns a list that grows by one per forward call."""
    hidden_states = engine.forward.hidden_states
    calls: list[int] = []

    def guarded(input_ids, positions, meta, keep=None):
        calls.append(int(input_ids.numel()))
        if always or bool((input_ids == POISON).any()):
            raise Poisoned("a poisoned row")
        return hidden_states(input_ids, positions, meta, keep)

    engine.forward.hidden_states = guarded
    return calls


def clean_outputs(prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    return Driver(make_engine("llama")).run(prompts, NEW_TOKENS)


def decode_to_the_end(engine: Engine, prompts: dict[str, list[int]], outputs: dict[str, list[int]],
                      frees: list[str]) -> None:
    while live := [seq_id for seq_id in prompts if len(outputs[seq_id]) < NEW_TOKENS]:
        out = engine.step(StepBatch(free_seq_ids=frees, work=[WorkItem(seq_id, 1) for seq_id in live]))
        frees = []
        engine.check_invariants()
        for result in out.results:
            assert not result.error, result
            outputs[result.seq_id].extend(result.token_ids)


PROMPTS = {"a": prompt_of(9), "b": prompt_of(13, salt=1), "c": prompt_of(6, salt=2)}


def test_a_poisoned_prompt_fails_alone_and_the_others_are_unchanged() -> None:
    engine = make_engine("llama")
    calls = poison_forward(engine)
    poison = prompt_of(7, salt=3) + [POISON, 11, 12]
    new = [NewSequence(seq_id, prompt) for seq_id, prompt in {**PROMPTS, "p": poison}.items()]
    out = engine.step(StepBatch(new_sequences=new, work=[WorkItem(s, 1024) for s in ("a", "p", "b", "c")]))
    engine.check_invariants()
    assert [result.seq_id for result in out.results] == ["a", "p", "b", "c"]
    failed = out.results[1]
    assert failed.error == StepError.INTERNAL and not failed.sampled and failed.num_computed_tokens == 0
    assert all(result.sampled and not result.error for result in out.results if result.seq_id != "p")
    assert out.batch_tokens == sum(len(prompt) for prompt in PROMPTS.values())
    assert engine.pool.table("p") == []           # what was planned for it went back
    held = sum(len(engine.pool.table(seq_id)) for seq_id in PROMPTS)
    assert held == sum(engine.pool.blocks_for(len(prompt)) for prompt in PROMPTS.values())
    assert engine.pool_stats().used_blocks == held
    assert len(calls) > 2            # the whole step, then smaller ones
    outputs = {seq_id: [] for seq_id in PROMPTS}
    for result in out.results:
        if result.seq_id in outputs:
            outputs[result.seq_id].extend(result.token_ids)
    decode_to_the_end(engine, PROMPTS, outputs, frees=["p"])
    assert outputs == clean_outputs(PROMPTS)
    engine.step(StepBatch(free_seq_ids=list(PROMPTS)))
    engine.check_invariants()
    assert engine.pool_stats().used_blocks == 0 and engine.running_sequences() == 0


def test_a_poisoned_sequence_reusing_cached_blocks_gives_them_back() -> None:
    engine = make_engine("llama")
    poison_forward(engine)
    shared = PROMPTS["b"]
    engine.step(StepBatch(new_sequences=[NewSequence("b", shared)], work=[WorkItem("b", 1024)]))
    before = engine.pool_stats()
    poison = shared[:12] + [POISON, 7]          # three cached blocks, then the poison
    out = engine.step(StepBatch(new_sequences=[NewSequence("p", poison)],
                                work=[WorkItem("b", 1), WorkItem("p", 1024)]))
    engine.check_invariants()
    assert out.results[1].error == StepError.INTERNAL and out.results[0].sampled
    assert engine.pool.table("p") == [] and engine.sequences.get("p").num_computed == 0
    after = engine.pool_stats()
    assert after.used_blocks == len(engine.pool.table("b"))
    assert (after.prefix_query_tokens, after.prefix_hit_tokens) == (before.prefix_query_tokens,
                                                                     before.prefix_hit_tokens)
    engine.step(StepBatch(free_seq_ids=["p", "b"]))
    engine.check_invariants()
    assert engine.pool_stats().used_blocks == 0


def test_a_token_outside_the_vocabulary_fails_its_sequence_alone() -> None:
    engine = make_engine("llama")
    vocab = engine.info.vocab_size
    new = [NewSequence("a", PROMPTS["a"]), NewSequence("bad", prompt_of(5) + [vocab + 50])]
    out = engine.step(StepBatch(new_sequences=new, work=[WorkItem("a", 1024), WorkItem("bad", 1024)]))
    engine.check_invariants()
    assert out.results[0].sampled and out.results[1].error == StepError.INTERNAL
    assert out.results[0].token_ids == tuple(clean_outputs({"a": PROMPTS["a"]})["a"][:1])


def test_when_every_sequence_fails_the_step_raises_and_changes_nothing() -> None:
    engine = make_engine("llama")
    poison_forward(engine, always=True)
    new = [NewSequence(seq_id, prompt) for seq_id, prompt in PROMPTS.items()]
    with pytest.raises(Poisoned):
        engine.step(StepBatch(new_sequences=new, work=[WorkItem(s, 1024) for s in PROMPTS]))
    engine.check_invariants()
    assert engine.pool_stats().used_blocks == 0 and engine.running_sequences() == len(PROMPTS)
    del engine.forward.hidden_states          # the device recovers: the same work now runs
    out = engine.step(StepBatch(work=[WorkItem(s, 1024) for s in PROMPTS]))
    outputs = {result.seq_id: list(result.token_ids) for result in out.results}
    decode_to_the_end(engine, PROMPTS, outputs, frees=[])
    assert outputs == clean_outputs(PROMPTS)


def test_a_lone_failing_item_fails_the_step() -> None:
    engine = make_engine("llama")
    poison_forward(engine)
    with pytest.raises(Poisoned):
        engine.step(StepBatch(new_sequences=[NewSequence("p", [2, POISON, 5])], work=[WorkItem("p", 1024)]))
    engine.check_invariants()
    assert engine.pool_stats().used_blocks == 0
