"""Through the real stack (tiny model) with the official openai client:
logit_bias and stop_token_ids on completions and chat, /tokenize and
/detokenize, and tool calling (tools and results through a checkpoint's chat
template; replies read for calls)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from fairserve.launcher.stack import Stack
from tests.fixtures.tiny_model import save_tiny_model
from tests.fixtures.tool_template import TOOL_CHAT_TEMPLATE
from tests.integration.conftest import start_stack

TINY_EOS_ID = 1   # tests/fixtures/tiny_model.py's configs
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city"]}}}


def make_client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=60)


def tokenize(stack: Stack, **body: Any) -> dict[str, Any]:
    reply = httpx.post(f"{stack.url}/tokenize", json=body, timeout=30)
    assert reply.status_code == 200, reply.text
    return reply.json()


def detokenize(stack: Stack, tokens: list[int]) -> str:
    reply = httpx.post(f"{stack.url}/detokenize", json={"tokens": tokens}, timeout=30)
    assert reply.status_code == 200, reply.text
    return reply.json()["prompt"]


@pytest.fixture(scope="module")
def client(tiny_stack: Stack) -> openai.OpenAI:
    return make_client(tiny_stack)


@pytest.fixture(scope="module")
def model_id(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def forced_id(tiny_stack: Stack) -> int:
    """An ordinary token, to force with a bias."""
    return tokenize(tiny_stack, prompt=" Paris", add_special_tokens=False)["tokens"][0]


# ---- logit_bias and stop_token_ids ----

def test_logit_bias_forces_and_bans_tokens(tiny_stack: Stack, client: openai.OpenAI,
                                           model_id: str, forced_id: int) -> None:
    word = detokenize(tiny_stack, [forced_id])
    args: dict[str, Any] = dict(model=model_id, prompt="The capital of France is", max_tokens=6,
                                temperature=0, extra_body={"ignore_eos": True})
    forced = client.completions.create(**args, logit_bias={str(forced_id): 100})
    assert forced.choices[0].text == word * 6
    sampled = client.completions.create(**{**args, "temperature": 1.0, "seed": 3},
                                        logit_bias={str(forced_id): 100})
    assert sampled.choices[0].text == word * 6
    plain = client.completions.create(**args)
    first = tokenize(tiny_stack, prompt=plain.choices[0].text, add_special_tokens=False)["tokens"][0]
    banned = client.completions.create(**args, logit_bias={str(first): -100})
    assert tokenize(tiny_stack, prompt=banned.choices[0].text,
                    add_special_tokens=False)["tokens"][0] != first
    chat = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0,
        logit_bias={str(forced_id): 100})
    assert chat.choices[0].message.content == word * 4


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_token_id_ends_the_reply_without_showing(client: openai.OpenAI, model_id: str,
                                                        forced_id: int, stream: bool) -> None:
    args: dict[str, Any] = dict(
        model=model_id, prompt="The capital of France is", max_tokens=20, temperature=0,
        logit_bias={str(forced_id): 100}, stream=stream,
        extra_body={"stop_token_ids": [forced_id], "min_tokens": 3})
    if not stream:
        reply = client.completions.create(**args)
        text, reason = reply.choices[0].text, reply.choices[0].finish_reason
        assert reply.usage is not None and reply.usage.completion_tokens == 4
    else:
        chunks = list(client.completions.create(**args))
        text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
        reason = chunks[-1].choices[0].finish_reason
    # min_tokens bans the stop token (and EOS) for 3 tokens; the 4th is the stop
    # token, which ends the reply unseen: the text is those 3 tokens'.
    assert reason == "stop"
    first_three = client.completions.create(
        model=model_id, prompt="The capital of France is", max_tokens=3, temperature=0,
        logit_bias={str(forced_id): -100, str(TINY_EOS_ID): -100})
    assert text == first_three.choices[0].text


def test_bad_token_controls_are_400(tiny_stack: Stack, model_id: str) -> None:
    for field, value in (("logit_bias", {"1000000": 5}), ("logit_bias", {"5": 101}),
                         ("stop_token_ids", [1000000])):
        reply = httpx.post(f"{tiny_stack.url}/v1/completions", json={
            "model": model_id, "prompt": "Hi", "max_tokens": 2, field: value}, timeout=30)
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == field


# ---- /tokenize and /detokenize ----

def test_tokenize_and_detokenize(tiny_stack: Stack, client: openai.OpenAI, model_id: str) -> None:
    prompt = "Zwei Äpfel kosten 3 €"
    body = tokenize(tiny_stack, model=model_id, prompt=prompt)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 1024
    completion = client.completions.create(model=model_id, prompt=prompt, max_tokens=1)
    assert completion.usage is not None and completion.usage.prompt_tokens == body["count"]
    assert detokenize(tiny_stack, body["tokens"]) == "<bos>" + prompt
    messages = [{"role": "user", "content": "Hello!"}]
    chat_ids = tokenize(tiny_stack, model=model_id, messages=messages)
    chat = client.chat.completions.create(model=model_id, messages=messages, max_tokens=1)
    assert chat.usage is not None and chat.usage.prompt_tokens == chat_ids["count"]
    assert detokenize(tiny_stack, chat_ids["tokens"]).endswith("<start_of_turn>model\n")
    bad = httpx.post(f"{tiny_stack.url}/detokenize", json={"tokens": [10**6]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


# ---- tools, with a checkpoint template that has them ----

@pytest.fixture(scope="module")
def tool_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    model_dir = save_tiny_model(tmp_path_factory.mktemp("tiny-tools"), chat_template=TOOL_CHAT_TEMPLATE)
    stack = start_stack(tmp_path_factory.mktemp("tool-stack"), model_dir)
    yield stack
    stack.stop()


CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]


def test_tools_and_results_go_through_the_checkpoint_template(tool_stack: Stack) -> None:
    ids = tokenize(tool_stack, messages=CONVERSATION, tools=[WEATHER])["tokens"]
    text = detokenize(tool_stack, ids)
    assert json.dumps(WEATHER) in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<start_of_turn>tool\n<tool_response>\n18 C and sunny\n</tool_response>" in text
    assert text.endswith("<start_of_turn>model\n")


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_conversation_through_the_openai_client(tool_stack: Stack, stream: bool) -> None:
    client = make_client(tool_stack)
    model = client.models.list().data[0].id
    args: dict[str, Any] = dict(model=model, messages=CONVERSATION, tools=[WEATHER], max_tokens=8,
                                temperature=0)
    prompt_tokens = tokenize(tool_stack, messages=CONVERSATION, tools=[WEATHER])["count"]
    if stream:
        chunks = list(client.chat.completions.create(**args, stream=True,
                                                     stream_options={"include_usage": True}))
        usage = chunks[-1].usage
        deltas = [chunk.choices[0] for chunk in chunks if chunk.choices]
        content = "".join(delta.delta.content or "" for delta in deltas)
        calls = [call for delta in deltas for call in delta.delta.tool_calls or ()]
        finish_reason = deltas[-1].finish_reason
    else:
        reply = client.chat.completions.create(**args)
        usage, choice = reply.usage, reply.choices[0]
        content, calls = choice.message.content, choice.message.tool_calls
        finish_reason = choice.finish_reason
    assert usage is not None and usage.prompt_tokens == prompt_tokens
    # A random model writes no call: its text comes back as content, untouched.
    assert finish_reason in ("stop", "length")
    assert not calls and content
    none = client.chat.completions.create(**{**args, "tool_choice": "none"})
    assert none.choices[0].message.content == content


def joined(pieces: list[Any]) -> list[tuple[str, str]]:
    """Streamed tool-call pieces as whole calls: a piece with an id starts one,
    the others carry more of its arguments."""
    calls: dict[int, list[str]] = {}
    for piece in pieces:
        entry = calls.setdefault(piece.index, ["", ""])
        entry[0] += (piece.function.name or "") if piece.function else ""
        entry[1] += (piece.function.arguments or "") if piece.function else ""
    return [(name, arguments) for name, arguments in (calls[i] for i in sorted(calls))]


BOUNDED_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["C", "F"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}
BOUNDED_TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
    "required": ["zone"], "additionalProperties": False}}}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "get_time"}},
    {"type": "function", "function": {"name": "get_weather"}}])
def test_a_required_call_validates_against_the_tools_parameters(
        tool_stack: Stack, tool_choice: Any, stream: bool) -> None:
    client = make_client(tool_stack)
    model = client.models.list().data[0].id
    tools = [BOUNDED_WEATHER, BOUNDED_TIME]
    args: dict[str, Any] = dict(model=model, messages=CONVERSATION[:2], tools=tools,
                                tool_choice=tool_choice, parallel_tool_calls=False,
                                max_tokens=120, temperature=0.8, seed=7, n=2)
    if stream:
        chunks = list(client.chat.completions.create(**args, stream=True))
        per_choice: dict[int, list[Any]] = {}
        reasons: dict[int, str] = {}
        for chunk in chunks:
            for choice in chunk.choices:
                per_choice.setdefault(choice.index, []).extend(choice.delta.tool_calls or ())
                if choice.finish_reason:
                    reasons[choice.index] = choice.finish_reason
        results = [(reasons[i], joined(per_choice[i])) for i in sorted(per_choice)]
    else:
        reply = client.chat.completions.create(**args)
        results = [(choice.finish_reason, [(c.function.name, c.function.arguments)
                                           for c in choice.message.tool_calls or ()])
                   for choice in reply.choices]
    assert len(results) == 2
    by_name = {tool["function"]["name"]: tool["function"]["parameters"] for tool in tools}
    for finish_reason, calls in results:
        assert finish_reason == "tool_calls", results
        assert len(calls) == 1
        name, arguments = calls[0]
        if isinstance(tool_choice, dict):
            assert name == tool_choice["function"]["name"]
        jsonschema.validate(json.loads(arguments), by_name[name])
