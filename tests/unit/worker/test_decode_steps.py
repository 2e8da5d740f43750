"""The worker's multi-step decoding (services/worker/decode_steps.py) over a fake engine that
keeps the step contract: the runs' tokens in one result, in order and the same as one run at a
time; the runs stop at EOS, at an interruption, at the step's time bound, at a work item's cap on
its tokens (the last run's drafts trimmed to it) and at a sequence's failure, keeping what earlier
runs sampled; the runs' counters add up."""

from __future__ import annotations

from common.step import MAX_DECODE_STEPS, NewSequence, StepBatch, StepOutput, WorkItem
from common.types import SamplingParams

from services.worker.decode_steps import past_bound, run_decode_steps
from tests.unit.scheduler.fake_worker import EOS_TOKEN_ID, FakeEngine, reference_output

PROMPT = tuple(range(10, 19))


def _decoding(engine: FakeEngine, *seq_ids: str, logprobs: bool = False) -> None:
    """Registers the sequences and prefills them (each sampled its first token)."""
    engine.step(StepBatch(step_id=1, new_sequences=tuple(
        NewSequence(seq_id, PROMPT, sampling=SamplingParams(logprobs=logprobs)) for seq_id in seq_ids),
        work=tuple(WorkItem(seq_id, len(PROMPT)) for seq_id in seq_ids)))


def _run(engine: FakeEngine, work: tuple[WorkItem, ...], **kwargs) -> StepOutput:
    return run_decode_steps(StepBatch(step_id=2, work=work), engine.step, {EOS_TOKEN_ID}, **kwargs)


def test_the_runs_tokens_come_back_in_one_result_as_one_run_at_a_time_would_give_them() -> None:
    engine = FakeEngine()
    _decoding(engine, "a", "b")
    output = _run(engine, (WorkItem("a", 1, 0, 4), WorkItem("b", 1)))
    a, b = output.results
    assert a.token_ids == tuple(reference_output(PROMPT, 5)[1:])   # the prefill sampled the first
    assert b.token_ids == tuple(reference_output(PROMPT, 2)[1:])
    assert a.num_computed_tokens == len(PROMPT) + 4
    assert len(engine.steps) == 1 + 4                  # the prefill, then four runs
    assert [len(step.work) for step in engine.steps[2:]] == [1, 1, 1]   # b asked for one run only
    assert output.forward_ms == 4.0 and output.step_id == 2
    engine.check_invariants()


def test_runs_with_drafts_bring_up_to_runs_times_one_plus_drafts_tokens() -> None:
    engine = FakeEngine(accepted_drafts=2)
    _decoding(engine, "a")
    (result,) = _run(engine, (WorkItem("a", 1, 2, 3),)).results
    assert WorkItem("a", 1, 2, 3).extra_tokens == 8
    assert result.token_ids == tuple(reference_output(PROMPT, 10)[1:])
    assert result.num_computed_tokens == len(PROMPT) + 9


def test_the_runs_end_at_the_item_s_cap_with_the_last_run_s_drafts_trimmed_to_it() -> None:
    engine = FakeEngine(accepted_drafts=2)             # every draft kept: 3 tokens a run
    _decoding(engine, "a")
    item = WorkItem("a", 1, 2, 8, max_outputs=7)
    assert item.extra_tokens == 6                       # the cap, not 8 runs * 3 tokens
    (result,) = _run(engine, (item,)).results
    assert result.token_ids == tuple(reference_output(PROMPT, 8)[1:])     # 3 + 3 + 1
    assert [step.work[0].draft_tokens for step in engine.steps[2:]] == [2, 0]
    assert len(engine.steps) == 1 + 3
    assert _run(engine, (WorkItem("a", 1, 0, 8, max_outputs=2),)).runs == 2     # the runs it ran
    engine.check_invariants()


def test_runs_that_keep_no_draft_go_on_up_to_the_cap() -> None:
    engine = FakeEngine(accepted_drafts=0)
    _decoding(engine, "a")
    (result,) = _run(engine, (WorkItem("a", 1, 2, 8, max_outputs=5),)).results
    assert result.token_ids == tuple(reference_output(PROMPT, 6)[1:])     # five runs of one token
    assert [step.work[0].draft_tokens for step in engine.steps[2:]] == [2, 2, 1, 0]   # 4, 3, 2, 1 left


def test_one_run_is_the_engine_step_itself() -> None:
    engine = FakeEngine()
    _decoding(engine, "a")
    output = _run(engine, (WorkItem("a", 1),))
    assert len(engine.steps) == 2 and output.results[0].more_token_ids == ()


def test_a_sequence_that_samples_eos_runs_no_further() -> None:
    def next_token(tokens):   # EOS as the third output token
        return EOS_TOKEN_ID if len(tokens) == len(PROMPT) + 2 else 5
    engine = FakeEngine(next_token=next_token)
    _decoding(engine, "a")
    output = _run(engine, (WorkItem("a", 1, 0, 8),))
    assert output.results[0].token_ids == (5, EOS_TOKEN_ID)
    assert len(engine.steps) == 1 + 2 and output.runs == 2


def test_an_interruption_ends_the_runs_after_the_current_one() -> None:
    engine = FakeEngine()
    _decoding(engine, "a")
    polls = []

    def interrupted() -> bool:
        polls.append(len(engine.steps))
        return len(engine.steps) >= 3     # an arrival waits once two runs are done
    (result,) = _run(engine, (WorkItem("a", 1, 0, 8),), interrupted=interrupted).results
    assert len(result.token_ids) == 2 and len(engine.steps) == 3
    assert result.token_ids == tuple(reference_output(PROMPT, 3)[1:])


def test_a_time_bound_starts_no_run_that_would_end_past_it() -> None:
    # The fake engine's run takes 1 ms: in 3.5 ms, three runs (a fourth would end at 4).
    engine = FakeEngine()
    _decoding(engine, "a")
    output = run_decode_steps(StepBatch(step_id=2, work=(WorkItem("a", 1, 0, 8),), runs_ms=3.5),
                              engine.step, {EOS_TOKEN_ID})
    assert output.results[0].token_ids == tuple(reference_output(PROMPT, 4)[1:])
    assert output.forward_ms == 3.0
    assert not past_bound(0.0, 1e9, 1)                       # 0: no bound
    assert past_bound(160.0, 121.0, 3) and not past_bound(160.0, 121.0, 4)   # the next run: their mean


def test_a_later_run_that_fails_keeps_what_the_earlier_ones_sampled() -> None:
    engine = FakeEngine(num_blocks=4, block_size=4)       # 16 slots: the prompt's 9, then 7 more
    _decoding(engine, "a")
    (result,) = _run(engine, (WorkItem("a", 1, 0, 12),)).results
    assert not result.error and result.sampled
    assert result.token_ids == tuple(reference_output(PROMPT, 8)[1:])   # 7 runs fit the pool
    assert engine.out_of_blocks_errors == 1
    engine.check_invariants()


def test_logprobs_follow_their_tokens_through_the_runs() -> None:
    engine = FakeEngine(accepted_drafts=1)
    _decoding(engine, "a", logprobs=True)
    (result,) = _run(engine, (WorkItem("a", 1, 1, 3),)).results
    assert len(result.token_ids) == 6
    assert result.logprob is not None and len(result.more_logprobs) == 5
    assert all(logprob is not None for logprob in result.more_logprobs)


def test_without_logprobs_no_placeholders_travel() -> None:
    engine = FakeEngine(accepted_drafts=1)
    _decoding(engine, "a")
    (result,) = _run(engine, (WorkItem("a", 1, 1, 3),)).results
    assert len(result.token_ids) == 6 and result.more_logprobs == ()


def test_an_absurd_ask_is_capped() -> None:
    engine = FakeEngine(num_blocks=512)
    _decoding(engine, "a")
    (result,) = _run(engine, (WorkItem("a", 1, 0, 10_000),)).results
    assert len(result.token_ids) == MAX_DECODE_STEPS


def test_a_chunk_that_ends_its_prompt_decodes_on_in_the_same_step() -> None:
    """PREFILL_DECODE_STEPS: a new sequence's last chunk asks for runs; the token its prefill
    samples is the first of them, and a chunk short of its prompt's end samples nothing."""
    engine = FakeEngine()
    output = run_decode_steps(StepBatch(step_id=1, new_sequences=(NewSequence("a", PROMPT), NewSequence("b", PROMPT)),
                                        work=(WorkItem("a", len(PROMPT), 0, 3), WorkItem("b", 4, 0, 3))),
                              engine.step, {EOS_TOKEN_ID})
    a, b = output.results
    assert a.token_ids == tuple(reference_output(PROMPT, 3))
    assert a.num_computed_tokens == len(PROMPT) + 2
    assert not b.sampled and b.num_computed_tokens == 4
    engine.check_invariants()
