"""When a request stops: checked after each token it generates, in order, so
that a stop among several tokens of one step (accepted speculative tokens)
ends it there and the tokens after it are dropped.

Below min_tokens, neither EOS nor a stop token stops it (the worker is told to
ban them until then: request_book.worker_sampling); max_tokens always does. A
constrained request (sampling.constraint) is the exception for EOS: the worker
lets its grammar win over min_tokens, so its EOS marks a complete match and ends it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from common.types import TokenLogprob

from services.scheduler.core.state import RequestState
from services.scheduler.core.types import FinishReason, RequestSpec


def finish_reason(spec: RequestSpec, max_tokens: int, generated: int, token_id: int,
                  eos_token_ids: Collection[int]) -> FinishReason | None:
    """Why the request ends with `token_id`, its `generated`-th output token
    (`max_tokens` resolved at submit), or None when it goes on."""
    if not spec.ignore_eos and token_id in eos_token_ids and (
            generated >= spec.min_tokens or spec.sampling.constraint is not None):
        return FinishReason.STOP
    if generated >= spec.min_tokens:
        if token_id in spec.stop_token_ids:
            return FinishReason.STOP
    if generated >= max_tokens:
        return FinishReason.LENGTH
    return None


def take_tokens(request: RequestState, tokens: Sequence[int], logprobs: Sequence[TokenLogprob | None],
                eos_token_ids: Collection[int]) -> tuple[tuple[int, ...], tuple[TokenLogprob | None, ...],
                                                         FinishReason | None]:
    """Appends a step's sampled tokens to the request's output up to the first
    one that finishes it (speculative tokens past a stop or max_tokens are
    dropped).

    Returns:
        The tokens kept (what the request is charged for), their logprobs (aligned with them;
        empty when none has one) and the finish reason, if any. Tokens none of which can end
        the request (a step's run of decodes, mostly) are taken in bulk.
    """
    kept, reason = len(tokens), None
    if _may_finish(request, tokens, eos_token_ids):
        for index, token_id in enumerate(tokens):
            reason = finish_reason(request.spec, request.max_tokens, len(request.output) + index + 1, token_id,
                                   eos_token_ids)
            if reason is not None:
                kept = index + 1
                break
    out = tuple(tokens[:kept])
    request.output.extend(out)
    return out, _aligned(logprobs, kept), reason


def _aligned(logprobs: Sequence[TokenLogprob | None], count: int) -> tuple[TokenLogprob | None, ...]:
    """The first `count` logprobs, padded with None to `count`; () when none of them is set."""
    head = tuple(logprobs[:count])
    if all(logprob is None for logprob in head):
        return ()
    return head + (None,) * (count - len(head))


def _may_finish(request: RequestState, tokens: Sequence[int], eos_token_ids: Collection[int]) -> bool:
    """Whether one of `tokens` could end the request: it reaches max_tokens, or one of them is
    an EOS (unless ignored) or stop token (min_tokens is left to the token-by-token check)."""
    if len(request.output) + len(tokens) >= request.max_tokens:
        return True
    spec = request.spec
    if spec.stop_token_ids and not spec.stop_token_ids.isdisjoint(tokens):
        return True
    return not spec.ignore_eos and any(token_id in eos_token_ids for token_id in tokens)
