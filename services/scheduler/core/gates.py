"""Admission gates: whether a request may enter the queue, whether it may leave
it for a worker's batch now, and when it has waited too long.

Three kinds of outcome, as Gate documents:
- rejected at once (invalid, no worker, queue full, can never fit): the
  request never queues;
- held (active KV, cache pool): it stays queued, and admission on that worker
  stops for this step, so that nothing behind it overtakes it;
- timed out: a request never admitted is rejected after queue_timeout_s.

Pure checks over plain values; the core counts and reports the outcomes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from common.step import KV_POLICIES, KvPolicy

from services.scheduler.core.state import blocks_for
from services.scheduler.core.types import Gate, Rejection, RequestSpec, WorkerSpec


def reject_early(spec: RequestSpec, already_in_flight: bool, num_workers: int, num_waiting: int,
                 max_queue_len: int) -> Rejection | None:
    """Why a request cannot even queue, or None."""
    if not spec.prompt_token_ids:
        return Rejection(Gate.INVALID, "the prompt is empty")
    if already_in_flight:
        return Rejection(Gate.INVALID, f"request_id {spec.request_id!r} is already in flight")
    if spec.kv_policy and spec.kv_policy not in KV_POLICIES:
        return Rejection(Gate.INVALID, f"kv_policy {spec.kv_policy!r} is not one of {', '.join(KV_POLICIES)}")
    if num_workers == 0:
        return Rejection(Gate.NO_WORKER, "no worker is registered (or every one is draining)")
    if num_waiting >= max_queue_len:
        return Rejection(Gate.QUEUE, f"the queue is full: {num_waiting} requests waiting "
                                     f"(MAX_QUEUE_LEN={max_queue_len})")
    return None


def output_limit(requested_max_tokens: int, prompt_len: int, max_model_len: int, limit: int = 0) -> int:
    """The request's max_tokens (output tokens), where <= 0 asks for as many as the context
    allows, and never more than `limit` (MAX_TOKENS_LIMIT, 0: none) whatever the KV policy."""
    if requested_max_tokens > 0:
        return requested_max_tokens
    room = max_model_len - prompt_len
    return min(room, limit) if limit > 0 else room


def tokens_limit(configured: int, max_model_len: int) -> int:
    """The most max_tokens a request may ask of a worker: MAX_TOKENS_LIMIT, else its context."""
    return configured or max_model_len


def over_tokens_limit(max_tokens: int, limit: int) -> Rejection | None:
    """A request asking for more than `limit` output tokens is refused, not clamped: a
    clamp would end it (and any resumed continuation of it) at another length than the
    one its client was promised, while a refusal says so at once."""
    if max_tokens > limit:
        return Rejection(Gate.INVALID, f"max_tokens ({max_tokens}) exceeds the limit of {limit} "
                                       f"tokens (MAX_TOKENS_LIMIT, else the model context)")
    return None


def kv_policy_of(spec: RequestSpec, default: KvPolicy) -> KvPolicy:
    """The request's KV policy: the kind it names (else the deployment's) with the
    deployment's budget and sinks."""
    return replace(default, kind=spec.kv_policy) if spec.kv_policy else default


def never_fit(worker: WorkerSpec, prompt_len: int, max_tokens: int, max_active_kv_tokens: int,
              generated: int = 0, cap_tokens: int = 0) -> str:
    """Why a request of `prompt_len` + `max_tokens` tokens could never run on
    `worker` even alone, or "" when it could. A continuation has `generated`
    of its max_tokens already, and must have room for one more. Under a lossy KV
    policy (`cap_tokens`: the most its cache holds) it may run past the model's
    context, and its cache never holds more than the cap."""
    total = prompt_len + max_tokens
    head = f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {total} tokens"
    if max_tokens <= 0 or (total > worker.max_model_len and not cap_tokens):
        return f"{head} exceeds the model context of {worker.max_model_len} tokens"
    if generated >= max_tokens:
        return f"the {generated} tokens it resumes from leave nothing of max_tokens ({max_tokens})"
    if cap_tokens:
        total = min(total, cap_tokens)
    blocks = blocks_for(total, worker.block_size)
    if blocks > worker.num_blocks:
        return (f"{head} needs {blocks} KV blocks of {worker.block_size} tokens, "
                f"but the worker's pool has {worker.num_blocks}")
    if total > max_active_kv_tokens:
        return f"{head} exceeds MAX_ACTIVE_KV_TOKENS={max_active_kv_tokens}"
    return ""


def fits_active_kv(reserved_kv_tokens: int, kv_reservation: int, max_active_kv_tokens: int) -> bool:
    """Whether the worker's admitted requests, with this one's worst case
    (prompt + max_tokens), stay within MAX_ACTIVE_KV_TOKENS."""
    return reserved_kv_tokens + kv_reservation <= max_active_kv_tokens


def fits_cache_pool(known_tokens: int, block_size: int, available_blocks: int) -> bool:
    """Whether the blocks for every token the request knows (prompt and output
    so far) are available in the step being planned."""
    return blocks_for(known_tokens, block_size) <= available_blocks


def holding_gate(reserved_kv_tokens: int, kv_reservation: int, max_active_kv_tokens: int,
                 known_tokens: int, block_size: int, available_blocks: int) -> Gate | None:
    """The gate that holds a request in the queue now, or None: it can be
    admitted. The active-KV gate is checked first."""
    if not fits_active_kv(reserved_kv_tokens, kv_reservation, max_active_kv_tokens):
        return Gate.ACTIVE_KV
    if not fits_cache_pool(known_tokens, block_size, available_blocks):
        return Gate.CACHE_POOL
    return None


def timed_out(admitted_once: bool, waited_s: float, queue_timeout_s: float) -> bool:
    """Only a request that was never admitted times out: one that waits again
    after a preemption has already started streaming."""
    return not admitted_once and waited_s > queue_timeout_s


def timeout_message(held_by: Iterable[Gate], waited_s: float, queue_timeout_s: float) -> str:
    held = ", ".join(sorted(g.value for g in held_by)) or "queue order"
    return (f"not admitted after {waited_s:.1f} s (QUEUE_TIMEOUT_S={queue_timeout_s:g}); "
            f"held by: {held}")
