"""Structured output through the real stack (tiny random model, whose tokens are random: only the
constraint can make them parse) with the official openai client and the gRPC text API: every
constrained reply parses and validates against its schema (jsonschema), a choice is one of the
choices, a regex output matches, streamed or not, with n > 1; a bad schema is a 400."""

from __future__ import annotations

import json
import re
from typing import Any

import grpc
import jsonschema
import openai
import pytest

from common.convert import constraint_to_proto
from common.types import Constraint, ConstraintKind
from fairserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from fairserve.launcher.stack import Stack

NAME = {"type": "string", "maxLength": 8}
SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"name": NAME, "id": {"type": "integer", "minimum": 0,
                                                                        "maximum": 999}},
                 "required": ["name", "id"], "additionalProperties": False},
        "active": {"type": "boolean"}},
        "required": ["user", "active"], "additionalProperties": False},
    "enums": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, 3]}},
        "required": ["color", "size"], "additionalProperties": False},
    "arrays": {"type": "object", "properties": {
        "tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3},
        "points": {"type": "array", "items": {"type": "object", "properties": {
            "x": {"type": "integer", "minimum": -5, "maximum": 5}}, "required": ["x"],
            "additionalProperties": False}, "maxItems": 2}},
        "required": ["tags", "points"], "additionalProperties": False},
    "ranges": {"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "level": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 4}},
        "required": ["age", "score", "level"], "additionalProperties": False},
    "optional fields": {"type": "object", "properties": {
        "title": NAME, "note": {"anyOf": [NAME, {"type": "null"}]}, "count": {"type": "integer", "minimum": 0,
                                                                              "maximum": 10}},
        "required": ["title"], "additionalProperties": False},
}
MAX_TOKENS = 300


@pytest.fixture(scope="module")
def client(tiny_stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_stack.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_id(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def json_format(name: str) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name.replace(" ", "_"), "schema": SCHEMAS[name],
                                                   "strict": True}}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_completions_n_choices_validate(client: openai.OpenAI, model_id: str, name: str) -> None:
    reply = client.completions.create(model=model_id, prompt="A record:", max_tokens=MAX_TOKENS, n=3,
                                      temperature=1.0, seed=11, extra_body={"response_format": json_format(name)})
    assert len(reply.choices) == 3
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), SCHEMAS[name])


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_chat_streams_with_n_choices_validate(client: openai.OpenAI, model_id: str, name: str) -> None:
    stream = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Give me JSON."}], max_tokens=MAX_TOKENS, n=2,
        temperature=0.8, seed=5, stream=True, response_format=json_format(name))
    texts = ["", ""]
    finishes: list[str | None] = [None, None]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert finishes == ["stop", "stop"], texts
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_guided_json_and_json_object(client: openai.OpenAI, model_id: str) -> None:
    schema = SCHEMAS["enums"]
    guided = client.completions.create(model=model_id, prompt="x", max_tokens=MAX_TOKENS, temperature=1.0, seed=2,
                                       extra_body={"guided_json": schema})
    jsonschema.validate(json.loads(guided.choices[0].text), schema)
    chat = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "JSON"}],
                                          max_tokens=MAX_TOKENS, temperature=1.0, seed=4, n=2,
                                          response_format={"type": "json_object"})
    for choice in chat.choices:
        if choice.finish_reason == "stop":    # an object without a schema may be long: a cut one is no match
            assert isinstance(json.loads(choice.message.content), dict)
        else:
            assert choice.message.content.startswith("{")


def test_guided_choice_returns_one_of_the_choices(client: openai.OpenAI, model_id: str) -> None:
    choices = ["positive", "negative", "neutral", "it depends"]
    reply = client.completions.create(model=model_id, prompt="Sentiment:", max_tokens=20, n=6, temperature=1.5,
                                      seed=1, extra_body={"guided_choice": choices})
    assert all(choice.text in choices and choice.finish_reason == "stop" for choice in reply.choices)
    chat = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "?"}],
                                          max_tokens=20, extra_body={"structured_outputs": {"choice": choices}})
    assert chat.choices[0].message.content in choices
    # min_tokens cannot hold a complete match open: the grammar's end ends the reply.
    held = client.completions.create(model=model_id, prompt="?", max_tokens=20, temperature=1.0, seed=2,
                                     extra_body={"guided_choice": ["ok"], "min_tokens": 15})
    assert held.choices[0].text == "ok" and held.choices[0].finish_reason == "stop"


def test_regex_and_grammar_outputs_match(client: openai.OpenAI, model_id: str) -> None:
    regex = r"[A-Z][a-z]{1,6} [0-9]{2}-[0-9]{3}"
    stream = client.completions.create(model=model_id, prompt="Code:", max_tokens=40, n=2, temperature=1.0,
                                       seed=9, stream=True, extra_body={"guided_regex": regex})
    texts = ["", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert all(re.fullmatch(regex, text) for text in texts), texts
    grammar = 'start: expr\nexpr: NUM | "(" expr OP expr ")"\nOP: "+" | "*"\nNUM: /[0-9]/\n'
    reply = client.completions.create(model=model_id, prompt="Sum:", max_tokens=60, temperature=1.0, seed=3,
                                      extra_body={"guided_grammar": grammar})
    text = reply.choices[0].text
    while re.search(r"\([0-9][+*][0-9]\)", text):
        text = re.sub(r"\([0-9][+*][0-9]\)", "7", text)
    assert re.fullmatch(r"[0-9]", text), reply.choices[0].text


def test_grpc_text_api_constraint(tiny_stack: Stack) -> None:
    regex = r"(yes|no), [0-9]{3}"
    constraint = constraint_to_proto(Constraint(ConstraintKind.REGEX, regex))
    with grpc.insecure_channel(f"127.0.0.1:{tiny_stack.ports.gateway_grpc}") as channel:
        stub = gateway_pb2_grpc.TextGenerationStub(channel)
        request = gateway_pb2.TextRequest(prompt="Answer", raw=True, max_tokens=30, sampling=common_pb2.SamplingParams(
            temperature=1.0, seed=8, constraint=constraint))
        reply = stub.Generate(request, timeout=60)
        assert reply.finish_reason == "stop" and re.fullmatch(regex, reply.text), reply.text
        streamed = "".join(chunk.text for chunk in stub.GenerateStream(request, timeout=60))
        assert streamed == reply.text


def test_bad_schema_is_a_400(client: openai.OpenAI, model_id: str) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "x"}], max_tokens=5,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "bad", "schema": {"type": "object", "properties": {
                                               "a": {"type": "string", "pattern": "(unclosed"}}}}})
    assert "response_format" in str(raised.value)
