"""Value checks shared by every endpoint. Each failure is a 400 that names
the parameter and the numbers involved."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from common.types import SamplingParams
from services.gateway.errors import ApiError, bad_request

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_N = 16
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 1024
MAX_TOP_LOGPROBS = 20
MAX_TEMPERATURE = 2.0


def check_int(name: str, value: int | None, minimum: int, maximum: int) -> None:
    if value is not None and not minimum <= value <= maximum:
        raise bad_request(f"{name} must be between {minimum} and {maximum}, got {value}.", name)


def check_float(name: str, value: float | None, minimum: float, maximum: float,
                include_minimum: bool = True) -> None:
    if value is None:
        return
    low_ok = value >= minimum if include_minimum else value > minimum
    if not (math.isfinite(value) and low_ok and value <= maximum):
        bracket = "[" if include_minimum else "("
        raise bad_request(f"{name} must be in {bracket}{minimum}, {maximum}], got {value}.", name)


@dataclass(frozen=True)
class SamplingInput:
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


def build_sampling(values: SamplingInput, default_temperature: float) -> SamplingParams:
    check_float("temperature", values.temperature, 0.0, MAX_TEMPERATURE)
    check_float("top_p", values.top_p, 0.0, 1.0, include_minimum=False)
    check_int("top_k", values.top_k, -1, INT32_MAX)
    check_float("min_p", values.min_p, 0.0, 1.0)
    check_float("repetition_penalty", values.repetition_penalty, 0.0, 10.0, include_minimum=False)
    check_float("presence_penalty", values.presence_penalty, -2.0, 2.0)
    check_float("frequency_penalty", values.frequency_penalty, -2.0, 2.0)
    check_int("seed", values.seed, INT64_MIN, INT64_MAX)
    check_int("top_logprobs", values.top_logprobs, 0, MAX_TOP_LOGPROBS)
    return SamplingParams(
        temperature=default_temperature if values.temperature is None else values.temperature,
        top_p=1.0 if values.top_p is None else values.top_p,
        top_k=max(values.top_k or 0, 0),  # -1 (vLLM) and 0 both mean off
        min_p=values.min_p or 0.0,
        repetition_penalty=1.0 if values.repetition_penalty is None else values.repetition_penalty,
        presence_penalty=values.presence_penalty or 0.0,
        frequency_penalty=values.frequency_penalty or 0.0,
        seed=values.seed,
        logprobs=values.logprobs,
        top_logprobs=values.top_logprobs or 0,
    )


def normalize_stop(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"stop accepts at most {MAX_STOP_STRINGS} strings, got {len(stops)}.",
                          "stop")
    for item in stops:
        if len(item) > MAX_STOP_LENGTH:
            raise bad_request(f"each stop string must be at most {MAX_STOP_LENGTH} characters, "
                              f"got {len(item)}.", "stop")
    return tuple(item for item in stops if item)


def check_n(n: int | None) -> int:
    check_int("n", n, 1, MAX_N)
    return n or 1


def check_priority(priority: int | None) -> int:
    check_int("priority", priority, -INT32_MAX, INT32_MAX)
    return priority or 0


def resolve_max_tokens(requested: int | None, prompt_tokens: int, default: int,
                       max_model_len: int | None, param: str = "max_tokens",
                       limit: int | None = None) -> int:
    """The completion budget: the requested one must fit the context (None: a
    lossy KV policy, which the context does not bound) and, whatever the
    policy, `limit` (MAX_TOKENS_LIMIT); the default shrinks to both."""
    check_int(param, requested, 1, INT32_MAX)
    if max_model_len is not None and prompt_tokens >= max_model_len:
        raise context_error(prompt_tokens, requested or 1, max_model_len)
    if requested is None:
        room = default if max_model_len is None else max_model_len - prompt_tokens
        return max(1, min(default, room, limit or default))
    if max_model_len is not None and prompt_tokens + requested > max_model_len:
        raise context_error(prompt_tokens, requested, max_model_len, param)
    if limit is not None and requested > limit:
        raise bad_request(f"{param} must be at most {limit}, the server's limit on generated tokens "
                          f"(MAX_TOKENS_LIMIT), got {requested}.", param, "max_tokens_limit_exceeded")
    return requested


def context_error(prompt_tokens: int, completion_tokens: int, max_model_len: int,
                  param: str = "prompt") -> ApiError:
    return bad_request(
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{prompt_tokens + completion_tokens} tokens ({prompt_tokens} in the prompt, "
        f"{completion_tokens} in the completion).", param, "context_length_exceeded")


def check_min_tokens(min_tokens: int | None, max_tokens: int) -> int:
    check_int("min_tokens", min_tokens, 0, max_tokens)
    return min_tokens or 0


def check_prompt_ids(ids: Sequence[int], vocab_size: int | None, param: str = "prompt") -> None:
    """Not empty, and every id within the vocabulary (when its size is known)."""
    if not ids:
        raise bad_request("The prompt is empty.", param, "empty_prompt")
    if vocab_size is None:
        return
    lowest, highest = min(ids), max(ids)
    if lowest < 0 or highest >= vocab_size:
        token_id = lowest if lowest < 0 else highest
        raise bad_request(f"Token id {token_id} in {param} is outside the model's vocabulary "
                          f"[0, {vocab_size}).", param)


def check_text(text: str, param: str) -> str:
    """JSON can carry lone surrogates (\\ud800), which no tokenizer accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise bad_request(f"{param} is not valid Unicode text ({error.reason} at position "
                          f"{error.start}).", param, "invalid_text") from None
    return text

