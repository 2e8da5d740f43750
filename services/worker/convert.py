"""Translates the Worker contract (worker.proto) to and from the engine's plain values; the Step
messages themselves are common/step_convert.py's, shared with the scheduler."""

from __future__ import annotations

import dataclasses

from fairserve.v1 import worker_pb2

from common.step import StepOutput
from common.step_convert import step_output_to_proto
from services.worker.engine.types import EngineInfo


def step_response_to_proto(step_id: int, output: StepOutput) -> worker_pb2.StepResponse:
    return step_output_to_proto(dataclasses.replace(output, step_id=step_id))


def info_to_proto(worker_id: str, info: EngineInfo) -> worker_pb2.WorkerInfo:
    return worker_pb2.WorkerInfo(
        worker_id=worker_id, model_name=info.model_name, block_size=info.block_size,
        num_blocks=info.num_blocks, device=info.device, dtype=info.dtype,
        max_model_len=info.max_model_len, eos_token_ids=list(info.eos_token_ids),
        vocab_size=info.vocab_size,
    )
