"""Structured output on the worker: a grammar matcher per constrained sequence.

A constraint (common/types.py's Constraint) becomes an llguidance grammar (common/grammar.py);
`Grammars` keeps the compiled matcher of each constraint seen lately (keyed by the constraint
itself, so a schema sent again compiles once) and hands every sequence a copy. A sequence's
`GrammarState` is built on first use and replays the tokens the sequence already generated,
so a sequence resumed after a preemption or moved from a failed worker (output_token_ids)
continues in the grammar state it had.

The mask of a row is the tokens the grammar forbids next: EOS only where the output is a
whole match, and nothing but EOS once the grammar is finished (or broken), so the sequence
then ends with finish_reason "stop". A row after speculative drafts is masked as if the drafts
were output: the matcher takes them, computes the row's mask and rolls them back; a draft the
grammar refuses ends the rows that count (its own row's mask forbids it, so the draw there
can never keep it).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from common.grammar import check, panic_error, panics_as, parser_limits
from common.types import Constraint

log = logging.getLogger(__name__)

TokenizerFactory = Callable[[], Any]   # -> llguidance.LLTokenizer


def tokenizer_from_model_dir(model_dir: str, vocab_size: int, eos_token_ids: Sequence[int]) -> TokenizerFactory:
    """Builds the matchers' tokenizer from the model directory's tokenizer.json (seconds for a
    262k vocabulary, so the engine builds it in the background at start)."""
    def build():
        import llguidance
        text = (Path(model_dir) / "tokenizer.json").read_text()
        return llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None)
    return build


GRAMMAR_TOKENIZER_MODES = ("first_use", "start")


class GrammarTokenizer:
    """The tokenizer, built once: in a background thread from `start()` (at the engine's start,
    or when the first constrained sequence registers), or on first use; get() waits for it."""

    def __init__(self, build: TokenizerFactory, background: bool = True,
                 on_built: Callable[[], object] | None = None) -> None:
        self._build = build
        self._on_built = on_built       # e.g. hand the build's freed temporaries back (host_memory.py)
        self._value: Any = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._built = False
        self._started = False
        if background:
            self.start()

    def start(self) -> None:
        """Starts the build in a background thread, unless it was started or is done."""
        with self._lock:
            if self._started or self._built:
                return
            self._started = True
        threading.Thread(target=self._ensure, name="grammar-tokenizer", daemon=True).start()

    @property
    def started(self) -> bool:
        return self._started or self._built

    def _ensure(self) -> None:
        with self._lock:
            if self._built:
                return
            try:
                self._value = self._build()
            except Exception as error:  # noqa: BLE001 - reported to every constrained sequence
                log.warning("grammar tokenizer unavailable: %s", error)
                self._error = error
            self._built = True
            if self._on_built is not None:
                self._on_built()

    def wait(self) -> bool:
        """Waits for the build; whether the tokenizer is there."""
        self._ensure()
        return self._error is None

    def get(self) -> Any:
        self._ensure()
        if self._error is not None:
            raise RuntimeError(f"the grammar tokenizer could not be built: {self._error}")
        return self._value


class Grammars:
    """Compiled grammars by constraint (least recently used dropped past `capacity`)."""

    def __init__(self, tokenizer: GrammarTokenizer, vocab_size: int, eos_token_ids: Sequence[int],
                 capacity: int = 64) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(i for i in eos_token_ids if 0 <= i < vocab_size)
        self.capacity = capacity
        self._compiled: OrderedDict[Constraint, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0

    def state(self, constraint: Constraint, replay: Sequence[int] = ()) -> GrammarState:
        return GrammarState(self, constraint, list(replay))

    def matcher(self, constraint: Constraint) -> Any:
        """A fresh matcher of `constraint`, copied from its cached compiled one."""
        with self._lock:
            compiled = self._compiled.get(constraint)
            if compiled is not None:
                self._compiled.move_to_end(constraint)
        if compiled is None:
            import llguidance
            with panics_as(panic_error("a constraint")):
                compiled = llguidance.LLMatcher(self.tokenizer.get(), check(constraint), log_level=0,
                                                limits=parser_limits())
            if compiled.is_error():
                raise ValueError(f"constraint does not compile: {compiled.get_error()}")
            with self._lock:
                self.compiles += 1
                self._compiled[constraint] = compiled
                while len(self._compiled) > self.capacity:
                    self._compiled.popitem(last=False)
        return compiled.deep_copy()

    def only_eos(self) -> np.ndarray:
        banned = np.ones(self.vocab_size, dtype=bool)
        banned[list(self.eos_token_ids)] = False
        return banned


class GrammarState:
    """One sequence's matcher (built, and the replayed tokens taken, on first use)."""

    def __init__(self, grammars: Grammars, constraint: Constraint, replay: list[int]) -> None:
        self.grammars = grammars
        self.constraint = constraint
        self._replay = replay
        self._matcher: Any = None

    @property
    def matcher(self) -> Any:
        if self._matcher is None:
            matcher = self.grammars.matcher(self.constraint)
            if self._replay and not matcher.consume_tokens(self._replay):
                log.warning("resumed output does not match its constraint: %s", matcher.get_error())
            self._matcher = matcher
            self._replay = []
        return self._matcher

    @property
    def finished(self) -> bool:
        """No token but EOS can follow (or the matcher broke)."""
        return self.matcher.is_stopped() or self.matcher.is_error()

    def banned(self) -> np.ndarray:
        """Bool [vocab]: the tokens the grammar forbids next."""
        matcher = self.matcher
        if matcher.is_stopped() or matcher.is_error():
            return self.grammars.only_eos()
        bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[:self.grammars.vocab_size].view(bool)
        if not allowed.any():
            return self.grammars.only_eos()
        return ~allowed

    def banned_rows(self, drafts: Sequence[int]) -> list[np.ndarray]:
        """The masks of a decode's rows: the first, then one after each draft."""
        rows = [self.banned()]
        taken = 0
        try:
            for draft in drafts:
                refused = not 0 <= draft < self.grammars.vocab_size or rows[-1][draft]
                if refused or not self.matcher.consume_token(draft):
                    break
                taken += 1
                rows.append(self.banned())
        finally:
            if taken:
                self.matcher.rollback(taken)
        # Rows after a refused draft are never kept; any mask will do.
        rows += [rows[-1]] * (len(drafts) + 1 - len(rows))
        return rows

    def advance(self, token_ids: Sequence[int]) -> None:
        """Takes the tokens the sequence kept; an EOS after the match is nothing to take."""
        matcher = self.matcher
        for token in token_ids:
            if matcher.is_stopped() or matcher.is_error():
                return
            if not matcher.consume_token(token):
                log.warning("sampled token %d refused by its constraint: %s", token, matcher.get_error())
                return
