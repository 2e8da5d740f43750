"""/v1/responses driven by the official openai client (responses.create,
retrieve, stream, cancel, delete) against the app with a fake scheduler; and
a tenant reading another's response (a 404, as for an unknown id)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from services.gateway.tenancy.tenant_config import load_tenants
from tests.unit.gateway.conftest import REPLY_TEXT
from tests.unit.gateway.fakes import FakeScheduler, ServerThread

ALICE, MALLORY = "sk-alice-secret", "sk-mallory-secret"


@pytest.fixture
def api(serve: Callable[..., ServerThread], fake: FakeScheduler) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{serve(fake).url}/v1", api_key="unused", max_retries=0, timeout=10)


def test_create_returns_the_completed_response(api: openai.OpenAI, fake: FakeScheduler) -> None:
    response = api.responses.create(model="gemma-3-270m", input="Capital of France?", instructions="Be brief.",
                                    max_output_tokens=64, temperature=0)
    assert response.status == "completed" and response.output_text == REPLY_TEXT
    assert response.output[0].type == "message" and response.output[0].content[0].text == REPLY_TEXT
    assert response.usage.input_tokens == len(fake.requests[0].spec.prompt_token_ids)
    assert response.usage.output_tokens > 0
    assert api.responses.retrieve(response.id).output_text == REPLY_TEXT


def test_max_output_tokens_makes_it_incomplete(api: openai.OpenAI) -> None:
    response = api.responses.create(model="gemma-3-270m", input="Hi", max_output_tokens=2)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"


def test_stream_gives_openais_events_in_order_each_numbered(api: openai.OpenAI) -> None:
    with api.responses.stream(model="gemma-3-270m", input=[{"role": "user", "content": "Hi"}]) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == REPLY_TEXT
    assert final.output_text == REPLY_TEXT


def test_a_background_response_is_resumed_after_any_event(serve: Callable[..., ServerThread],
                                                           reply_ids: list[int]) -> None:
    fake = FakeScheduler(reply_ids=reply_ids, token_delay_s=0.01)
    api = openai.OpenAI(base_url=f"{serve(fake).url}/v1", api_key="unused", max_retries=0, timeout=10)
    created = api.responses.create(model="gemma-3-270m", input="Hi", background=True)
    assert created.status in ("queued", "in_progress") and created.background
    full = list(api.responses.retrieve(created.id, stream=True))
    later = list(api.responses.retrieve(created.id, stream=True, starting_after=5))
    assert [e.sequence_number for e in later] == [e.sequence_number for e in full][6:]
    assert later[-1].type == "response.completed" and later[-1].response.output_text == REPLY_TEXT


def test_cancel_and_delete(serve: Callable[..., ServerThread], reply_ids: list[int]) -> None:
    fake = FakeScheduler(reply_ids=reply_ids * 20, token_delay_s=0.05)
    api = openai.OpenAI(base_url=f"{serve(fake).url}/v1", api_key="unused", max_retries=0, timeout=10)
    created = api.responses.create(model="gemma-3-270m", input="Hi", background=True, max_output_tokens=400)
    assert api.responses.cancel(created.id).status == "cancelled"
    assert api.responses.retrieve(created.id).status == "cancelled"
    api.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(created.id)


def test_previous_response_id_continues_the_conversation(api: openai.OpenAI, fake: FakeScheduler) -> None:
    first = api.responses.create(model="gemma-3-270m", input="Hi", store=True)
    second = api.responses.create(model="gemma-3-270m", input="And again?", previous_response_id=first.id)
    assert second.status == "completed"
    first_prompt, second_prompt = (r.spec.prompt_token_ids for r in fake.requests)
    assert second_prompt[:len(first_prompt)] == first_prompt      # its prefix: served from the cache


def test_store_false_is_not_kept(api: openai.OpenAI) -> None:
    response = api.responses.create(model="gemma-3-270m", input="Hi", store=False)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(response.id)


def test_text_format_constrains_the_output(api: openai.OpenAI, fake: FakeScheduler) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    api.responses.create(model="gemma-3-270m", input="Hi",
                         text={"format": {"type": "json_schema", "name": "x", "schema": schema}})
    assert fake.requests[0].spec.sampling.constraint is not None


@pytest.mark.parametrize("field,value", [("reasoning", {"effort": "high"}), ("top_logprobs", 3),
                                         ("include", ["file_search_call.results"])])
def test_fields_not_implemented_are_a_400_naming_them(serve: Callable[..., ServerThread], fake: FakeScheduler,
                                                      field: str, value: Any) -> None:
    reply = httpx.post(f"{serve(fake).url}/v1/responses", json={"input": "Hi", field: value}, timeout=10)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == field


def test_another_tenant_cannot_read_resume_cancel_or_delete_a_response(
        serve: Callable[..., ServerThread], reply_ids: list[int]) -> None:
    fake = FakeScheduler(reply_ids=reply_ids * 20, token_delay_s=0.02)
    url = serve(fake, tenants=load_tenants(f"alice={ALICE},mallory={MALLORY}")).url
    alice = openai.OpenAI(base_url=f"{url}/v1", api_key=ALICE, max_retries=0, timeout=10)
    mallory = openai.OpenAI(base_url=f"{url}/v1", api_key=MALLORY, max_retries=0, timeout=10)
    created = alice.responses.create(model="gemma-3-270m", input="Hi", background=True, max_output_tokens=200)
    attempts = [lambda: mallory.responses.retrieve(created.id),
                lambda: list(mallory.responses.retrieve(created.id, stream=True, starting_after=0)),
                lambda: mallory.responses.cancel(created.id),
                lambda: mallory.responses.delete(created.id),
                lambda: mallory.responses.create(model="gemma-3-270m", input="Hi", previous_response_id=created.id)]
    for attempt in attempts:
        with pytest.raises(openai.NotFoundError) as caught:
            attempt()
        assert "Hi" not in json.dumps(caught.value.body)          # nothing of alice's leaks
    unknown = httpx.get(f"{url}/v1/responses/resp_unknown", headers={"authorization": f"Bearer {MALLORY}"})
    assert unknown.status_code == 404
    assert alice.responses.cancel(created.id).status == "cancelled"   # still alice's, untouched


def test_responses_expire_and_count_against_the_tenant(serve: Callable[..., ServerThread],
                                                       fake: FakeScheduler) -> None:
    url = serve(fake, responses_max_per_tenant=2, responses_ttl_s=1.0).url
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=10)
    kept = [api.responses.create(model="gemma-3-270m", input="Hi") for _ in range(2)]
    with pytest.raises(openai.RateLimitError):
        api.responses.create(model="gemma-3-270m", input="Hi")
    time.sleep(1.2)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(kept[0].id)
    assert api.responses.create(model="gemma-3-270m", input="Hi").status == "completed"


WEATHER = {"type": "function", "name": "get_weather", "description": "The weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize("streamed", [False, True])
def test_function_tools_come_back_as_function_call_items(serve: Callable[..., ServerThread], tokenizer: Any,
                                                         streamed: bool) -> None:
    from tests.unit.gateway.fakes import EOS_ID

    fake = FakeScheduler(reply_ids=[*tokenizer.encode(CALL_TEXT, add_special_tokens=False), EOS_ID], model_len=8192)
    api = openai.OpenAI(base_url=f"{serve(fake, default_max_tokens=2048).url}/v1", api_key="unused",
                        max_retries=0, timeout=60)
    if streamed:
        with api.responses.stream(model="gemma-3-270m", input="Weather in Paris?", tools=[WEATHER]) as stream:
            types = [event.type for event in stream]
            response = stream.get_final_response()
        assert "response.function_call_arguments.delta" in types
        assert types.index("response.function_call_arguments.done") < types.index("response.completed")
    else:
        response = api.responses.create(model="gemma-3-270m", input="Weather in Paris?", tools=[WEATHER])
    calls = [item for item in response.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    follow_up = api.responses.create(model="gemma-3-270m", input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                                        "output": "sunny"}],
                                     previous_response_id=response.id, tools=[WEATHER])
    assert follow_up.status == "completed"
    assert "sunny" in tokenizer.decode(list(fake.requests[-1].spec.prompt_token_ids))


def test_a_gateway_adopts_a_background_response_for_its_owner_only(serve: Callable[..., ServerThread],
                                                                   reply_ids: list[int]) -> None:
    # This gateway does not hold the response: it asks the scheduler, which (here, a careless
    # one) answers whoever asks; the gateway still shows it to the tenant in its attachment only.
    from services.gateway.requests.backend import GenerationSpec

    class Keeper(FakeScheduler):
        async def detached(self, request_id: str, client_id: str) -> GenerationSpec | None:
            attachment = {"owner": "alice", "id": request_id, "created_at": 1, "model": "gemma-3-270m",
                          "echo": {"background": True}, "conversation": [{"role": "user", "content": "Hi"}],
                          "store": True, "chat": {"messages": [{"role": "user", "content": "Hi"}]}}
            return GenerationSpec(prompt_token_ids=(5, 6, 7), max_tokens=64, client_id=client_id,
                                  detached=True, attach=True, attachment=json.dumps(attachment).encode())

    url = serve(Keeper(reply_ids=reply_ids), tenants=load_tenants(f"alice={ALICE},mallory={MALLORY}")).url
    mallory = openai.OpenAI(base_url=f"{url}/v1", api_key=MALLORY, max_retries=0, timeout=10)
    alice = openai.OpenAI(base_url=f"{url}/v1", api_key=ALICE, max_retries=0, timeout=10)
    with pytest.raises(openai.NotFoundError):
        mallory.responses.retrieve("resp_elsewhere")
    events = list(alice.responses.retrieve("resp_elsewhere", stream=True))
    assert events[-1].type == "response.completed" and events[-1].response.output_text == REPLY_TEXT
    with pytest.raises(openai.NotFoundError):
        mallory.responses.retrieve("resp_elsewhere")        # adopted now, still alice's


async def test_a_foreground_stream_whose_client_leaves_stops_generating(make_app: Callable[..., Any],
                                                                          reply_ids: list[int]) -> None:
    fake = FakeScheduler(reply_ids=reply_ids[:-1] * 50, token_delay_s=0.02)   # no EOS: it runs long
    with ServerThread(make_app(fake)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
            async with http.stream("POST", "/v1/responses", json={"input": "Hi", "stream": True,
                                                                   "max_output_tokens": 400}) as response:
                lines = response.aiter_lines()
                while "output_text.delta" not in await anext(lines):
                    pass
        for _ in range(200):
            if fake.abandoned:
                break
            await asyncio.sleep(0.02)
    assert fake.abandoned and not fake.finished
