"""Translates the Worker contract (worker.proto) to and from the engine's plain values."""

from __future__ import annotations

from fairserve.v1 import worker_pb2

from common.convert import logprob_to_proto, sampling_from_proto
from services.worker.engine.types import (
    EngineInfo, NewSequence, PoolStats, SeqResult, StepBatch, StepOutput, WorkItem,
)


def step_batch_from_proto(request: worker_pb2.StepRequest) -> StepBatch:
    return StepBatch(
        new_sequences=[
            NewSequence(seq_id=s.seq_id, prompt_token_ids=list(s.prompt_token_ids),
                        output_token_ids=list(s.output_token_ids), sampling=sampling_from_proto(s.sampling))
            for s in request.new_sequences
        ],
        work=[WorkItem(seq_id=w.seq_id, max_tokens=w.max_tokens, draft_tokens=w.draft_tokens)
              for w in request.work],
        free_seq_ids=list(request.free_seq_ids),
    )


def pool_to_proto(pool: PoolStats) -> worker_pb2.PoolStats:
    return worker_pb2.PoolStats(
        total_blocks=pool.total_blocks, free_blocks=pool.free_blocks, cached_blocks=pool.cached_blocks,
        used_blocks=pool.used_blocks, evictions=pool.evictions, prefix_hit_tokens=pool.prefix_hit_tokens,
        prefix_query_tokens=pool.prefix_query_tokens,
    )


def seq_result_to_proto(result: SeqResult) -> worker_pb2.SeqResult:
    message = worker_pb2.SeqResult(
        seq_id=result.seq_id, num_computed_tokens=result.num_computed_tokens,
        num_cached_tokens=result.num_cached_tokens, sampled=result.sampled,
        token_id=result.token_id, error=result.error,
    )
    if result.logprob is not None:
        message.logprob.CopyFrom(logprob_to_proto(result.logprob))
    message.more_token_ids.extend(result.more_token_ids)
    if result.more_logprobs and all(logprob is not None for logprob in result.more_logprobs):
        message.more_logprobs.extend(logprob_to_proto(logprob) for logprob in result.more_logprobs)
    return message


def step_response_to_proto(step_id: int, output: StepOutput) -> worker_pb2.StepResponse:
    return worker_pb2.StepResponse(
        step_id=step_id, results=[seq_result_to_proto(r) for r in output.results],
        pool=pool_to_proto(output.pool), forward_ms=output.forward_ms,
    )


def info_to_proto(worker_id: str, info: EngineInfo) -> worker_pb2.WorkerInfo:
    return worker_pb2.WorkerInfo(
        worker_id=worker_id, model_name=info.model_name, block_size=info.block_size,
        num_blocks=info.num_blocks, device=info.device, dtype=info.dtype,
        max_model_len=info.max_model_len, eos_token_ids=list(info.eos_token_ids),
        vocab_size=info.vocab_size,
    )
