"""The Responses API's pure parts: the events a response's deltas make (order,
ids that a rebuild repeats), the store's owners, limits and expiry, and the
fields translate.py refuses."""

from __future__ import annotations

import pytest

from common.types import Usage
from services.gateway.errors import ApiError
from services.gateway.streaming.generation import TextDelta
from services.gateway.responses.events import ResponseBuilder
from services.gateway.responses.store import ResponseRecord, ResponseStore, TooManyResponses
from services.gateway.responses.translate import input_messages, refuse_unimplemented, response_format
from services.gateway.responses.body import ResponseCreateBody
from services.gateway.tool_parsers.base import ToolCall


def _events(response_id: str = "resp_1") -> list[dict]:
    builder = ResponseBuilder(response_id, 1, "m", {})
    events = builder.start()
    events += builder.delta(TextDelta("Hel"))
    events += builder.delta(TextDelta("lo"))
    events += builder.delta(TextDelta("", tool_calls=(ToolCall(0, "call_x", "f", '{"a":'),)))
    events += builder.delta(TextDelta("", tool_calls=(ToolCall(0, None, None, " 1}"),)))
    events += builder.finish("tool_calls", Usage(5, 4, 2))
    return events


def test_a_text_then_a_call_come_in_openais_order() -> None:
    types = [e["type"] for e in _events()]
    assert types == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    final = _events()[-1]["response"]
    assert final["output_text"] == "Hello" and final["output"][1]["arguments"] == '{"a": 1}'
    assert final["usage"] == {"input_tokens": 5, "input_tokens_details": {"cached_tokens": 2}, "output_tokens": 4,
                              "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 9}


def test_a_rebuilt_response_repeats_its_ids_and_another_does_not() -> None:
    assert _events() == _events()
    assert _events()[2]["item"]["id"] != _events("resp_2")[2]["item"]["id"]


def test_length_makes_it_incomplete() -> None:
    builder = ResponseBuilder("resp_1", 1, "m", {})
    builder.start()
    builder.delta(TextDelta("x"))
    assert builder.finish("length", None)[-1]["type"] == "response.incomplete"
    assert builder.snapshot()["incomplete_details"] == {"reason": "max_output_tokens"}


class _Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def _record(owner: str, response_id: str) -> ResponseRecord:
    return ResponseRecord(owner, ResponseBuilder(response_id, 1, "m", {}), [], True, True)


def test_the_store_shows_a_response_to_its_owner_only_bounds_each_tenant_and_expires() -> None:
    clock = _Clock()
    store = ResponseStore(ttl_s=10.0, max_per_tenant=2, clock=clock)
    first, second = _record("alice", "resp_a"), _record("alice", "resp_b")
    store.add(first)
    store.add(second)
    store.add(_record("bob", "resp_c"))              # another tenant's count is its own
    with pytest.raises(TooManyResponses, match="RESPONSES_MAX_PER_TENANT=2"):
        store.add(_record("alice", "resp_d"))
    assert store.get("resp_a", "alice") is first and store.get("resp_a", "bob") is None
    store.ended(first)
    clock.now = 10.0
    assert store.get("resp_a", "alice") is None      # expired RESPONSES_TTL_S after it ended
    assert store.get("resp_b", "alice") is second    # in progress: kept
    store.add(_record("alice", "resp_d"))


@pytest.mark.parametrize("extra,param", [({"reasoning": {"effort": "low"}}, "reasoning"),
                                         ({"truncation": "auto"}, "truncation"),
                                         ({"prompt": {"id": "p"}}, "prompt")])
def test_fields_not_implemented_are_named(extra: dict, param: str) -> None:
    with pytest.raises(ApiError) as caught:
        refuse_unimplemented(extra)
    assert caught.value.status == 400 and caught.value.param == param


def test_no_op_values_pass() -> None:
    refuse_unimplemented({"truncation": "disabled", "include": [], "service_tier": "auto", "reasoning": None})


def test_input_items_become_chat_messages() -> None:
    body = ResponseCreateBody(input=[
        {"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "42"}])
    messages = input_messages(body)
    assert messages[0] == {"role": "system", "content": "Be brief."}
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"]
    assert messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "42"}
    with pytest.raises(ApiError) as caught:
        input_messages(ResponseCreateBody(input=[{"role": "user", "content": [{"type": "input_image"}]}]))
    assert caught.value.param == "input.0.content.0.type"


def test_text_format_becomes_the_chat_response_format() -> None:
    schema = {"type": "object"}
    assert response_format({"format": {"type": "json_schema", "name": "x", "schema": schema}}) == \
        {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    with pytest.raises(ApiError):
        response_format({"format": {"type": "grammar"}})
