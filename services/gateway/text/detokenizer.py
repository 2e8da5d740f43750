"""Incremental detokenization: token ids in, text deltas out.

A character can span several tokens (byte-level BPE splits multibyte UTF-8,
and SentencePiece byte fallback does too), and some tokenizers only decide a
token's leading space from its left neighbour. So each step decodes a short
window of recent tokens twice, with and without the newest ones, and emits the
difference; while the window ends in an incomplete character (decoded as
U+FFFD) the text is held back until the next token completes it.
"""

from __future__ import annotations

import re
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


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins for the 256 byte values
    (printable Latin-1 bytes stand for themselves, the rest map from U+0100 on)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    alphabet = {chr(byte): byte for byte in kept}
    extra = 0
    for byte in range(256):
        if byte not in kept:
            alphabet[chr(256 + extra)] = byte
            extra += 1
    return alphabet


_BYTE_LEVEL = _byte_level_alphabet()


def token_bytes(tokenizer: Any, token_id: int, text: str) -> bytes:
    """The token's own UTF-8 bytes (OpenAI's logprob `bytes`). `text` is the
    token decoded alone; when that holds an incomplete character (U+FFFD) the
    bytes come from the vocabulary entry: a SentencePiece byte-fallback piece
    (<0xE2>) or a byte-level BPE token."""
    if REPLACEMENT_CHAR not in text:
        return text.encode()
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if not isinstance(piece, str):
        return text.encode()
    fallback = _BYTE_FALLBACK.fullmatch(piece)
    if fallback:
        return bytes([int(fallback.group(1), 16)])
    if piece and all(char in _BYTE_LEVEL for char in piece):
        return bytes(_BYTE_LEVEL[char] for char in piece)
    return text.encode()
