"""Protobuf <-> plain values at the gateway's gRPC edges."""

from __future__ import annotations

from typing import Any

import grpc

from common.convert import (
    constraint_from_proto,
    logprob_from_proto,
    sampling_to_proto,
    usage_from_proto,
    usage_to_proto,
)
from common.transport.grpc_server import REJECTION_KEY
from common.types import Usage
from fairserve.v1 import common_pb2, gateway_pb2, scheduler_pb2
from services.gateway.requests.backend import (
    BackendError,
    Finish,
    GenerationEvent,
    GenerationSpec,
    InvalidGeneration,
    ModelInfo,
    Overloaded,
    SchedulerLost,
    SchedulerView,
    TokenOutput,
    Unavailable,
    WorkerView,
)
from services.gateway.requests.spec import RequestFields, TextInput
from services.gateway.tenancy.tenants import TenantLimits
from services.gateway.requests.validation import SamplingInput
from services.kvcache.kv_types import IndexStats

DEFAULT_RETRY_AFTER_S = 1
QUOTA_GATE = "quota"   # the scheduler's rejection gate for a tenant at one of its limits


def sampling_input_from_proto(message: common_pb2.SamplingParams) -> SamplingInput:
    """The gRPC text API's sampling fields, left for validation like the HTTP ones;
    proto3 zeros of top_p and repetition_penalty (or values below) mean "not given"."""
    return SamplingInput(
        temperature=message.temperature,
        top_p=message.top_p if message.top_p > 0 else None,
        top_k=message.top_k,
        min_p=message.min_p,
        repetition_penalty=message.repetition_penalty if message.repetition_penalty > 0 else None,
        presence_penalty=message.presence_penalty,
        frequency_penalty=message.frequency_penalty,
        seed=message.seed if message.HasField("seed") else None,
        logprobs=message.logprobs,
        top_logprobs=message.top_logprobs,
    )


def generate_request_to_proto(spec: GenerationSpec, request_id: str) -> scheduler_pb2.GenerateRequest:
    """Everything but the stop strings, which the gateway matches itself."""
    return scheduler_pb2.GenerateRequest(
        request_id=request_id,
        packed_tokens=True,        # event_from_proto reads either form
        prompt_token_ids=list(spec.prompt_token_ids),
        max_tokens=spec.max_tokens,
        sampling=sampling_to_proto(spec.sampling),
        stop_token_ids=list(spec.stop_token_ids),
        ignore_eos=spec.ignore_eos,
        min_tokens=spec.min_tokens,
        client_id=spec.client_id,
        session_id=spec.session_id,
        priority=spec.priority,
        user=spec.user,
        weight=spec.weight,
        cache_salt=spec.cache_salt,
        resume_token_ids=list(spec.resume_token_ids),
        kv_policy=spec.kv_policy,
        authenticated=spec.tenant_limits is not None,
        quota=tenant_quota_to_proto(spec.tenant_limits) if spec.tenant_limits is not None else None,
        resubmitted=spec.resubmitted,
        detached=spec.detached,
        attachment=spec.attachment,
        lora_name=spec.lora_name, lora_path=spec.lora_path, lora_digest=spec.lora_digest,
        index_asked=spec.index_answer is not None, cached_prefix_tokens=dict(spec.index_answer or ()),
    )


def detached_spec_from_proto(message: scheduler_pb2.GenerateRequest) -> GenerationSpec:
    """A detached request as sent, to attach to it: what reading its tokens needs."""
    return GenerationSpec(
        prompt_token_ids=tuple(message.prompt_token_ids), max_tokens=message.max_tokens,
        stop_token_ids=tuple(message.stop_token_ids), ignore_eos=message.ignore_eos,
        min_tokens=message.min_tokens, client_id=message.client_id, detached=True,
        attachment=message.attachment, attach=True)


def tenant_quota_to_proto(limits: TenantLimits) -> scheduler_pb2.TenantQuota:
    """The limits the scheduler holds for the tenant; None (no limit) is 0."""
    return scheduler_pb2.TenantQuota(
        max_in_flight=limits.max_in_flight or 0, max_queued=limits.max_queued or 0,
        requests_per_s=limits.requests_per_s or 0.0, burst=limits.burst or 0,
        tokens_per_minute=limits.tokens_per_minute or 0, max_request_s=limits.max_request_s or 0.0)


def model_info_from_proto(message: scheduler_pb2.ModelInfo) -> ModelInfo:
    """Zeros (no worker registered yet) become None: unknown."""
    return ModelInfo(max_model_len=message.max_model_len or None,
                     vocab_size=message.vocab_size or None,
                     default_kv_policy=message.default_kv_policy or "full")


def event_from_proto(message: scheduler_pb2.GenerateEvent) -> GenerationEvent:
    tokens = tuple(TokenOutput(token_id=token.token_id,
                               logprob=logprob_from_proto(token.logprob) if token.HasField("logprob") else None)
                   for token in message.tokens) or tuple(map(TokenOutput, message.token_ids))
    finish = None
    if message.HasField("finish"):
        queue_wait_ms = message.finish.queue_wait_ms
        finish = Finish(reason=message.finish.finish_reason,
                        usage=usage_from_proto(message.finish.usage),
                        message=message.finish.message,
                        queue_wait_s=queue_wait_ms / 1000.0 if queue_wait_ms > 0 else None)
    return GenerationEvent(tokens=tokens, finish=finish,
                           prompt_logprobs=tuple(logprob_from_proto(logprob) for logprob in message.prompt_logprobs))


def scheduler_view_from_proto(message: scheduler_pb2.SchedulerStats) -> SchedulerView:
    workers = tuple(WorkerView(worker_id=worker.worker_id, address=worker.address,
                               healthy=worker.healthy) for worker in message.workers)
    return SchedulerView(workers=workers, details=scheduler_stats_to_dict(message),
                         waiting_for_worker=message.waiting_for_worker, worker_wait_s=message.worker_wait_s,
                         worker_recovery_s=message.worker_recovery_s)


def scheduler_stats_to_dict(message: scheduler_pb2.SchedulerStats) -> dict[str, Any]:
    """The "scheduler" part of /stats (docs/metrics.md): counts as numbers,
    not the strings a JSON mapping of int64 fields would give."""
    return {
        "pending": message.pending, "prefilling": message.prefilling, "active": message.active,
        "admitted": message.admitted, "finished": message.finished,
        "preemptions": message.preemptions, "migrations": message.migrations,
        "rejections": dict(message.rejections),
        "holds": dict(message.holds), "policy": message.policy,
        "reserved_kv_tokens": message.reserved_kv_tokens,
        "waiting_for_worker": message.waiting_for_worker,
        "workers": [{
            "worker_id": w.worker_id, "healthy": w.healthy, "running": w.running,
            "free_blocks": w.free_blocks, "cached_blocks": w.cached_blocks,
            "used_blocks": w.used_blocks, "total_blocks": w.total_blocks,
            "last_step_ms": w.last_step_ms, "last_batch_size": w.last_batch_size,
            "steps": w.steps, "evictions": w.evictions,
        } for w in message.workers],
        "clients": [{"client_id": c.client_id, "counter": c.counter, "served_tokens": c.served_tokens,
                     "weight": c.weight} for c in message.clients],
    }


def kvcache_stats_to_dict(stats: IndexStats) -> dict[str, Any]:
    """The "kvcache" part of /stats (docs/metrics.md)."""
    return {
        "lookups": stats.lookups, "hits": stats.hits, "lookup_tokens": stats.lookup_tokens,
        "hit_tokens": stats.hit_tokens, "hit_rate": stats.hit_rate_tokens,
        "nodes": stats.nodes, "events": stats.events,
        "resyncs": stats.resyncs, "blocks_by_worker": dict(stats.blocks_by_worker),
        "backend": stats.backend,
    }


Metadata = tuple[tuple[str, str | bytes], ...]


def _retry_after_s(metadata: Metadata) -> int | None:
    for key, value in metadata:
        if key == "retry-after":
            try:
                return max(1, int(float(value)))
            except ValueError:
                return None
    return None


def _rejection_gate(metadata: Metadata) -> str | None:
    """The scheduler marks its own refusals (with the gate that refused)."""
    for key, value in metadata:
        if key == REJECTION_KEY:
            return str(value)
    return None


def backend_error_from_rpc(error: grpc.aio.AioRpcError) -> BackendError:
    return backend_error_from_status(error.code(), error.details() or "", tuple(error.trailing_metadata() or ()))


# The status gRPC's asyncio client gives a call whose connection broke under an
# operation in flight (a message being sent or read when the scheduler process
# died): made on this side, never sent by the scheduler, which gives no INTERNAL.
LOCAL_TRANSPORT_FAILURE = "Internal error from Core"


def backend_error_from_status(code: grpc.StatusCode, details: str, metadata: Metadata) -> BackendError:
    """A scheduler call's status (a Generate call's, or a GenerateMany stream's refusal)
    as the gateway's error. A lost connection (UNAVAILABLE without the scheduler's
    own mark, or the client's own INTERNAL for a transport that broke mid-call) is
    SchedulerLost, which a resumable generation survives."""
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        quota = _rejection_gate(metadata) == QUOTA_GATE
        return Overloaded(details, _retry_after_s(metadata) or DEFAULT_RETRY_AFTER_S,
                          code="tenant_quota_exceeded" if quota else "queue_full")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidGeneration(details)
    if code == grpc.StatusCode.UNAVAILABLE and _rejection_gate(metadata) is None:
        return SchedulerLost(details or "the scheduler is unavailable", _retry_after_s(metadata))
    if code == grpc.StatusCode.INTERNAL and details == LOCAL_TRANSPORT_FAILURE:
        return SchedulerLost("the connection to the scheduler broke mid-call", None)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return Unavailable(details or "the scheduler is unavailable", _retry_after_s(metadata))
    return BackendError(f"scheduler error {code.name}: {details}")


def text_input_from_proto(message: gateway_pb2.TextRequest) -> TextInput:
    """The gRPC text API's request, left for the same checks as /generate's."""
    return TextInput(prompt=message.prompt, raw=message.raw, fields=RequestFields(
        sampling=sampling_input_from_proto(message.sampling), default_temperature=0.0,
        max_tokens=message.max_tokens or None, stop=tuple(message.stop),
        ignore_eos=message.ignore_eos, min_tokens=message.min_tokens, priority=message.priority,
        session_id=message.session_id, user=message.user, kv_policy=message.kv_policy or None,
        requested_stop_token_ids=tuple(message.sampling.stop_token_ids),
        logit_bias={str(token_id): bias for token_id, bias in message.sampling.logit_bias.items()},
        constraint=(constraint_from_proto(message.sampling.constraint)
                    if message.sampling.HasField("constraint") else None),
        constraint_param="sampling.constraint"))


def text_chunk_to_proto(text: str, token_ids: tuple[int, ...], finish_reason: str | None,
                        usage: Usage | None) -> gateway_pb2.TextChunk:
    chunk = gateway_pb2.TextChunk(text=text, token_ids=list(token_ids),
                                  finish_reason=finish_reason or "")
    if usage is not None:
        chunk.usage.CopyFrom(usage_to_proto(usage))
    return chunk


def text_response_to_proto(text: str, finish_reason: str, usage: Usage) -> gateway_pb2.TextResponse:
    return gateway_pb2.TextResponse(text=text, finish_reason=finish_reason,
                                    usage=usage_to_proto(usage))
