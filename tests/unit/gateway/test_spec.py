"""The one request shape: every front door says what its client asked for as
RequestFields, and build_spec alone turns them into the GenerationSpec the
scheduler is sent, checked against the model's limits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import httpx
import pytest

from common.types import SamplingParams
from fairserve.v1 import common_pb2, gateway_pb2
from services.gateway.app import generate_input
from services.gateway.requests.backend import GenerationSpec
from services.gateway.convert import generate_request_to_proto, text_input_from_proto
from services.gateway.errors import ApiError
from services.gateway.tenancy.identity import Caller
from services.gateway.doors.openai_api import chat_fields, completion_fields
from services.gateway.requests.schemas import ChatCompletionBody, CompletionBody, GenerateBody
from services.gateway.requests.spec import Limits, RequestFields, TextInput, build_spec
from services.gateway.tenancy.tenants import Tenant, TenantLimits
from services.gateway.requests.validation import SamplingInput
from tests.unit.gateway.fakes import FakeScheduler

LIMITS = Limits(default_max_tokens=128, max_model_len=512, vocab_size=384)
PROMPT = (2, 40, 41)
ASKED = dict(max_tokens=7, temperature=0.5, seed=3, stop=["end"], ignore_eos=True, min_tokens=2,
             priority=4, session_id="s-1", user="bob")
CHECKED = GenerationSpec(
    prompt_token_ids=PROMPT, max_tokens=7, sampling=SamplingParams(temperature=0.5, seed=3),
    stop=("end",), ignore_eos=True, min_tokens=2, client_id="s-1", session_id="s-1", priority=4)


def api_error(call: Callable[[], Any]) -> ApiError:
    with pytest.raises(ApiError) as raised:
        call()
    assert raised.value.status == 400
    return raised.value


def test_build_spec_resolves_the_defaults() -> None:
    spec = build_spec(RequestFields(), PROMPT, LIMITS)
    assert spec == GenerationSpec(prompt_token_ids=PROMPT, max_tokens=128,
                                  sampling=SamplingParams(temperature=0.0))
    assert build_spec(RequestFields(user="bob"), PROMPT, LIMITS).client_id == "bob"
    tenant = Caller(Tenant("acme", TenantLimits(weight=2.0)))
    spec = build_spec(RequestFields(user="bob"), PROMPT, LIMITS, tenant)
    assert (spec.client_id, spec.user, spec.weight) == ("acme", "bob", 2.0)


def test_the_default_budget_shrinks_to_the_room_the_prompt_leaves() -> None:
    small = Limits(default_max_tokens=128, max_model_len=10, vocab_size=384)
    assert build_spec(RequestFields(), PROMPT, small).max_tokens == 7
    unknown = Limits(default_max_tokens=128, max_model_len=None, vocab_size=None)
    assert build_spec(RequestFields(), PROMPT, unknown).max_tokens == 128
    error = api_error(lambda: build_spec(RequestFields(max_tokens=8), PROMPT, small))
    assert error.param == "max_tokens" and error.code == "context_length_exceeded"
    error = api_error(lambda: build_spec(
        RequestFields(max_tokens=8, max_tokens_param="max_completion_tokens"), PROMPT, small))
    assert error.param == "max_completion_tokens"


@pytest.mark.parametrize(("ids", "bad"), [((2, 384), "384"), ((-1, 5), "-1"), ((2, 10**12), str(10**12))])
def test_token_ids_outside_the_vocabulary_are_400_naming_the_field(ids: tuple[int, ...],
                                                                   bad: str) -> None:
    error = api_error(lambda: build_spec(RequestFields(), ids, LIMITS))
    assert error.param == "prompt"
    assert f"Token id {bad} in prompt" in error.message and "[0, 384)" in error.message
    chat = api_error(lambda: build_spec(RequestFields(prompt_param="messages"), ids, LIMITS))
    assert chat.param == "messages"


def test_an_unknown_vocabulary_checks_no_range_but_still_emptiness() -> None:
    unknown = Limits(default_max_tokens=128, max_model_len=None, vocab_size=None)
    assert build_spec(RequestFields(), (2, 10**6), unknown).prompt_token_ids == (2, 10**6)
    assert api_error(lambda: build_spec(RequestFields(), (), unknown)).code == "empty_prompt"


def test_generate_body_builds_the_spec() -> None:
    text = generate_input(GenerateBody(prompt="Hi", raw=True, **ASKED))
    assert (text.prompt, text.raw) == ("Hi", True)
    assert build_spec(text.fields, PROMPT, LIMITS) == CHECKED


def test_grpc_text_request_builds_the_same_spec() -> None:
    asked = {key: value for key, value in ASKED.items() if key not in ("temperature", "seed")}
    message = gateway_pb2.TextRequest(prompt="Hi", raw=True, sampling=common_pb2.SamplingParams(
        temperature=0.5, seed=3), **asked)
    text = text_input_from_proto(message)
    assert (text.prompt, text.raw) == ("Hi", True)
    assert build_spec(text.fields, PROMPT, LIMITS) == CHECKED
    rest = build_spec(text_input_from_proto(gateway_pb2.TextRequest(prompt="Hi")).fields, PROMPT,
                      LIMITS)
    assert rest == build_spec(generate_input(GenerateBody(prompt="Hi")).fields, PROMPT, LIMITS)


def test_openai_bodies_build_the_same_spec() -> None:
    assert build_spec(completion_fields(CompletionBody(prompt="Hi", **ASKED)), PROMPT, LIMITS) == CHECKED
    chat = ChatCompletionBody(messages=[{"role": "user", "content": "Hi"}], **ASKED)
    assert build_spec(chat_fields(chat, (106,)), PROMPT, LIMITS) == CHECKED  # ignore_eos: no end of turn
    default = build_spec(completion_fields(CompletionBody(prompt="Hi")), PROMPT, LIMITS)
    assert default.sampling.temperature == 1.0 and default.max_tokens == 128
    completion_budget = chat.model_copy(update={"max_completion_tokens": 600})
    error = api_error(lambda: build_spec(chat_fields(completion_budget, ()), PROMPT, LIMITS))
    assert error.param == "max_completion_tokens"


def test_ignore_eos_waives_the_end_of_turn_but_not_the_clients_stop_ids() -> None:
    chat = ChatCompletionBody(messages=[{"role": "user", "content": "Hi"}], ignore_eos=True)
    assert build_spec(chat_fields(chat, (106,)), PROMPT, LIMITS).stop_token_ids == ()
    asked = chat.model_copy(update={"stop_token_ids": [7]})
    assert build_spec(chat_fields(asked, (106,)), PROMPT, LIMITS).stop_token_ids == (7,)
    kept = chat.model_copy(update={"ignore_eos": False})
    assert build_spec(chat_fields(kept, (106,)), PROMPT, LIMITS).stop_token_ids == (106,)


def test_the_spec_goes_to_the_scheduler_without_its_stop_strings() -> None:
    message = generate_request_to_proto(CHECKED, "r1.0")
    assert message.request_id == "r1.0" and list(message.prompt_token_ids) == list(PROMPT)
    assert (message.max_tokens, message.min_tokens, message.ignore_eos) == (7, 2, True)
    assert (message.client_id, message.session_id, message.priority) == ("s-1", "s-1", 4)
    assert message.sampling.seed == 3 and "stop" not in message.DESCRIPTOR.fields_by_name
    # No keys: not authenticated, no quota for the scheduler to hold.
    assert not message.authenticated and not message.HasField("quota") and not message.resubmitted


def test_a_tenants_limits_go_to_the_scheduler_with_every_request() -> None:
    limits = TenantLimits(max_in_flight=None, max_queued=3, requests_per_s=2.5, burst=4,
                          tokens_per_minute=6000, max_request_s=90.0)
    fields = generate_input(GenerateBody(prompt="x", max_tokens=3)).fields
    spec = build_spec(fields, PROMPT, LIMITS, Caller(Tenant("alice", limits)))
    assert spec.tenant_limits == limits
    message = generate_request_to_proto(replace(spec, resubmitted=True), "r1.0")
    assert message.authenticated and message.resubmitted and message.client_id == "alice"
    quota = message.quota
    assert (quota.max_in_flight, quota.max_queued, quota.requests_per_s, quota.burst) == (0, 3, 2.5, 4)
    assert (quota.tokens_per_minute, quota.max_request_s) == (6000, 90.0)   # 0: no limit
    keyed = build_spec(fields, PROMPT, LIMITS, Caller(Tenant("bob")))
    assert generate_request_to_proto(keyed, "r2.0").quota.max_in_flight == 64   # the keyed default
    assert build_spec(fields, PROMPT, LIMITS, Caller()).tenant_limits is None


async def test_completion_token_ids_are_checked_against_the_models_vocabulary(
        make_app: Callable[..., Any], fake: FakeScheduler) -> None:
    fake.vocab_size = 100  # what the workers told the scheduler; the tokenizer has 384
    transport = httpx.ASGITransport(app=make_app(fake))
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
        bad = await http.post("/v1/completions", json={"prompt": [[2, 40], [2, 150]], "max_tokens": 2})
        assert bad.status_code == 400
        error = bad.json()["error"]
        assert error["param"] == "prompt" and "150" in error["message"] and "[0, 100)" in error["message"]
        ok = await http.post("/v1/completions", json={"prompt": [2, 99], "max_tokens": 2})
        assert ok.status_code == 200
    assert fake.requests[0].spec.prompt_token_ids == (2, 99)


async def test_before_any_worker_registers_the_tokenizer_bounds_token_ids(
        make_app: Callable[..., Any], fake: FakeScheduler) -> None:
    fake.model_len = fake.vocab_size = None  # no worker yet
    transport = httpx.ASGITransport(app=make_app(fake))
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
        bad = await http.post("/v1/completions", json={"prompt": [2, 384]})
        assert bad.status_code == 400 and "[0, 384)" in bad.json()["error"]["message"]
        assert (await http.post("/v1/completions", json={"prompt": [2, 383]})).status_code == 200
        models = (await http.get("/v1/models")).json()
        assert models["data"][0]["max_model_len"] is None
        fake.model_len = 64  # a worker registered
        models = (await http.get("/v1/models")).json()
        assert models["data"][0]["max_model_len"] == 64


async def test_the_max_model_len_setting_still_overrides_the_workers(
        make_app: Callable[..., Any], fake: FakeScheduler) -> None:
    fake.vocab_size = 300
    state = make_app(fake, max_model_len=10).state.gateway
    assert await state.limits() == Limits(default_max_tokens=128, max_model_len=10, vocab_size=300,
                                          max_tokens_limit=10)
    spec = await state.text_spec(TextInput("Hi", raw=True, fields=RequestFields(
        sampling=SamplingInput(temperature=0.2))), tenant=None)
    assert spec.max_tokens == 10 - len(spec.prompt_token_ids) and spec.stop_token_ids == ()


def test_the_gateway_asks_for_packed_tokens_and_reads_either_form() -> None:
    from fairserve.v1 import common_pb2, scheduler_pb2
    from services.gateway.convert import event_from_proto
    assert generate_request_to_proto(CHECKED, "r").packed_tokens
    packed = event_from_proto(scheduler_pb2.GenerateEvent(token_ids=[7, 8]))
    one_each = event_from_proto(scheduler_pb2.GenerateEvent(tokens=[
        scheduler_pb2.TokenEvent(token_id=7), scheduler_pb2.TokenEvent(
            token_id=8, logprob=common_pb2.TokenLogprob(logprob=-0.5))]))
    assert [t.token_id for t in packed.tokens] == [7, 8] == [t.token_id for t in one_each.tokens]
    assert packed.tokens[1].logprob is None and one_each.tokens[1].logprob.logprob == -0.5
