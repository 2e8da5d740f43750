"""Tool calling: tools and tool_choice checked, earlier calls and tool
results rendered through the chat template, required calls constrained, and
the reply's calls in the shapes the openai client reads, streamed and not
(the parsers alone: test_tool_parsers.py)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from common.types import ConstraintKind
from services.gateway.text.chat_template import ChatMessage, ToolCallRecord, chat_prompt_ids
from services.gateway.requests.chat_tools import (
    ToolChoice,
    ToolMode,
    call_schema,
    check_tools,
    resolve_tool_choice,
)
from services.gateway.errors import ApiError
from services.gateway.requests.schemas import ToolBody, ToolChoiceBody
from tests.fixtures.tool_template import TOOL_CHAT_TEMPLATE
from tests.unit.gateway.fakes import EOS_ID, FakeScheduler, ServerThread

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["C", "F"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'


def tools_of(*tools: dict[str, Any]) -> Any:
    return check_tools([ToolBody.model_validate(tool) for tool in tools])


@pytest.mark.parametrize("tool, param", [
    ({"type": "retrieval", "function": {"name": "f"}}, "tools.0.type"),
    ({"type": "function", "function": {"name": "bad name!"}}, "tools.0.function.name"),
    ({"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}},
     "tools.0.function.parameters"),
])
def test_bad_tools_are_named(tool: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as raised:
        tools_of(tool)
    assert raised.value.status == 400 and raised.value.param == param


def test_tool_names_are_unique_and_parameters_default_to_an_empty_object() -> None:
    with pytest.raises(ApiError) as raised:
        tools_of(TIME, TIME)
    assert raised.value.param == "tools.1.function.name"
    [tool] = tools_of({"type": "function", "function": {"name": "ping"}})
    assert tool.parameters == {"type": "object", "properties": {}}
    assert tool.as_template() == {"type": "function",
                                  "function": {"name": "ping", "parameters": tool.parameters}}


def test_tool_choice_resolves_like_openai() -> None:
    tools = tools_of(WEATHER, TIME)
    assert resolve_tool_choice(None, tools, None) == ToolChoice(ToolMode.AUTO)
    assert resolve_tool_choice(None, (), None) == ToolChoice(ToolMode.NONE)
    assert resolve_tool_choice("none", (), None).mode is ToolMode.NONE
    assert resolve_tool_choice("required", tools, False) == ToolChoice(ToolMode.REQUIRED, parallel=False)
    named = ToolChoiceBody.model_validate({"type": "function", "function": {"name": "get_time"}})
    assert resolve_tool_choice(named, tools, None) == ToolChoice(ToolMode.NAMED, "get_time", False)
    for choice, tools_given, param in [
            ("sometimes", tools, "tool_choice"), ("auto", (), "tool_choice"),
            ("required", (), "tool_choice"),
            (ToolChoiceBody.model_validate({"type": "function", "function": {"name": "nope"}}),
             tools, "tool_choice.function.name")]:
        with pytest.raises(ApiError) as raised:
            resolve_tool_choice(choice, tools_given, None)
        assert raised.value.param == param


def test_the_call_schema_admits_exactly_the_calls_the_tools_allow() -> None:
    tools = tools_of(WEATHER, TIME)
    schema = call_schema(tools, ToolChoice(ToolMode.REQUIRED))
    jsonschema.Draft202012Validator.check_schema(schema)
    valid = [[{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C", "days": 7}}],
             [{"name": "get_time", "arguments": {"zone": "CET"}},
              {"name": "get_weather", "arguments": {"city": "Rome"}}]]
    invalid = [[], [{"name": "get_weather", "arguments": {"city": "Oslo", "days": 9}}],
               [{"name": "get_weather", "arguments": {"unit": "C"}}],
               [{"name": "get_weather", "arguments": {"city": "Oslo", "extra": 1}}],
               [{"name": "launch", "arguments": {}}], {"name": "get_time", "arguments": {"zone": "x"}}]
    for value in valid:
        jsonschema.validate(value, schema)
    for value in invalid:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(value, schema)
    named = call_schema(tools, ToolChoice(ToolMode.NAMED, "get_time", parallel=False))
    jsonschema.validate([{"name": "get_time", "arguments": {"zone": "UTC"}}], named)
    for value in ([{"name": "get_weather", "arguments": {"city": "Oslo"}}],
                  [{"name": "get_time", "arguments": {"zone": "a"}}] * 2):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(value, named)


CONVERSATION = [
    ChatMessage("system", "Be brief."), ChatMessage("user", "Weather in Paris?"),
    ChatMessage("assistant", "", (ToolCallRecord("call_1", "get_weather", {"city": "Paris"}),)),
    ChatMessage("tool", "18 C and sunny", tool_call_id="call_1")]


def test_the_built_in_format_writes_tools_calls_and_results(tokenizer: Any) -> None:
    text = tokenizer.decode(chat_prompt_ids(tokenizer, CONVERSATION, [WEATHER]))
    assert text.startswith("<bos><start_of_turn>user\nBe brief.\n\nYou may call")
    assert json.dumps(WEATHER) in text
    assert ('<start_of_turn>model\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call><end_of_turn>') in text
    assert text.endswith("<start_of_turn>user\n<tool_response>\n18 C and sunny\n</tool_response>"
                         "<end_of_turn>\n<start_of_turn>model\n")
    plain = tokenizer.decode(chat_prompt_ids(tokenizer, CONVERSATION[:2], add_generation_prompt=False))
    assert "<tools>" not in plain and not plain.endswith("<start_of_turn>model\n")


def test_a_checkpoint_template_gets_the_tools_and_the_calls(tokenizer: Any) -> None:
    templated = tokenizer
    original = templated.chat_template
    templated.chat_template = TOOL_CHAT_TEMPLATE
    try:
        text = templated.decode(chat_prompt_ids(templated, CONVERSATION, [WEATHER]))
    finally:
        templated.chat_template = original
    assert json.dumps(WEATHER) in text and "Be brief." in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<start_of_turn>tool\n<tool_response>\n18 C and sunny\n</tool_response>" in text


# ---- through the app, with the openai client ----

@pytest.fixture
def tool_reply(tokenizer: Any) -> Callable[[str], list[int]]:
    return lambda text: [*tokenizer.encode(text, add_special_tokens=False), EOS_ID]


@pytest.fixture
def serve_reply(make_app: Callable[..., Any], tool_reply: Callable[[str], list[int]]
                ) -> Iterator[Callable[[str], tuple[openai.OpenAI, FakeScheduler]]]:
    servers: list[ServerThread] = []

    def start(text: str) -> tuple[openai.OpenAI, FakeScheduler]:
        fake = FakeScheduler(reply_ids=tool_reply(text), model_len=8192)  # the tiny tokenizer is verbose
        server = ServerThread(make_app(fake, default_max_tokens=2048)).__enter__()
        servers.append(server)
        return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                             timeout=60), fake   # a busy machine must not fail the test

    yield start
    for server in servers:
        server.__exit__()


USER = [{"role": "user", "content": "Weather in Paris?"}]


def api_tokenizer_text(fake: FakeScheduler) -> str:
    from tests.fixtures.tiny_model import build_tokenizer

    return build_tokenizer().decode(list(fake.requests[0].spec.prompt_token_ids))


def test_a_call_comes_back_in_message_tool_calls(serve_reply: Any) -> None:
    api, fake = serve_reply(f"Checking.\n{CALL_TEXT}")
    reply = api.chat.completions.create(model="gemma-3-270m", messages=USER, tools=[WEATHER, TIME])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    prompt = api_tokenizer_text(fake)
    assert '"name": "get_weather"' in prompt and '"name": "get_time"' in prompt


def test_streamed_calls_accumulate_in_the_clients_shapes(serve_reply: Any) -> None:
    two = f"{CALL_TEXT}\n{CALL_TEXT.replace('Paris', 'Rome')}"
    api, _fake = serve_reply(two)
    chunks = list(api.chat.completions.create(model="gemma-3-270m", messages=USER, tools=[WEATHER], n=2,
                                              stream=True))
    for index in range(2):
        deltas = [chunk.choices[0] for chunk in chunks if chunk.choices and chunk.choices[0].index == index]
        calls: dict[int, dict[str, str]] = {}
        for delta in deltas:
            for call in delta.delta.tool_calls or ():
                entry = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                entry["id"] += call.id or ""
                entry["name"] += (call.function.name or "") if call.function else ""
                entry["arguments"] += (call.function.arguments or "") if call.function else ""
        assert [json.loads(calls[i]["arguments"])["city"] for i in sorted(calls)] == ["Paris", "Rome"]
        assert all(entry["id"].startswith("call_") and entry["name"] == "get_weather"
                   for entry in calls.values())
        assert deltas[-1].finish_reason == "tool_calls"
        assert not "".join(delta.delta.content or "" for delta in deltas).strip()
    # The client's own accumulator reads the same stream.
    with api.chat.completions.stream(model="gemma-3-270m", messages=USER, tools=[WEATHER]) as stream:
        final = stream.get_final_completion()
    assert [call.function.name for call in final.choices[0].message.tool_calls] == ["get_weather"] * 2


def test_parallel_tool_calls_false_keeps_the_first_call(serve_reply: Any) -> None:
    api, _fake = serve_reply(f"{CALL_TEXT}\n{CALL_TEXT.replace('Paris', 'Rome')}")
    reply = api.chat.completions.create(model="gemma-3-270m", messages=USER, tools=[WEATHER],
                                        parallel_tool_calls=False)
    assert [json.loads(c.function.arguments)["city"] for c in reply.choices[0].message.tool_calls] == ["Paris"]
    chunks = list(api.chat.completions.create(model="gemma-3-270m", messages=USER, tools=[WEATHER],
                                              parallel_tool_calls=False, stream=True))
    pieces = [call for chunk in chunks if chunk.choices for call in chunk.choices[0].delta.tool_calls or ()]
    assert {call.index for call in pieces} == {0}
    assert json.loads("".join(call.function.arguments or "" for call in pieces)) == {"city": "Paris", "days": 2}


def test_tool_choice_none_and_no_call_leave_the_text_alone(serve_reply: Any) -> None:
    api, _fake = serve_reply(CALL_TEXT)
    reply = api.chat.completions.create(model="gemma-3-270m", messages=USER, tools=[WEATHER], tool_choice="none")
    assert reply.choices[0].message.content == CALL_TEXT and not reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "stop"
    api, _fake = serve_reply("It is sunny.")
    reply = api.chat.completions.create(model="gemma-3-270m", messages=USER, tools=[WEATHER])
    assert reply.choices[0].message.content == "It is sunny."
    assert reply.choices[0].finish_reason == "stop" and not reply.choices[0].message.tool_calls


async def test_tool_results_go_back_through_the_template(client: httpx.AsyncClient,
                                                         fake: FakeScheduler, tokenizer: Any) -> None:
    fake.model_len = 8192
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]
    reply = await client.post("/v1/chat/completions", json={"messages": messages, "tools": [WEATHER]})
    assert reply.status_code == 200, reply.text
    assert list(fake.requests[0].spec.prompt_token_ids) == chat_prompt_ids(tokenizer, CONVERSATION, [WEATHER])


@pytest.mark.parametrize("change, param", [
    (lambda m: m[3].pop("tool_call_id"), "messages.3.tool_call_id"),
    (lambda m: m[2]["tool_calls"][0]["function"].update(arguments="{city"),
     "messages.2.tool_calls.0.function.arguments"),
    (lambda m: m[1].update(tool_calls=m[2]["tool_calls"]), "messages.1.tool_calls"),
    (lambda m: m[2].pop("tool_calls"), "messages.2.content"),
])
async def test_bad_tool_messages_are_named(client: httpx.AsyncClient, fake: FakeScheduler,
                                           change: Callable[[list[dict[str, Any]]], Any],
                                           param: str) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    change(messages)
    reply = await client.post("/v1/chat/completions", json={"messages": messages, "tools": [WEATHER]})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
    assert not fake.requests


async def test_a_required_call_constrains_the_reply_to_the_call_schema(
        client: httpx.AsyncClient, fake: FakeScheduler) -> None:
    fake.model_len = 8192
    for choice, parallel, expected in [
            ("required", None, ToolChoice(ToolMode.REQUIRED)),
            ("required", False, ToolChoice(ToolMode.REQUIRED, parallel=False)),
            ({"type": "function", "function": {"name": "get_time"}}, None,
             ToolChoice(ToolMode.NAMED, "get_time", parallel=False))]:
        fake.requests.clear()
        reply = await client.post("/v1/chat/completions", json={
            "messages": USER, "tools": [WEATHER, TIME], "tool_choice": choice,
            "parallel_tool_calls": parallel, "max_tokens": 4})
        assert reply.status_code == 200, reply.text
        constraint = fake.requests[0].spec.sampling.constraint
        assert constraint is not None and constraint.kind == ConstraintKind.JSON_SCHEMA
        assert json.loads(constraint.value) == call_schema(tools_of(WEATHER, TIME), expected)


async def test_a_required_call_and_response_format_are_one_constraint_too_many(
        client: httpx.AsyncClient, fake: FakeScheduler) -> None:
    reply = await client.post("/v1/chat/completions", json={
        "messages": USER, "tools": [WEATHER], "tool_choice": "required",
        "response_format": {"type": "json_object"}})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "tool_choice"
    assert not fake.requests


def test_a_constrained_reply_cut_short_keeps_its_whole_calls(serve_reply: Any,
                                                             tokenizer: Any) -> None:
    text = '[{"name":"get_weather","arguments":{"city":"Oslo"}},{"name":"get_w'
    api, _fake = serve_reply(text)
    reply = api.chat.completions.create(  # the budget ends before the reply does
        model="gemma-3-270m", messages=USER, tools=[WEATHER], tool_choice="required",
        max_tokens=len(tokenizer.encode(text, add_special_tokens=False)))
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]


def test_a_constrained_reply_comes_back_as_calls(serve_reply: Any) -> None:
    api, _fake = serve_reply('[{"name":"get_weather","arguments":{"city":"Oslo","days":3}}]')
    reply = api.chat.completions.create(model="gemma-3-270m", messages=USER, tools=[WEATHER],
                                        tool_choice="required")
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    chunks = list(api.chat.completions.create(model="gemma-3-270m", messages=USER, tools=[WEATHER],
                                              tool_choice="required", stream=True))
    streamed = [call for chunk in chunks if chunk.choices for call in chunk.choices[0].delta.tool_calls or ()]
    assert {call.index for call in streamed} == {0} and streamed[0].function.name == "get_weather"
    assert json.loads("".join(call.function.arguments or "" for call in streamed)) == {
        "city": "Oslo", "days": 3}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


async def test_a_template_that_cannot_show_tools_refuses_them(
        client: httpx.AsyncClient, fake: FakeScheduler, tokenizer: Any) -> None:
    original = tokenizer.chat_template
    tokenizer.chat_template = ("{% for message in messages %}{{ message.role }}: {{ message.content }}\n"
                               "{% endfor %}")
    try:
        for path, body in (("/v1/chat/completions", {"messages": USER, "tools": [WEATHER]}),
                           ("/tokenize", {"messages": USER, "tools": [WEATHER]})):
            reply = await client.post(path, json=body)
            assert reply.status_code == 400, reply.text
            assert reply.json()["error"]["param"] == "tools"
        plain = await client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2})
        assert plain.status_code == 200, plain.text
    finally:
        tokenizer.chat_template = original
    assert len(fake.requests) == 1
