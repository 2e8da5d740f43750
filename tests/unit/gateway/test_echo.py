"""/v1/completions with echo (OpenAI's legacy behaviour, as vLLM has it): the prompt comes
first in the text and, with logprobs, in the logprobs (the first token's null, the others
the prompt's scores); max_tokens 0 scores a text without generating."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from services.gateway.text.chat_template import raw_prompt_ids
from tests.unit.gateway.fakes import FakeScheduler, ServerThread

MODEL = "gemma-3-270m"   # the default served name (SERVED_MODEL_NAME unset)
PROMPT = "The capital of France is"


@pytest.fixture
def api(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=10)


def test_echo_with_logprobs_returns_the_prompt_scored_then_the_completion(
        api: openai.OpenAI, fake: FakeScheduler, tokenizer: Any, reply_ids: list[int]) -> None:
    completion = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, echo=True, logprobs=2)
    prompt_ids = raw_prompt_ids(tokenizer, PROMPT)
    assert fake.requests[0].spec.sampling.prompt_logprobs
    choice = completion.choices[0]
    assert choice.text == PROMPT + tokenizer.decode(reply_ids[:3])
    logprobs = choice.logprobs
    total = len(prompt_ids) + 3
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == total
    assert logprobs.tokens[:len(prompt_ids)] == [tokenizer.decode([i]) for i in prompt_ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1:len(prompt_ids)] == pytest.approx(
        [-p / 10 for p in range(1, len(prompt_ids))])
    assert all(len(top) <= 2 for top in logprobs.top_logprobs[1:])
    assert logprobs.token_logprobs[len(prompt_ids):] == pytest.approx([-0.25] * 3)
    offsets = logprobs.text_offset
    assert offsets == sorted(offsets) and offsets[0] == 0
    assert completion.usage.prompt_tokens == len(prompt_ids) and completion.usage.completion_tokens == 3


def test_echo_with_max_tokens_zero_scores_without_generating(
        api: openai.OpenAI, fake: FakeScheduler, tokenizer: Any) -> None:
    completion = api.completions.create(model=MODEL, prompt=[PROMPT, "Hello"], max_tokens=0, echo=True,
                                        logprobs=0)
    assert [request.spec.max_tokens for request in fake.requests] == [1, 1]
    for choice, text in zip(completion.choices, [PROMPT, "Hello"]):
        ids = raw_prompt_ids(tokenizer, text)
        assert choice.text == text and choice.finish_reason == "length"
        assert len(choice.logprobs.tokens) == len(ids)
        assert choice.logprobs.token_logprobs[0] is None
        assert choice.logprobs.token_logprobs[1:] == pytest.approx([-p / 10 for p in range(1, len(ids))])
    assert completion.usage.completion_tokens == 0


def test_echo_without_logprobs_prefixes_the_text_and_scores_nothing(
        api: openai.OpenAI, fake: FakeScheduler, tokenizer: Any, reply_ids: list[int]) -> None:
    completion = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, echo=True)
    assert completion.choices[0].text == PROMPT + tokenizer.decode(reply_ids[:2])
    assert completion.choices[0].logprobs is None
    assert not fake.requests[0].spec.sampling.prompt_logprobs


def test_streamed_echo_sends_the_prompt_first(server: ServerThread, tokenizer: Any) -> None:
    import httpx

    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "echo": True, "logprobs": 1, "stream": True}
    with httpx.Client(timeout=10) as client:
        lines = client.post(f"{server.url}/v1/completions", json=body).text.splitlines()
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    first = chunks[0]["choices"][0]
    assert first["text"] == PROMPT
    assert first["logprobs"]["token_logprobs"][0] is None
    assert len(first["logprobs"]["tokens"]) == len(raw_prompt_ids(tokenizer, PROMPT))


def test_max_tokens_zero_without_echo_is_refused(api: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError):
        api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)
