"""The OpenAI endpoints driven by the official openai client, against the
app served by uvicorn with a fake scheduler."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from services.gateway.requests.backend import Overloaded, Unavailable
from services.gateway.text.chat_template import ChatMessage, chat_prompt_ids, raw_prompt_ids
from services.gateway.tenancy.tenant_config import load_tenants
from tests.unit.gateway.conftest import REPLY_TEXT
from tests.unit.gateway.fakes import FakeScheduler, ServerThread

MODEL = "gemma-3-270m"   # the default served name (SERVED_MODEL_NAME unset)


@pytest.fixture
def api(serve: Callable[..., ServerThread], fake: FakeScheduler) -> openai.OpenAI:
    server = serve(fake)
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=10)


def test_models_lists_the_served_model(api: openai.OpenAI) -> None:
    models = api.models.list()
    assert [model.id for model in models.data] == [MODEL]


def test_completion_sends_the_prompt_as_is(api: openai.OpenAI, fake: FakeScheduler,
                                           tokenizer: Any, reply_ids: list[int]) -> None:
    completion = api.completions.create(model=MODEL, prompt="The capital of France is",
                                        max_tokens=4, temperature=0)
    assert completion.object == "text_completion" and completion.model == MODEL
    choice = completion.choices[0]
    assert choice.text == tokenizer.decode(reply_ids[:4]) and choice.finish_reason == "length"
    prompt_ids = raw_prompt_ids(tokenizer, "The capital of France is")
    assert list(fake.requests[0].spec.prompt_token_ids) == prompt_ids
    assert fake.requests[0].spec.stop_token_ids == ()
    assert completion.usage.prompt_tokens == len(prompt_ids)
    assert completion.usage.completion_tokens == 4
    assert completion.usage.total_tokens == len(prompt_ids) + 4


def test_completion_stream_with_usage(api: openai.OpenAI, reply_ids: list[int]) -> None:
    chunks = list(api.completions.create(model=MODEL, prompt="Hi", stream=True,
                                         stream_options={"include_usage": True}))
    text = "".join(choice.text for chunk in chunks for choice in chunk.choices)
    assert text == REPLY_TEXT
    finishes = [choice.finish_reason for chunk in chunks for choice in chunk.choices
                if choice.finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(reply_ids)
    assert all(chunk.usage is None for chunk in chunks[:-1])


def test_completion_n_seed_stop_and_logprobs(api: openai.OpenAI, fake: FakeScheduler) -> None:
    completion = api.completions.create(model=MODEL, prompt="Hi", n=2, seed=7, stop=["東"],
                                        logprobs=2, temperature=0.8)
    assert [choice.index for choice in completion.choices] == [0, 1]
    assert all(choice.text == "Paris is " for choice in completion.choices)
    assert all(choice.finish_reason == "stop" for choice in completion.choices)
    assert sorted(request.spec.sampling.seed for request in fake.requests) == [7, 8]
    assert len({request.request_id for request in fake.requests}) == 2
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs)
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)
    assert logprobs.token_logprobs[0] == pytest.approx(-0.25)


def test_completion_accepts_token_ids_and_batches(api: openai.OpenAI, fake: FakeScheduler) -> None:
    completion = api.completions.create(model=MODEL, prompt=[[2, 40, 41], [2, 50]], max_tokens=2)
    assert len(completion.choices) == 2
    assert sorted(list(request.spec.prompt_token_ids) for request in fake.requests) == [[2, 40, 41], [2, 50]]
    assert completion.usage.prompt_tokens == 5 and completion.usage.completion_tokens == 4


def test_chat_applies_the_template(api: openai.OpenAI, fake: FakeScheduler, tokenizer: Any,
                                   reply_ids: list[int]) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    reply = api.chat.completions.create(model=MODEL, messages=messages, user="alice")
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == REPLY_TEXT
    assert reply.choices[0].finish_reason == "stop"
    expected = chat_prompt_ids(tokenizer, [ChatMessage("system", "Be brief."), ChatMessage("user", "Hi")])
    sent = fake.requests[0]
    assert list(sent.spec.prompt_token_ids) == expected
    assert sent.spec.stop_token_ids == (tokenizer.convert_tokens_to_ids("<end_of_turn>"),)
    assert sent.spec.client_id == "alice" and sent.spec.sampling.temperature == 1.0
    assert reply.usage.prompt_tokens == len(expected)
    assert reply.usage.completion_tokens == len(reply_ids)


def test_chat_stream_with_usage_and_n(api: openai.OpenAI) -> None:
    stream = api.chat.completions.create(model=MODEL, n=2, stream=True,
                                         stream_options={"include_usage": True},
                                         messages=[{"role": "user", "content": "Hi"}])
    chunks = list(stream)
    for index in (0, 1):
        deltas = [choice.delta for chunk in chunks for choice in chunk.choices if choice.index == index]
        assert deltas[0].role == "assistant"
        assert "".join(delta.content or "" for delta in deltas) == REPLY_TEXT
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)


def test_chat_logprobs_and_vllm_extras(api: openai.OpenAI, fake: FakeScheduler) -> None:
    reply = api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        logprobs=True, top_logprobs=2, max_completion_tokens=3, seed=11,
        extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "ignore_eos": True,
                    "min_tokens": 2, "priority": 4, "session_id": "sess"})
    content = reply.choices[0].logprobs.content
    assert len(content) == 3 and all(len(entry.top_logprobs) == 2 for entry in content)
    assert content[0].bytes == list(content[0].token.encode())
    sent = fake.requests[0]
    assert sent.spec.max_tokens == 3 and sent.spec.min_tokens == 2 and sent.spec.ignore_eos
    assert (sent.spec.sampling.top_k, sent.spec.sampling.seed, sent.spec.priority) == (5, 11, 4)
    assert sent.spec.sampling.min_p == pytest.approx(0.1)
    assert sent.spec.sampling.repetition_penalty == pytest.approx(1.2)
    assert (sent.spec.client_id, sent.spec.session_id) == ("sess", "sess")


def test_errors_reach_the_client_as_openai_errors(api: openai.OpenAI, fake: FakeScheduler) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError) as bad:
        api.chat.completions.create(model=MODEL, messages=messages, temperature=5)
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        api.chat.completions.create(model=MODEL, messages=[{"role": "tool", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        api.completions.create(model=MODEL, prompt="")
    with pytest.raises(openai.BadRequestError):
        api.completions.create(model=MODEL, prompt="Hi", max_tokens=100_000)
    fake.reject = Overloaded("queue full", retry_after_s=2)
    with pytest.raises(openai.RateLimitError) as busy:
        api.chat.completions.create(model=MODEL, messages=messages, stream=True)
    assert busy.value.response.headers["retry-after"] == "2"
    fake.reject = Unavailable("no worker")
    with pytest.raises(openai.InternalServerError) as down:
        api.completions.create(model=MODEL, prompt="Hi")
    assert down.value.status_code == 503


def test_schema_errors_are_422(api: openai.OpenAI) -> None:
    base = str(api.base_url).rstrip("/")
    response = httpx.post(f"{base}/chat/completions", json={"model": MODEL, "messages": "Hi"})
    assert response.status_code == 422
    assert response.json()["error"]["param"] == "messages"


def test_api_key_is_checked_and_becomes_the_client(serve: Callable[..., ServerThread],
                                                   fake: FakeScheduler) -> None:
    server = serve(fake, tenants=load_tenants("acme=secret"))
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    right = openai.OpenAI(base_url=f"{server.url}/v1", api_key="secret", max_retries=0)
    right.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert fake.requests[0].spec.client_id == "acme"


def test_chat_logprob_bytes_of_split_characters(serve: Callable[..., ServerThread],
                                                tokenizer: Any) -> None:
    ids = tokenizer.encode("東京 🙂", add_special_tokens=False)  # byte-level pieces of characters
    server = serve(FakeScheduler(reply_ids=ids))
    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=10)
    reply = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                        logprobs=True, max_tokens=len(ids))
    content = reply.choices[0].logprobs.content
    assert any("\ufffd" in entry.token for entry in content)
    assert b"".join(bytes(entry.bytes) for entry in content) == "東京 🙂".encode()
    assert reply.choices[0].message.content == "東京 🙂"
