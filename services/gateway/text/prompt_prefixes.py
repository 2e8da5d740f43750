"""A prompt that starts as a recent prompt did is tokenized only past where the two part
(PROMPT_TOKENS_CACHE_TOKENS).

Long prompts often share their start: the same document under another question, a conversation
sent again with one more turn, one system prompt before every request. Their tokens up to the
point where the texts part are the recent prompt's, wherever BPE cannot merge across that point;
only the rest needs tokenizing (on Gemma 3, ~10 µs for a sentence against ~1.8 ms for a
1,500-token prompt).

Where BPE cannot merge: a pipeline like Gemma's replaces " " by "▁" and runs BPE over the whole
text, and every merge makes a token of the vocabulary. Two neighbouring characters that no token
of the vocabulary holds side by side are never joined, so the text's tokens split there:

    tokens(text) == tokens(text[:i]) + tokens(text[i:])   (special tokens the post-processor
                                                           puts before the text aside)

`SplitRule` finds such points: a space at i whose preceding character is neither a space nor a
"guard" character, one that some token has right before a "▁" (on Gemma 3's 262,144 tokens only
'>', from the single token '>▁</'). It holds for one pipeline shape only, checked at start (any
other tokenizer is tokenized in full): the normalizer one Replace of " " by "▁", no pre-tokenizer
or a Split on " " (which, after that normalizer, never splits), BPE without dropout or word
affixes, no added token with a space in it, no truncation or padding. A probe text split at each
of its points must also give its full tokens back, with and without special tokens (so a
post-processor that adds any after the text turns the rule off).

    entries: (text, ids, starts), least recently used first; starts[j] the character where
             token j begins
    by start: digest(salt, add_special_tokens, text[:L]) -> up to PER_ANCHOR recent entries,
              for each L of ANCHORS the text reaches; a prompt is looked up under the longest
              of its keys that has entries

Entries are shared as the prompt token ids are (prompt_tokens_cache.py): within a tenant with
keys, by everyone without; a salt of None looks nothing up and keeps nothing. The texts and ids
held are bounded by `max_tokens` ids in all. Thread-safe: prompts are tokenized off the event
loop, several at a time.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import re
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

from common.common_prefix import common_prefix_len
from services.gateway.text.text_tokenizer import pipeline_part

log = logging.getLogger(__name__)

# Start lengths a prompt is found by (the longest it reaches first): 256 characters pick out a
# tenant's prompts that share a system prompt or document, the longer ones each conversation of
# many that share that start.
ANCHORS = (256, 1024, 4096, 16384, 65536)
MIN_SAVED_CHARS = 256   # a shared start shorter than this is tokenized in full
PER_ANCHOR = 4          # recent prompts kept per start
MAX_SCAN = 256          # spaces looked at, back from where two prompts part, for a split point
PROBE = ("Dear  team,\n\nThe <b>report</b> > </i> <p> </p> is at 3.5 °C  —  naïve café, 東京 ok 😀 x\t y.  "
         "def f(a, b):\n    return a  >  b </s> end   \n  tail")


class StartsTokenizer(Protocol):
    def encode_with_starts(self, text: str, add_special_tokens: bool = True
                           ) -> tuple[list[int], list[int]]: ...


class SplitRule:
    """Where a text's tokens split exactly: before a space whose preceding character is neither
    a space nor one of `guard`."""

    def __init__(self, guard: frozenset[str]) -> None:
        self.guard = guard

    @classmethod
    def of(cls, tokenizer: Any) -> SplitRule | None:
        """The rule for `tokenizer` (a TextTokenizer), or None when its pipeline is not of the
        shape the rule holds for, or its probe fails."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or not hasattr(tokenizer, "encode_with_starts") or not _splits_exactly(backend):
            return None
        vocab = backend.get_vocab(with_added_tokens=True)
        guard = frozenset(re.findall("([^▁\x00])▁", "\x00".join(vocab)))
        rule = cls(guard)
        return rule if rule.probe(tokenizer) else None

    def split_before(self, text: str, end: int) -> int:
        """The last point <= end - 1 where `text` splits exactly (a space at it), else 0; 0 too
        past MAX_SCAN spaces that are not such points (a text of spaces and guards only would
        otherwise be scanned in Python, holding the GIL, to its start)."""
        at = text.rfind(" ", 0, end)
        for _ in range(MAX_SCAN):
            if at <= 0 or (text[at - 1] != " " and text[at - 1] not in self.guard):
                return max(at, 0)
            at = text.rfind(" ", 0, at)
        return 0

    def probe(self, tokenizer: StartsTokenizer) -> bool:
        """Whether PROBE split at each of its points gives its full tokens back (and a token
        begins at each point)."""
        for special in (True, False):
            ids, starts = tokenizer.encode_with_starts(PROBE, add_special_tokens=special)
            at = len(PROBE)
            while (at := self.split_before(PROBE, at)) > 0:
                head = bisect.bisect_left(starts, at)
                tail, _ = tokenizer.encode_with_starts(PROBE[at:], add_special_tokens=False)
                if head >= len(starts) or starts[head] != at or ids[:head] + tail != ids:
                    log.warning("prompt prefixes off: the tokenizer does not split where expected",
                                extra={"at": at})
                    return False
        return True


def _splits_exactly(backend: Any) -> bool:
    """The pipeline shape SplitRule holds for (module docstring)."""
    if backend.truncation is not None or backend.padding is not None:
        return False
    model = backend.model     # its attributes: serializing it writes the whole vocabulary
    if type(model).__name__ != "BPE" or model.dropout or model.continuing_subword_prefix \
            or model.end_of_word_suffix:
        return False
    normalizer = pipeline_part(backend.normalizer)
    if normalizer != {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}:
        return False
    pre = pipeline_part(backend.pre_tokenizer)
    if pre is not None and not (pre.get("type") == "Split" and pre.get("pattern") == {"String": " "}):
        return False
    added = backend.get_added_tokens_decoder().values()
    return not any(" " in token.content or "▁" in token.content for token in added)


@dataclass(frozen=True)
class _Entry:
    text: str
    ids: array       # int32: 4 bytes an id (a list of ints holds ~36)
    starts: array
    keys: tuple[bytes, ...]     # its starts' keys, one an anchor length it reaches


def _keys(salt: str, add_special_tokens: bool, text: str) -> list[bytes]:
    """The keys of `text`'s starts, the longest first: a digest of (salt, special tokens or not,
    the first L characters) for each L of ANCHORS that `text` reaches."""
    prefix = f"{len(salt)}:{salt}:{int(add_special_tokens)}:".encode("utf-8", "surrogatepass")
    return [hashlib.blake2b(prefix + text[:length].encode("utf-8", "surrogatepass"), digest_size=16).digest()
            for length in reversed(ANCHORS) if len(text) >= length]


class PromptPrefixes:
    """Recent prompts' texts and tokens, by their starts; bounded by the token ids held."""

    def __init__(self, rule: SplitRule | None, max_tokens: int) -> None:
        self.rule = rule
        self.max_tokens = max_tokens
        self._entries: OrderedDict[int, _Entry] = OrderedDict()   # least recently used first
        self._by_start: dict[bytes, list[int]] = {}                # key -> entries, newest first
        self._next_id = 0
        self._lock = threading.Lock()
        self.tokens = 0

    @property
    def enabled(self) -> bool:
        return self.rule is not None and self.max_tokens > 0

    def encode(self, tokenizer: StartsTokenizer, text: str, add_special_tokens: bool,
               salt: str | None) -> tuple[list[int], int]:
        """`text`'s token ids, as tokenizer.encode would give them, and how many of them came
        from a recent prompt of `salt` that starts the same way (0: tokenized in full)."""
        if not self.enabled or salt is None or len(text) < ANCHORS[0] + MIN_SAVED_CHARS:
            return tokenizer.encode_with_starts(text, add_special_tokens)[0], 0
        keys = _keys(salt, add_special_tokens, text)
        entry, at = self._longest(keys, text)
        head = bisect.bisect_left(entry.starts, at) if entry is not None else 0
        if entry is None or head >= len(entry.starts) or entry.starts[head] != at:
            ids, starts = tokenizer.encode_with_starts(text, add_special_tokens)
            head = 0
        else:
            tail, tail_starts = tokenizer.encode_with_starts(text[at:], add_special_tokens=False)
            ids = entry.ids[:head].tolist() + tail
            starts = entry.starts[:head].tolist() + [at + start for start in tail_starts]
        self._put(_Entry(text, array("i", ids), array("i", starts), tuple(keys)))
        return ids, head

    def _longest(self, keys: list[bytes], text: str) -> tuple[_Entry | None, int]:
        """The recent prompt sharing the longest start with `text` among those under its longest
        key that has any, and the last point of that start where `text` splits exactly (None
        when none is far enough in)."""
        with self._lock:
            candidates = next(([self._entries[number] for number in self._by_start[key]]
                               for key in keys if key in self._by_start), [])
        best, best_at = None, 0
        for entry in candidates:
            at = self.rule.split_before(text, common_prefix_len(text, entry.text)) if self.rule else 0
            if at > best_at:
                best, best_at = entry, at
        return (best, best_at) if best_at >= MIN_SAVED_CHARS else (None, 0)

    def _put(self, entry: _Entry) -> None:
        """Keeps `entry` as the most recent under each of its keys (the same text's older entry
        goes; each key keeps PER_ANCHOR), dropping the least recently used past the bound."""
        if len(entry.ids) > self.max_tokens:
            return
        with self._lock:
            for number in list(self._by_start.get(entry.keys[0], ())):
                if self._entries[number].text == entry.text:
                    self._drop(number)
            number, self._next_id = self._next_id, self._next_id + 1
            self._entries[number] = entry
            self.tokens += len(entry.ids)
            for key in entry.keys:
                numbers = self._by_start.setdefault(key, [])
                numbers.insert(0, number)
                for old in numbers[PER_ANCHOR:]:
                    self._unlist(old, key)
            while self.tokens > self.max_tokens:
                self._drop(next(iter(self._entries)))

    def _unlist(self, number: int, key: bytes) -> None:
        """Takes entry `number` off `key`'s list; an entry on no list any more goes."""
        numbers = self._by_start[key]
        numbers.remove(number)
        if not numbers:
            del self._by_start[key]
        entry = self._entries[number]
        if not any(number in self._by_start.get(other, ()) for other in entry.keys):
            del self._entries[number]
            self.tokens -= len(entry.ids)

    def _drop(self, number: int) -> None:
        entry = self._entries.pop(number)
        self.tokens -= len(entry.ids)
        for key in entry.keys:
            numbers = self._by_start.get(key)
            if numbers is not None and number in numbers:
                numbers.remove(number)
                if not numbers:
                    del self._by_start[key]

    def check_invariants(self) -> None:
        """tokens is the ids held, within the bound; every listed entry is held and every held
        one listed under one of its keys at least; at most PER_ANCHOR entries a key; one entry
        a text."""
        with self._lock:
            assert self.tokens == sum(len(entry.ids) for entry in self._entries.values()), "token count drifted"
            assert self.tokens <= max(self.max_tokens, 0), "over the bound"
            listed = {number for numbers in self._by_start.values() for number in numbers}
            assert listed == set(self._entries), "listed and held entries differ"
            for key, numbers in self._by_start.items():
                assert 0 < len(numbers) <= PER_ANCHOR and len(set(numbers)) == len(numbers)
                assert all(key in self._entries[number].keys for number in numbers)
            texts = [(entry.keys[-1], entry.text) for entry in self._entries.values()]
            assert len(set(texts)) == len(texts), "a text kept twice"
