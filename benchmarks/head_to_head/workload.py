"""What the benchmark sends, built from the load simulator's texts.

* `unique_requests`: /v1/completions prompts that each start with their own
  random ticket code, then an article and a question: no two share more than
  a token or two at the start, so no prefix cache hides prefill.
* `ChatMix`: a chat-like mix for the prefix-cache workload: conversations
  that share one of a few long system texts and go on for a few turns, each
  turn's prompt holding the whole conversation so far (the server's own
  replies included), as raw text over /v1/completions (the default model is a
  base model, with no chat template).

Everything is drawn from a seeded generator: every system gets the same prompts
in the same order, and the same max_tokens.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

from loadsim import default_texts

SHORT_BODIES = tuple(f"Q: {q}\nA:" for q in default_texts.SHORT_QUESTIONS)


def _ticket(rng: random.Random) -> str:
    letters = "".join(rng.choice(string.ascii_uppercase) for _ in range(3))
    return f"{letters}-{rng.randint(1000, 9999)}"


def unique_prompt(rng: random.Random, short: bool) -> str:
    """A prompt that starts with a random ticket code; `short` for the tiny model."""
    if short:
        return f"{_ticket(rng)} {rng.choice(SHORT_BODIES)}"
    article = rng.choice(default_texts.ARTICLES)
    question = rng.choice(default_texts.SHORT_QUESTIONS)
    return f"{_ticket(rng)}: {article}\n\nQ: {question}\nA:"


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str
    max_tokens: int


def unique_requests(count: int, max_tokens: int, seed: int, short: bool = False) -> list[CompletionRequest]:
    rng = random.Random(f"unique:{seed}")
    return [CompletionRequest(unique_prompt(rng, short), max_tokens) for _ in range(count)]


SYSTEM_TEXTS = (default_texts.MANUAL_SYSTEM, default_texts.SUMMARY_SYSTEM + "\n\n" + default_texts.ARTICLES[0])


@dataclass(frozen=True)
class Conversation:
    system: str                         # shared by every conversation that drew it
    questions: tuple[str, ...]          # one per turn


class ChatMix:
    """Seeded conversations: each draws one of the shared system texts and 1..max_turns questions."""

    def __init__(self, seed: int, max_turns: int, short: bool = False) -> None:
        self._rng = random.Random(f"chat:{seed}")
        self._max_turns = max_turns
        self._systems = ("You answer support questions briefly.",) if short else SYSTEM_TEXTS
        self._questions = default_texts.SHORT_QUESTIONS[:4] if short else (
            *default_texts.MANUAL_QUESTIONS, *default_texts.SHORT_QUESTIONS)

    def conversation(self) -> Conversation:
        turns = self._rng.randint(1, self._max_turns)
        return Conversation(self._rng.choice(self._systems),
                            tuple(self._rng.choice(self._questions) for _ in range(turns)))


def chat_prompt(system: str, history: list[tuple[str, str]], question: str) -> str:
    """The raw-text prompt of one turn: the system text, earlier turns with their replies, the question."""
    lines = [system, ""]
    for asked, answer in history:
        lines += [f"User: {asked}", f"Assistant:{answer}"]
    lines += [f"User: {question}", "Assistant:"]
    return "\n".join(lines)
