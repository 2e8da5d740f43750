"""vLLM's `prompt_logprobs` request field, on /v1/completions (each choice's
`prompt_logprobs`) and /v1/chat/completions (the response's, for its one prompt):
every prompt token's logprob and rank given the tokens before it, with the k most
likely alternatives, as the worker scores them (sampling.prompt_logprobs).

The shape is vLLM's: a list as long as the prompt, null for the first token (nothing
comes before it), then for each later token a dict keyed by token id (a string in
JSON) of {"logprob", "rank", "decoded_token"}: the prompt's own token (its rank in
the whole vocabulary, 1 for the argmax, ties counting against it) and the top k
(ranks 1..k; the prompt's token among them keeps its place there). As vLLM:
0 <= k <= 20 (its default max_logprobs), -1 (the whole vocabulary) is refused, and so
is a stream (vLLM has no streamed prompt_logprobs). max_tokens 0 is echo's alone.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

from common.types import TokenLogprob
from services.gateway.requests.backend import GenerationSpec
from services.gateway.errors import bad_request
from services.gateway.requests.validation import MAX_TOP_LOGPROBS, check_int

PARAM = "prompt_logprobs"
CLAMPED = -9999.0   # vLLM's stand-in for a logprob of -inf, which JSON cannot carry


def check_prompt_logprobs(value: int | None, stream: bool) -> int | None:
    """The alternatives asked for (None: no prompt_logprobs), or a 400 naming the field."""
    if value is None:
        return None
    if value == -1:
        raise bad_request(f"prompt_logprobs -1 (the whole vocabulary) is not supported: at most "
                          f"{MAX_TOP_LOGPROBS} alternatives per prompt token.", PARAM)
    check_int(PARAM, value, 0, MAX_TOP_LOGPROBS)
    if stream:
        raise bad_request("prompt_logprobs is not available with stream: true (as in vLLM); "
                          "ask without streaming.", PARAM)
    return value


def scoring(spec: GenerationSpec, alternatives: int) -> GenerationSpec:
    """`spec` scoring its prompt with at least `alternatives` alternatives per token."""
    sampling = spec.sampling
    return dataclasses.replace(spec, sampling=dataclasses.replace(
        sampling, prompt_logprobs=True,
        prompt_top_logprobs=max(alternatives, sampling.prompt_top_logprobs if sampling.prompt_logprobs else 0)))


def prompt_logprobs_json(prompt_ids: Sequence[int], logprobs: Sequence[TokenLogprob], alternatives: int,
                         token_text: Callable[[int], str]) -> list[dict[str, Any] | None]:
    """vLLM's list for a prompt; a position the worker did not score (none came back) is null."""
    entries: list[dict[str, Any] | None] = [None]
    for position in range(1, len(prompt_ids)):
        scored = logprobs[position - 1] if position <= len(logprobs) else None
        entries.append(None if scored is None else
                       _entry(prompt_ids[position], scored, alternatives, token_text))
    return entries[:len(prompt_ids)]


def _entry(token_id: int, scored: TokenLogprob, alternatives: int,
           token_text: Callable[[int], str]) -> dict[str, Any]:
    entry = {str(token_id): _logprob(scored.logprob, scored.rank, token_text(token_id))}
    for rank, top in enumerate(scored.top[:alternatives], start=1):
        entry[str(top.token_id)] = _logprob(top.logprob, rank, token_text(top.token_id))
    return entry


def _logprob(value: float, rank: int, text: str) -> dict[str, Any]:
    shown: float | None = CLAMPED if value == -math.inf else value if math.isfinite(value) else None
    return {"logprob": shown, "rank": rank or None, "decoded_token": text}
