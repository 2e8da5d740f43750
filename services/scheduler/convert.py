"""proto <-> core values, at the scheduler's edges (the Step messages, the worker's contract too,
are common/step_convert.py's)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeVar

import grpc
from fairserve.v1 import scheduler_pb2, worker_pb2

from common.block_hash import adapter_id, adapter_salt
from common.convert import logprob_to_proto, sampling_from_proto, usage_to_proto
from common.transport.grpc_server import REJECTION_KEY

from services.scheduler.core.types import (
    CoreStats, Finish, Gate, QuotaUsage, Rejection, RequestSpec, RequestUpdate, WorkerSpec, TenantQuota,
)
from services.scheduler.workers.registration import AddressNotOwned, WorkerFigures, WorkerIdTaken

N = TypeVar("N", int, float)

REJECTION_CODES: dict[Gate, grpc.StatusCode] = {
    Gate.QUEUE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Gate.QUOTA: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Gate.NEVER_FIT: grpc.StatusCode.INVALID_ARGUMENT,
    Gate.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    Gate.TIMEOUT: grpc.StatusCode.UNAVAILABLE,
    Gate.NO_WORKER: grpc.StatusCode.UNAVAILABLE,
}


def rejection_metadata(rejection: Rejection) -> tuple[tuple[str, str], ...]:
    """Trailing metadata that marks a status as the scheduler's own refusal, so the
    gateway tells an UNAVAILABLE rejection (no worker, hold timed out) from a lost
    connection to the scheduler (which it survives by resubmitting the request);
    with the seconds to wait when the rejection says them (a tenant's quota)."""
    metadata = ((REJECTION_KEY, rejection.gate.value),)
    if rejection.retry_after_s > 0:
        metadata += (("retry-after", str(rejection.retry_after_s)),)
    return metadata


def refusal_to_proto(rejection: Rejection) -> scheduler_pb2.StreamRefusal:
    """A rejection on a GenerateMany stream: the status and trailing metadata a
    Generate call would end with."""
    return scheduler_pb2.StreamRefusal(code=REJECTION_CODES[rejection.gate].value[0], message=rejection.message,
                                       metadata=dict(rejection_metadata(rejection)))


def request_spec_from_proto(message: scheduler_pb2.GenerateRequest) -> RequestSpec:
    return RequestSpec(
        request_id=message.request_id,
        prompt_token_ids=tuple(message.prompt_token_ids),
        max_tokens=message.max_tokens,
        sampling=sampling_from_proto(message.sampling),
        stop_token_ids=frozenset(message.stop_token_ids),
        ignore_eos=message.ignore_eos,
        min_tokens=max(0, message.min_tokens),
        client_id=message.client_id,
        session_id=message.session_id,
        priority=message.priority,
        user=message.user,
        weight=message.weight if message.weight > 0 else 1.0,
        # An adapter's requests never share cached blocks with the base model's or another
        # adapter's, whatever salt the gateway sent (adapter_salt is idempotent).
        cache_salt=adapter_salt(message.cache_salt, adapter_id(message.lora_name, message.lora_digest)),
        resume_token_ids=tuple(message.resume_token_ids),
        kv_policy=message.kv_policy,
        authenticated=message.authenticated,
        quota=tenant_quota_from_proto(message.quota) if message.HasField("quota") else None,
        resubmitted=message.resubmitted,
        lora_name=message.lora_name, lora_path=message.lora_path, lora_digest=message.lora_digest,
    )


def tenant_quota_from_proto(message: scheduler_pb2.TenantQuota) -> TenantQuota:
    """Zeros (and anything not a finite positive number) are "no limit"."""
    return TenantQuota(
        max_in_flight=_limit(message.max_in_flight), max_queued=_limit(message.max_queued),
        requests_per_s=_limit(message.requests_per_s), burst=_limit(message.burst),
        tokens_per_minute=_limit(message.tokens_per_minute), max_request_s=_limit(message.max_request_s),
    )


def tenant_quota_to_proto(quota: TenantQuota) -> scheduler_pb2.TenantQuota:
    """None ("no limit") as zero."""
    return scheduler_pb2.TenantQuota(
        max_in_flight=quota.max_in_flight or 0, max_queued=quota.max_queued or 0,
        requests_per_s=quota.requests_per_s or 0.0, burst=quota.burst or 0,
        tokens_per_minute=quota.tokens_per_minute or 0, max_request_s=quota.max_request_s or 0.0)


def quota_usages_from_proto(stats: scheduler_pb2.SchedulerStats) -> list[QuotaUsage]:
    """A peer shard's tenants' holds on their quotas."""
    return [QuotaUsage(u.tenant, tenant_quota_from_proto(u.quota), u.in_flight, u.queued, u.admitted,
                       u.charged_tokens) for u in stats.quotas]


def _limit(value: N) -> N | None:
    return value if math.isfinite(value) and value > 0 else None


def worker_spec_from_proto(info: worker_pb2.WorkerInfo, worker_id: str, address: str,
                           epoch: int = 0) -> WorkerSpec:
    return WorkerSpec(worker_id=worker_id, address=address, block_size=info.block_size,
                      num_blocks=info.num_blocks, max_model_len=info.max_model_len,
                      eos_token_ids=frozenset(info.eos_token_ids), epoch=epoch)


def worker_figures_from_proto(info: worker_pb2.WorkerInfo) -> WorkerFigures:
    return WorkerFigures(worker_id=info.worker_id, block_size=info.block_size, num_blocks=info.num_blocks,
                         max_model_len=info.max_model_len, vocab_size=info.vocab_size)


def model_info_to_proto(infos: Sequence[worker_pb2.WorkerInfo], default_kv_policy: str = "full"
                        ) -> scheduler_pb2.ModelInfo:
    """What the registered workers serve: the smallest context length and
    vocabulary any of them reports (zeros while none has); and the KV policy a
    request that names none gets."""
    lengths = [info.max_model_len for info in infos if info.max_model_len > 0]
    vocabularies = [info.vocab_size for info in infos if info.vocab_size > 0]
    return scheduler_pb2.ModelInfo(max_model_len=min(lengths, default=0),
                                   vocab_size=min(vocabularies, default=0),
                                   default_kv_policy=default_kv_policy)


def generate_event_to_proto(update: RequestUpdate, packed: bool = False) -> scheduler_pb2.GenerateEvent:
    event = scheduler_pb2.GenerateEvent()
    fill_generate_event(event, update, packed)
    return event


def add_stream_event(message: scheduler_pb2.StreamEvents, stream: int, update: RequestUpdate,
                     packed: bool = False) -> int:
    """Appends `update` to a GenerateMany message as `stream`'s event (built in place:
    a third of the time of building it apart); returns about the bytes it adds."""
    item = message.events.add(stream=stream)
    if update.rejection is not None:
        item.refusal.CopyFrom(refusal_to_proto(update.rejection))
        return item.ByteSize()
    fill_generate_event(item.event, update, packed)
    plain = not update.prompt_logprobs and not update.logprobs
    return 8 + 6 * len(update.tokens) if plain and update.finish is None else item.ByteSize()


def fill_generate_event(event: scheduler_pb2.GenerateEvent, update: RequestUpdate, packed: bool = False) -> None:
    """`update` into `event`; with `packed` (the caller's GenerateRequest.packed_tokens), tokens
    without logprobs go into `token_ids` rather than a TokenEvent each."""
    if not update.logprobs and packed:
        event.token_ids.extend(update.tokens)
    elif not update.logprobs:
        add = event.tokens.add
        for token_id in update.tokens:
            add(token_id=token_id)
    for token_id, logprob in zip(update.tokens, update.logprobs):
        item = event.tokens.add(token_id=token_id)
        if logprob is not None:
            item.logprob.CopyFrom(logprob_to_proto(logprob))
    if update.prompt_logprobs:
        event.prompt_logprobs.extend(logprob_to_proto(logprob) for logprob in update.prompt_logprobs)
    if update.finish is not None:
        event.finish.CopyFrom(scheduler_pb2.FinishEvent(
            finish_reason=update.finish.reason.value, usage=usage_to_proto(update.finish.usage),
            message=update.finish.message, queue_wait_ms=queue_wait_ms(update.finish)))


def queue_wait_ms(finish: Finish) -> float:
    return finish.queue_wait_s * 1000.0 if finish.queue_wait_s is not None else 0.0


def stats_to_proto(stats: CoreStats) -> scheduler_pb2.SchedulerStats:
    return scheduler_pb2.SchedulerStats(
        pending=stats.pending, prefilling=stats.prefilling, active=stats.active,
        admitted=stats.admitted, finished=stats.finished, preemptions=stats.preemptions, migrations=stats.migrations,
        rejections=stats.rejections, holds=stats.holds,
        workers=[scheduler_pb2.WorkerSummary(
            worker_id=w.worker_id, address=w.address, healthy=w.healthy, running=w.running,
            free_blocks=w.free_blocks, cached_blocks=w.cached_blocks, total_blocks=w.total_blocks,
            last_step_ms=w.last_step_ms, last_batch_size=w.last_batch_size, steps=w.steps,
            evictions=w.evictions, used_blocks=w.used_blocks)
            for w in stats.workers],
        clients=[scheduler_pb2.ClientCounter(client_id=c.client_id, counter=c.counter, charged=c.charged,
                                             served_tokens=c.served_tokens, weight=c.weight)
                 for c in stats.clients],
        policy=stats.policy.value, reserved_kv_tokens=stats.reserved_kv_tokens,
        waiting_for_worker=stats.waiting_for_worker, worker_wait_s=stats.worker_wait_s,
        worker_recovery_s=stats.worker_recovery_s,
        quotas=[scheduler_pb2.TenantQuotaUsage(
            tenant=u.tenant, quota=tenant_quota_to_proto(u.quota), in_flight=u.in_flight, queued=u.queued,
            admitted=u.admitted, charged_tokens=u.charged_tokens) for u in stats.quotas],
    )


def registration_status(error: Exception, worker_id: str, address: str) -> tuple[grpc.StatusCode, str]:
    """The status a refused registration ends with."""
    if isinstance(error, AddressNotOwned):
        return grpc.StatusCode.PERMISSION_DENIED, str(error)
    if isinstance(error, WorkerIdTaken):
        return grpc.StatusCode.ALREADY_EXISTS, str(error)
    if isinstance(error, grpc.aio.AioRpcError):
        return grpc.StatusCode.UNAVAILABLE, (f"could not reach worker {worker_id} at {address}: "
                                             f"{error.code().name} {error.details()}")
    return grpc.StatusCode.INVALID_ARGUMENT, str(error)
