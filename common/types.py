"""Plain values that travel between services; the convert modules map them
to and from protobuf at each edge."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class ConstraintKind(StrEnum):
    """What a structured-output constraint's value is (common.proto's ConstraintKind)."""

    JSON_OBJECT = "json_object"   # any JSON object; no value
    JSON_SCHEMA = "json_schema"   # value: a JSON Schema, as JSON text
    REGEX = "regex"               # value: a regular expression the whole output matches
    CHOICE = "choice"             # choices: the output is exactly one of them
    GRAMMAR = "grammar"           # value: a Lark grammar (or GBNF/EBNF with ::= rules)


@dataclass(frozen=True)
class Constraint:
    """Structured output: every token the worker samples keeps the output a prefix of a match,
    and the output ends (EOS) only where it is a whole match. common/grammar.py turns one into
    the grammar engine's grammar; the gateway checks it there before the request is queued."""

    kind: ConstraintKind
    value: str = ""
    choices: tuple[str, ...] = ()


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0          # 0: greedy
    top_p: float = 1.0                # 1: off
    top_k: int = 0                    # 0: off
    min_p: float = 0.0                # 0: off
    repetition_penalty: float = 1.0   # 1: off; applies to prompt and output tokens
    presence_penalty: float = 0.0     # applies to output tokens (OpenAI semantics)
    frequency_penalty: float = 0.0    # applies to output tokens (OpenAI semantics)
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    min_tokens: int = 0               # EOS and stop_token_ids are banned until then
    stop_token_ids: tuple[int, ...] = ()
    prompt_logprobs: bool = False     # also score the prompt's tokens, with their ranks
    prompt_top_logprobs: int = 0      # alternatives per scored prompt token
    # (token id, bias) pairs, ascending ids: added to the logits before penalties and the
    # draw (OpenAI's logit_bias; -100 in effect bans a token, +100 forces it)
    logit_bias: tuple[tuple[int, float], ...] = ()
    constraint: Constraint | None = None   # structured output, enforced by a token mask

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    logprob: float
    top: tuple[TopLogprob, ...] = ()
    rank: int = 0   # 1: the most likely token (ties count against it); 0: not computed


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
