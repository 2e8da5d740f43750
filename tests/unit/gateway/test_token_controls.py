"""logit_bias and stop_token_ids: checked at every door into the one spec,
sent to the scheduler, and a client's stop token ends the text without
appearing in it."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from fairserve.v1 import common_pb2, gateway_pb2
from services.gateway.app import generate_input
from services.gateway.convert import generate_request_to_proto, text_input_from_proto
from services.gateway.errors import ApiError
from services.gateway.doors.openai_api import chat_fields, completion_fields
from services.gateway.requests.schemas import ChatCompletionBody, CompletionBody, GenerateBody
from services.gateway.requests.spec import Limits, build_spec
from services.gateway.requests.token_controls import (
    MAX_LOGIT_BIAS_ENTRIES,
    check_logit_bias,
    check_stop_token_ids,
)
from tests.unit.gateway.fakes import FakeScheduler

LIMITS = Limits(default_max_tokens=16, max_model_len=512, vocab_size=384)
PROMPT = (2, 40, 41)


def error_of(call: Any) -> ApiError:
    with pytest.raises(ApiError) as raised:
        call()
    assert raised.value.status == 400
    return raised.value


def test_logit_bias_becomes_sorted_pairs() -> None:
    assert check_logit_bias({"50": 5, "7": -100, " 9": 0.5}, 384) == ((7, -100.0), (9, 0.5), (50, 5.0))
    assert check_logit_bias(None, 384) == () and check_logit_bias({}, 384) == ()
    assert check_logit_bias({"100000": 1}, None) == ((100000, 1.0),)   # no vocabulary known yet


@pytest.mark.parametrize("bias, words", [
    ({"384": 1}, "outside the model's vocabulary [0, 384)"),
    ({"-1": 1}, "outside the model's vocabulary"),
    ({"abc": 1}, "must be token ids"),
    ({"1.5": 1}, "must be token ids"),
    ({"3": 100.5}, "[-100, 100], got 100.5 for token 3"),
    ({"3": -101}, "[-100, 100]"),
    ({"3": float("nan")}, "[-100, 100]"),
    ({"3": True}, "must be numbers"),
    ({"3": 1, "03": 2}, "names token 3 twice"),
])
def test_bad_logit_bias_is_named(bias: dict[str, Any], words: str) -> None:
    error = error_of(lambda: check_logit_bias(bias, 384))
    assert error.param == "logit_bias" and words in error.message


def test_too_many_logit_bias_entries() -> None:
    bias = {str(i): 1.0 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}
    assert "at most" in error_of(lambda: check_logit_bias(bias, None)).message


def test_stop_token_ids_are_checked_and_deduplicated() -> None:
    assert check_stop_token_ids([5, 9, 5], 384) == (5, 9)
    for ids in ([384], [-2]):
        error = error_of(lambda: check_stop_token_ids(ids, 384))
        assert error.param == "stop_token_ids" and str(ids[0]) in error.message


def test_every_door_builds_the_same_bias_and_stop_ids() -> None:
    asked: dict[str, Any] = {"logit_bias": {"50": 5, "7": -100}, "stop_token_ids": [9, 106]}
    completion = build_spec(completion_fields(CompletionBody(prompt="Hi", **asked)), PROMPT, LIMITS)
    assert completion.sampling.logit_bias == ((7, -100.0), (50, 5.0))
    assert completion.stop_token_ids == (9, 106)
    chat = build_spec(chat_fields(ChatCompletionBody(messages=[{"role": "user", "content": "Hi"}],
                                                     **asked), (106,)), PROMPT, LIMITS)
    assert chat.sampling.logit_bias == completion.sampling.logit_bias
    assert chat.stop_token_ids == (106, 9)           # the turn's end, then the client's
    generate = build_spec(generate_input(GenerateBody(prompt="Hi", **asked)).fields, PROMPT, LIMITS)
    assert (generate.sampling.logit_bias, generate.stop_token_ids) == (
        completion.sampling.logit_bias, completion.stop_token_ids)
    message = gateway_pb2.TextRequest(prompt="Hi", sampling=common_pb2.SamplingParams(
        logit_bias={50: 5.0, 7: -100.0}, stop_token_ids=[9, 106]))
    grpc_spec = build_spec(text_input_from_proto(message).fields, PROMPT, LIMITS)
    assert (grpc_spec.sampling.logit_bias, grpc_spec.stop_token_ids) == (
        completion.sampling.logit_bias, completion.stop_token_ids)
    sent = generate_request_to_proto(completion, "r1")
    assert dict(sent.sampling.logit_bias) == {7: -100.0, 50: 5.0}
    assert list(sent.stop_token_ids) == [9, 106]


CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
COMPLETION = {"prompt": "Hi", "max_tokens": 8}


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT),
                                        ("/v1/completions", COMPLETION)])
@pytest.mark.parametrize("field, value, status", [
    ("logit_bias", {"99999999": 1}, 400), ("logit_bias", {"5": 200}, 400),
    ("logit_bias", {"x": 1}, 400), ("logit_bias", {"5": "high"}, 422), ("logit_bias", [5], 422),
    ("stop_token_ids", [99999999], 400), ("stop_token_ids", ["a"], 422),
    ("stop_token_ids", 5, 422)])
async def test_bad_values_over_http(client: httpx.AsyncClient, fake: FakeScheduler, path: str,
                                    body: dict[str, Any], field: str, value: Any,
                                    status: int) -> None:
    reply = await client.post(path, json={**body, field: value})
    assert reply.status_code == status, reply.text
    if status == 400:
        assert reply.json()["error"]["param"] == field
    assert not fake.requests


async def test_a_client_stop_token_ends_the_text_without_appearing_in_it(
        client: httpx.AsyncClient, fake: FakeScheduler, reply_ids: list[int], tokenizer: Any) -> None:
    stop_id = reply_ids[2]
    reply = await client.post("/v1/completions", json={**COMPLETION, "max_tokens": 20,
                                                       "stop_token_ids": [stop_id]})
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == tokenizer.decode(reply_ids[:2])
    assert reply.json()["usage"]["completion_tokens"] == 3   # the stop token still counts
    sent = fake.requests[0].spec
    assert stop_id in sent.stop_token_ids


async def test_logit_bias_reaches_the_scheduler(client: httpx.AsyncClient,
                                                fake: FakeScheduler) -> None:
    reply = await client.post("/v1/chat/completions", json={**CHAT, "logit_bias": {"12": -100}})
    assert reply.status_code == 200, reply.text
    assert fake.requests[0].spec.sampling.logit_bias == ((12, -100.0),)
