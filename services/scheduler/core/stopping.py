"""When a request stops: checked after each token it generates, in order, so
that a stop among several tokens of one step (accepted speculative tokens)
ends it there and the tokens after it are dropped.

Below min_tokens, neither EOS nor a stop token stops it (the worker is told to
ban them until then: request_book.worker_sampling); max_tokens always does.
"""

from __future__ import annotations

from collections.abc import Collection

from services.scheduler.core.types import FinishReason, RequestSpec


def finish_reason(spec: RequestSpec, max_tokens: int, generated: int, token_id: int,
                  eos_token_ids: Collection[int]) -> FinishReason | None:
    """Why the request ends with `token_id`, its `generated`-th output token
    (`max_tokens` resolved at submit), or None when it goes on."""
    if generated >= spec.min_tokens:
        if not spec.ignore_eos and token_id in eos_token_ids:
            return FinishReason.STOP
        if token_id in spec.stop_token_ids:
            return FinishReason.STOP
    if generated >= max_tokens:
        return FinishReason.LENGTH
    return None
