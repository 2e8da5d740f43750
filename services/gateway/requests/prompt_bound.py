"""The cheap length bound on prompts: a text longer than the context could hold
is refused by its length alone, before it is tokenized.

No token of the vocabulary stands for more than `longest` characters of the
text it was cut from, so a text of N characters becomes at least
ceil(N / longest) tokens. That holds when the tokenizer's pipeline never
shortens the text before cutting it: no normalizer that composes or strips,
no pre-tokenizer that drops whitespace, and a BPE model whose unknown
characters are not fused into one token. The bound is only used for such
pipelines (Gemma's replaces " " with "▁", byte-level BPE maps each byte to
one character); any other gets no bound, and its prompts are tokenized in
full as before. Measured on Gemma 3's 262,144-token vocabulary: the longest
token is 31 characters (a run of newlines).
"""

from __future__ import annotations

import math
from typing import Any

from services.gateway.errors import ApiError, bad_request
from services.gateway.text.prompt_prefixes import PromptPrefixes
from services.gateway.text.text_tokenizer import pipeline_part

# Pieces of a tokenizer.json pipeline that never make the text shorter.
_KEEPING_NORMALIZERS = {"Prepend", "NFD", "NFKD"}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split",
                           "UnicodeScripts"}


def longest_token_chars(tokenizer: Any) -> int | None:
    """The most characters of input one token can stand for, computed once at
    start; None when the tokenizer's pipeline may shorten the text (no bound)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    if not (_model_keeps(backend.model)
            and _keeps_length(pipeline_part(backend.normalizer), _normalizer_keeps)
            and _keeps_length(pipeline_part(backend.pre_tokenizer), _pre_tokenizer_keeps)):
        return None
    vocab = backend.get_vocab(with_added_tokens=True)
    return max((len(token) for token in vocab), default=0) or None


def _model_keeps(model: Any) -> bool:
    """BPE whose unknown characters are bytes, or one unknown token each (a fused
    unknown token, or WordPiece's and WordLevel's, can stand for any length)."""
    return type(model).__name__ == "BPE" and bool(model.byte_fallback or not model.fuse_unk)


def _keeps_length(part: dict[str, Any] | None, keeps: Any) -> bool:
    if part is None:
        return True
    if part.get("type") == "Sequence":
        children = part.get("normalizers") or part.get("pretokenizers") or []
        return all(_keeps_length(child, keeps) for child in children)
    return bool(keeps(part))


def _normalizer_keeps(part: dict[str, Any]) -> bool:
    if part.get("type") == "Replace":   # one string for another at least as long
        pattern = part.get("pattern") or {}
        return "String" in pattern and len(part.get("content", "")) >= len(pattern["String"])
    return part.get("type") in _KEEPING_NORMALIZERS


def _pre_tokenizer_keeps(part: dict[str, Any]) -> bool:
    if part.get("type") == "Split" and part.get("behavior") == "Removed":
        return False
    return part.get("type") in _KEEPING_PRE_TOKENIZERS


def check_prompt_chars(chars: int, context: int | None, longest: int | None,
                       param: str = "prompt") -> None:
    """Refuses (400 context_length_exceeded) a text of `chars` characters
    that cannot fit a context of `context` tokens."""
    if context is None or longest is None or chars <= context * longest:
        return
    raise too_long(chars, math.ceil(chars / longest), context, param)


def too_long(chars: int, at_least: int, context: int, param: str) -> ApiError:
    return bad_request(
        f"This model's maximum context length is {context} tokens. However, the {param} is "
        f"{chars} characters, at least {at_least} tokens.", param, "context_length_exceeded")


class BoundedTokenizer:
    """The gateway's tokenizer for one request's prompt: every text it is asked
    to encode is first checked against the context by its length. With `prefixes`
    and a `salt`, a text that starts as a recent one of the same salt did is
    tokenized only past that start (prompt_prefixes.py); `reused_tokens` counts
    the ids taken from such starts."""

    def __init__(self, tokenizer: Any, context: int | None, longest: int | None,
                 param: str, prefixes: PromptPrefixes | None = None, salt: str | None = None) -> None:
        self._tokenizer = tokenizer
        self._context = context
        self._longest = longest
        self._param = param
        self._prefixes = prefixes if prefixes is not None and prefixes.enabled and salt is not None else None
        self._salt = salt
        self.reused_tokens = 0

    @property
    def bound(self) -> tuple[int | None, int | None, str]:
        """What decides whether a text is refused here: the context, the longest token's
        characters and the parameter an error names."""
        return self._context, self._longest, self._param

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def __len__(self) -> int:
        return len(self._tokenizer)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        check_prompt_chars(len(text), self._context, self._longest, self._param)
        if self._prefixes is not None:
            ids, reused = self._prefixes.encode(self._tokenizer, text, add_special_tokens, self._salt)
            self.reused_tokens += reused
            return ids
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        if self._prefixes is not None:
            return {"input_ids": self.encode(text, add_special_tokens)}
        check_prompt_chars(len(text), self._context, self._longest, self._param)
        return self._tokenizer(text, add_special_tokens=add_special_tokens)
