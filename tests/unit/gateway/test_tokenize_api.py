"""/tokenize and /detokenize in vLLM's shapes: the ids a prompt or a
conversation is sent as, and back; bad input is a 4xx naming the field."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from services.gateway.text.chat_template import ChatMessage, chat_prompt_ids, raw_prompt_ids
from tests.unit.gateway.fakes import FakeScheduler

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


async def test_a_prompt_tokenizes_as_a_completion_sends_it(client: httpx.AsyncClient,
                                                           tokenizer: Any) -> None:
    reply = await client.post("/tokenize", json={"model": "gemma-3-270m", "prompt": "Hello world"})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["tokens"] == raw_prompt_ids(tokenizer, "Hello world")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 512
    bare = (await client.post("/tokenize", json={"prompt": "Hello world",
                                                 "add_special_tokens": False})).json()
    assert bare["tokens"] == body["tokens"][1:]          # no BOS
    empty = (await client.post("/tokenize", json={"prompt": "", "add_special_tokens": False})).json()
    assert empty == {"count": 0, "max_model_len": 512, "tokens": []}
    strs = (await client.post("/tokenize", json={"prompt": "Hi", "return_token_strs": True})).json()
    assert strs["token_strs"] == [tokenizer.convert_ids_to_tokens(i) for i in strs["tokens"]]


async def test_messages_tokenize_as_a_chat_request_sends_them(
        client: httpx.AsyncClient, fake: FakeScheduler, tokenizer: Any) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    reply = await client.post("/tokenize", json={"messages": messages})
    assert reply.status_code == 200, reply.text
    tokens = reply.json()["tokens"]
    chat = await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert chat.status_code == 200
    assert tokens == list(fake.requests[0].spec.prompt_token_ids)
    no_prompt = (await client.post("/tokenize", json={"messages": messages,
                                                      "add_generation_prompt": False})).json()
    assert tokens[:no_prompt["count"]] == no_prompt["tokens"] and no_prompt["count"] < len(tokens)
    with_tools = (await client.post("/tokenize", json={"messages": messages,
                                                       "tools": [WEATHER]})).json()
    expected = chat_prompt_ids(tokenizer, [ChatMessage("system", "Be brief."),
                                           ChatMessage("user", "Hi")], [WEATHER])
    assert with_tools["tokens"] == expected
    doubled = (await client.post("/tokenize", json={"messages": messages,
                                                    "add_special_tokens": True})).json()
    assert doubled["tokens"] == [tokenizer.bos_token_id, *tokens]


async def test_detokenize_gives_the_text_back(client: httpx.AsyncClient, tokenizer: Any) -> None:
    ids = raw_prompt_ids(tokenizer, "Zwei Äpfel, 東京 🙂")
    reply = await client.post("/detokenize", json={"model": "gemma-3-270m", "tokens": ids})
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"prompt": "<bos>Zwei Äpfel, 東京 🙂"}
    assert (await client.post("/detokenize", json={"tokens": []})).json() == {"prompt": ""}


@pytest.mark.parametrize("path, body, status, param", [
    ("/detokenize", {"tokens": [5, 384]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, 422, None),
    ("/detokenize", {"tokens": "5"}, 422, None),
    ("/detokenize", {}, 422, None),
    ("/tokenize", {}, 400, "messages"),
    ("/tokenize", {"prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}]}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 422, None),
    ("/tokenize", {"messages": [{"role": "narrator", "content": "x"}]}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}],
                   "tools": [{"type": "function", "function": {"name": "bad name"}}]}, 400,
     "tools.0.function.name"),
    ("/tokenize", {"prompt": "Hi", "chat_template": "{{ x }}"}, 400, "chat_template"),
    ("/tokenize", {"prompt": "\ud800"}, 400, "prompt"),
])
async def test_bad_input_is_a_4xx(client: httpx.AsyncClient, path: str, body: dict[str, Any],
                                  status: int, param: str | None) -> None:
    import json

    reply = await client.post(path, content=json.dumps(body),
                              headers={"content-type": "application/json"})
    assert reply.status_code == status, reply.text
    if param is not None:
        assert reply.json()["error"]["param"] == param


async def test_add_special_tokens_steers_what_a_generation_is_sent(
        client: httpx.AsyncClient, fake: FakeScheduler) -> None:
    """Completions add BOS unless told not to, chat adds it on top of the template only
    when told to: each the same ids /tokenize gives for the same field."""
    sent: list[list[int]] = []
    messages = [{"role": "user", "content": "Hi"}]
    for path, body, tokenize in [
            ("/v1/completions", {"prompt": "Hello world"}, {"prompt": "Hello world"}),
            ("/v1/chat/completions", {"messages": messages}, {"messages": messages})]:
        for flag in (True, False):
            reply = await client.post(path, json={**body, "max_tokens": 2, "add_special_tokens": flag})
            assert reply.status_code == 200, reply.text
            sent.append(list(fake.requests[-1].spec.prompt_token_ids))
            expected = (await client.post("/tokenize", json={**tokenize, "add_special_tokens": flag})).json()
            assert sent[-1] == expected["tokens"], (path, flag)
    completion_bos, completion_bare, chat_doubled, chat_plain = sent
    assert completion_bos[1:] == completion_bare and chat_doubled[1:] == chat_plain
    wrong = await client.post("/v1/completions", json={"prompt": "x", "add_special_tokens": [1]})
    assert wrong.status_code in (400, 422) and "add_special_tokens" in wrong.text
