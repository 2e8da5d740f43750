"""Request fields keyed by token id: OpenAI's logit_bias and vLLM's
stop_token_ids. Each bad entry is a 400 naming the field and the id."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from services.gateway.errors import bad_request

MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 4096
MAX_STOP_TOKEN_IDS = 256


def _check_token_id(token_id: int, vocab_size: int | None, param: str) -> None:
    if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
        bound = f"[0, {vocab_size})" if vocab_size is not None else "non-negative"
        raise bad_request(f"Token id {token_id} in {param} is outside the model's vocabulary "
                          f"{bound}.", param)


def _token_id_key(key: object, param: str) -> int:
    """JSON object keys are strings; logit_bias's must spell a token id."""
    if isinstance(key, bool):
        raise bad_request(f"{param} keys must be token ids, got {key!r}.", param)
    if isinstance(key, int):
        return key
    text = str(key).strip()
    if not text.lstrip("-").isdigit() or not text.isascii():
        raise bad_request(f"{param} keys must be token ids, got {key!r}.", param)
    return int(text)


def check_logit_bias(bias: Mapping[object, float] | None, vocab_size: int | None,
                     param: str = "logit_bias") -> tuple[tuple[int, float], ...]:
    """{token id: bias in [-100, 100]} -> (id, bias) pairs, ascending ids."""
    if not bias:
        return ()
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise bad_request(f"{param} accepts at most {MAX_LOGIT_BIAS_ENTRIES} entries, "
                          f"got {len(bias)}.", param)
    pairs: dict[int, float] = {}
    for key, value in bias.items():
        token_id = _token_id_key(key, param)
        _check_token_id(token_id, vocab_size, param)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad_request(f"{param} values must be numbers, got {value!r} for token "
                              f"{token_id}.", param)
        if not (math.isfinite(value) and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
            raise bad_request(f"{param} values must be in [-{MAX_LOGIT_BIAS:g}, "
                              f"{MAX_LOGIT_BIAS:g}], got {value} for token {token_id}.", param)
        if token_id in pairs:
            raise bad_request(f"{param} names token {token_id} twice.", param)
        pairs[token_id] = float(value)
    return tuple(sorted(pairs.items()))


def check_stop_token_ids(ids: Sequence[int] | None, vocab_size: int | None,
                         param: str = "stop_token_ids") -> tuple[int, ...]:
    """Token ids that end the sequence when sampled, in the order given, once each."""
    if not ids:
        return ()
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise bad_request(f"{param} accepts at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}.",
                          param)
    for token_id in ids:
        _check_token_id(token_id, vocab_size, param)
    return tuple(dict.fromkeys(ids))
