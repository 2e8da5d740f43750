"""The step contract (common/step.py) against worker.proto: one definition on both sides."""

from __future__ import annotations

from fairserve.v1 import worker_pb2

from common.step import NewSequence, PoolStats, SeqResult, StepBatch, StepError, StepOutput, WorkItem
from common.step_convert import (
    step_batch_from_proto, step_batch_to_proto, step_error_from_proto, step_error_to_proto,
    step_output_from_proto, step_output_to_proto,
)
from common.types import SamplingParams, TokenLogprob


def test_step_errors_are_the_proto_enum_member_for_member() -> None:
    proto_names = {name.removeprefix("STEP_ERROR_") for name in worker_pb2.StepError.keys()}
    assert proto_names == {error.name for error in StepError}
    assert worker_pb2.StepError.Value("STEP_ERROR_NONE") == 0 and not StepError.NONE
    for error in StepError:
        assert step_error_from_proto(step_error_to_proto(error)) is error


def test_an_error_code_this_build_does_not_know_is_still_an_error() -> None:
    assert step_error_from_proto(999) is StepError.INTERNAL


def test_a_batch_survives_the_wire() -> None:
    batch = StepBatch(
        step_id=7, after_step_id=6, epoch=(1 << 62) + 5, free_seq_ids=("old",),
        new_sequences=(NewSequence("a", (1, 2, 3), (4,), SamplingParams(temperature=0.5, top_k=3, seed=11,
                                                                  logit_bias=((2, -100.0), (9, 0.5))),
                                   cache_salt="tenant-a"),),
        work=(WorkItem("a", 4), WorkItem("b", 1, draft_tokens=3, decode_steps=9, max_outputs=12)), runs_ms=160.0)
    assert step_batch_from_proto(step_batch_to_proto(batch)) == batch
    assert batch.num_tokens == 5


def test_a_reply_survives_the_wire_without_the_engine_counters() -> None:
    logprob = TokenLogprob(logprob=-0.5)
    output = StepOutput(
        step_id=3, forward_ms=12.5, runs=4, batch_tokens=9, screened_rows=2,
        pool=PoolStats(total_blocks=8, free_blocks=3, cached_blocks=2, used_blocks=3, evictions=1,
                       prefix_hit_tokens=16, prefix_query_tokens=32),
        results=(SeqResult("a", 4, 2, sampled=True, token_id=5, logprob=logprob,
                           more_token_ids=(6, 7), more_logprobs=(logprob, logprob)),
                 SeqResult("b", 0, error=StepError.OUT_OF_BLOCKS)))
    back = step_output_from_proto(step_output_to_proto(output))
    assert back.results == output.results
    assert (back.step_id, back.pool, back.forward_ms, back.runs) == (3, output.pool, 12.5, 4)
    assert back.batch_tokens == 0 and back.screened_rows == 0   # the worker's own metrics stay home
    assert back.results[0].token_ids == (5, 6, 7) and back.results[1].token_ids == ()
    assert back.pool.available_blocks == 5
