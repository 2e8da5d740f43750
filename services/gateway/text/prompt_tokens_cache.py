"""The token ids of prompts tokenized recently, so that a prompt sent again is not tokenized
again (PROMPT_TOKENS_CACHE_TOKENS).

The same prompt arrives again more often than it seems: `pass@k` evaluations and best-of
clients send one prompt k times as k requests, retries resend it whole, and a prompt whose KV
blocks are all cached (the worker's exact match) answers its first token in a few milliseconds,
of which tokenizing a long prompt was the largest part (~2-4 ms for 1,500 tokens).

    key = blake2b(salt, the builder's name, its arguments, the context bound)
    entries: key -> ids (array of int32), least recently used first

What may share an entry is the prefix cache's rule (tenancy/identity.py): with keys, a tenant
only ever hits its own entries, so no tenant learns from a faster tokenization that another sent
the same text; without keys (the global scope) everyone shares, as they share cached prefixes.
A salt of None (the `user` scope) is not cached. Arguments are keyed by their `repr`: an argument
without a stable one (an object's address) only ever misses. Refused prompts are not kept (the
builder raised); the bound is checked again on every miss, and a hit was checked under the same
bound. The cache holds at most `max_tokens` ids in all (4 bytes each) and never one entry longer
than that. Pure: no I/O, no clock; the gateway calls it on its event loop.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

DEFAULT_MAX_TOKENS = 1 << 20


class PromptTokensCache:
    """An LRU of prompt token ids, bounded by the ids it holds."""

    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        self.max_tokens = max_tokens
        self._entries: OrderedDict[bytes, array] = OrderedDict()
        self.tokens = 0          # ids held, across entries
        self.hits = 0
        self.misses = 0

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0

    def __len__(self) -> int:
        return len(self._entries)

    def key(self, salt: str | None, build: Callable[..., Any], args: Sequence[Any], bound: Any) -> bytes | None:
        """The entry's key for `build(tokenizer, *args)` under `bound` (whatever limits the
        tokenizing: the context), for requests of `salt`; None: not cached (cache off, or a
        salt of None)."""
        if not self.enabled or salt is None:
            return None
        text = repr((salt, build.__module__, build.__qualname__, tuple(args), bound))
        return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()

    def get(self, key: bytes | None) -> list[int] | None:
        """The ids kept under `key` (a new list), else None; a hit becomes the most recent."""
        if key is None:
            return None
        ids = self._entries.get(key)
        if ids is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return ids.tolist()

    def put(self, key: bytes | None, ids: Sequence[int]) -> None:
        """Keeps `ids` under `key`, dropping the least recently used entries past the bound."""
        if key is None or not ids or len(ids) > self.max_tokens:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.tokens -= len(old)
        self._entries[key] = array("i", ids)
        self.tokens += len(ids)
        while self.tokens > self.max_tokens:
            _, dropped = self._entries.popitem(last=False)
            self.tokens -= len(dropped)

    def check_invariants(self) -> None:
        """tokens is the sum of the entries' lengths and within the bound."""
        assert self.tokens == sum(len(ids) for ids in self._entries.values()), "token count drifted"
        assert 0 <= self.tokens <= max(self.max_tokens, 0), "over the bound"
