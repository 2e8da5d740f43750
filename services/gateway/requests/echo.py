"""/v1/completions' `echo` (OpenAI's legacy behaviour, as vLLM has it): each choice's
text starts with its prompt; with `logprobs`, its logprobs start with the prompt's
tokens, the first one's logprob null (nothing comes before it) and every later one's
as the worker scored it (sampling.prompt_logprobs). `max_tokens: 0` with echo scores
the prompt without generating: the scheduler is asked for one token (its smallest
budget), which is dropped; the choice finishes with "length" and no completion tokens.
The delta that brings the prompt's logprobs keeps them (prompt_scores.py reads them too).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from common.types import TokenLogprob
from services.gateway.requests.backend import TokenOutput
from services.gateway.streaming.generation import TextDelta


@dataclass(frozen=True)
class Echo:
    prompt_text: str
    prompt_ids: tuple[int, ...]
    generate: bool = True      # False: max_tokens 0, the prompt alone is the choice
    top_logprobs: int = 0      # alternatives shown per prompt token (the worker may score more)


def prompt_tokens(prompt_ids: Sequence[int], logprobs: Sequence[TokenLogprob],
                  top_logprobs: int = 0) -> tuple[TokenOutput, ...]:
    """The prompt as tokens with their logprobs (`top_logprobs` alternatives each): none for
    the first, then `logprobs` (none for any position they do not reach)."""
    return tuple(TokenOutput(token_id, _shown(logprobs[index - 1], top_logprobs) if 0 < index <= len(logprobs)
                             else None)
                 for index, token_id in enumerate(prompt_ids))


def _shown(logprob: TokenLogprob, top_logprobs: int) -> TokenLogprob:
    return dataclasses.replace(logprob, top=logprob.top[:top_logprobs])


def prompt_texts(tokenizer: Any, prompt: Any, prompts: Sequence[list[int]]) -> list[str]:
    """What each prompt echoes: the text the client sent, or its token ids decoded."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(text, str) for text in prompt):
        return list(prompt)
    return [tokenizer.decode(ids, skip_special_tokens=True) for ids in prompts]


async def echoed(deltas: AsyncIterator[TextDelta], echo: Echo) -> AsyncIterator[TextDelta]:
    """`deltas` with the prompt first: as the delta that brings the prompt's logprobs, or
    (none asked for, or none came) before the first other delta."""
    echoed_prompt = False
    async for delta in deltas:
        if delta.prompt_logprobs and not echoed_prompt:
            echoed_prompt = True
            yield TextDelta(echo.prompt_text, prompt_tokens(echo.prompt_ids, delta.prompt_logprobs, echo.top_logprobs),
                            prompt_logprobs=delta.prompt_logprobs)
            continue
        if not echoed_prompt:
            echoed_prompt = True
            yield TextDelta(echo.prompt_text, prompt_tokens(echo.prompt_ids, ()))
        if echo.generate:
            yield delta
        elif delta.finish_reason is not None:
            usage = dataclasses.replace(delta.usage, completion_tokens=0) if delta.usage is not None else None
            yield TextDelta("", (), "length", usage)
