"""Incremental detokenization: token ids in, text deltas out.

A character can span several tokens (byte-level BPE splits multibyte UTF-8,
and SentencePiece byte fallback does too), and some tokenizers only decide a
token's leading space from its left neighbour. So each step decodes a short
window of recent tokens twice, with and without the newest ones, and emits the
difference; while the window ends in an incomplete character (decoded as
U+FFFD) the text is held back until the next token completes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        # A few prompt tokens give the first output token its left context.
        self._ids: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=self._skip_special,
                                      clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> str:
        """Adds one token and returns the text it completes (maybe empty)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text):]

    def flush(self) -> str:
        """Returns the held-back text at the end of the sequence, even when it
        ends in an incomplete character."""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full_text[len(prefix_text):] if full_text.startswith(prefix_text) else ""
