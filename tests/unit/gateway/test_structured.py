"""Structured output at the gateway: each way a client asks for it becomes the one Constraint the
request carries to the scheduler, and a bad schema, regex or grammar is a 400 naming the problem,
before anything is queued (the fake scheduler sees no request)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import grpc
import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.convert import constraint_to_proto, sampling_from_proto, sampling_to_proto
from common.transport.grpc_server import GrpcServer, insecure_channel
from common.types import Constraint, ConstraintKind, SamplingParams
from fairserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.gateway.errors import ApiError
from services.gateway.doors.grpc_api import SERVICE_NAME, TextGenerationServicer, add_to_server
from services.gateway.requests.spec import RequestFields, check_constraint
from services.gateway.requests.structured import ConstraintFields, read_constraint
from tests.unit.gateway.fakes import FakeScheduler

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
SCHEMA_TEXT = json.dumps(SCHEMA, separators=(",", ":"))
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "Hi", "max_tokens": 2}
BODIES = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETION,
          "/generate": {"prompt": "Hi", "max_tokens": 2, "stream": False}}

ASKED = [
    ({"response_format": {"type": "json_object"}}, Constraint(ConstraintKind.JSON_OBJECT)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     Constraint(ConstraintKind.JSON_SCHEMA, SCHEMA_TEXT)),
    ({"guided_json": SCHEMA}, Constraint(ConstraintKind.JSON_SCHEMA, SCHEMA_TEXT)),
    ({"guided_json": json.dumps(SCHEMA)}, Constraint(ConstraintKind.JSON_SCHEMA, SCHEMA_TEXT)),
    ({"guided_regex": "[0-9]+"}, Constraint(ConstraintKind.REGEX, "[0-9]+")),
    ({"guided_choice": ["yes", "no", "yes"]}, Constraint(ConstraintKind.CHOICE, choices=("yes", "no"))),
    ({"guided_grammar": 'start: "a" | "b"'}, Constraint(ConstraintKind.GRAMMAR, 'start: "a" | "b"')),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
     Constraint(ConstraintKind.JSON_SCHEMA, SCHEMA_TEXT)),
    ({"structured_outputs": {"choice": ["x", "y"]}}, Constraint(ConstraintKind.CHOICE, choices=("x", "y"))),
    ({"structured_outputs": {"regex": "a+"}}, Constraint(ConstraintKind.REGEX, "a+")),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, Constraint(ConstraintKind.GRAMMAR, 'root ::= "a"')),
    ({"structured_outputs": {"json_object": True}}, Constraint(ConstraintKind.JSON_OBJECT)),
]


@pytest.mark.parametrize("path", sorted(BODIES))
@pytest.mark.parametrize("fields, expected", ASKED)
async def test_each_way_of_asking_reaches_the_scheduler(client: httpx.AsyncClient, fake: FakeScheduler,
                                                        path: str, fields: dict[str, Any],
                                                        expected: Constraint) -> None:
    reply = await client.post(path, json={**BODIES[path], **fields})
    assert reply.status_code == 200, reply.text
    assert fake.requests[-1].spec.sampling.constraint == expected


async def test_n_choices_all_carry_the_constraint(client: httpx.AsyncClient, fake: FakeScheduler) -> None:
    reply = await client.post("/v1/completions", json={**COMPLETION, "n": 3, "guided_regex": "a+"})
    assert reply.status_code == 200, reply.text
    assert [r.spec.sampling.constraint for r in fake.requests] == [Constraint(ConstraintKind.REGEX, "a+")] * 3


async def test_text_format_asks_for_nothing(client: httpx.AsyncClient, fake: FakeScheduler) -> None:
    reply = await client.post("/v1/completions", json={**COMPLETION, "response_format": {"type": "text"}})
    assert reply.status_code == 200, reply.text
    assert fake.requests[-1].spec.sampling.constraint is None


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "nope"),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "string", "pattern": "a(b"}}}},
     "guided_json", "unclosed group"),
    ({"guided_regex": "[a-"}, "guided_regex", "unclosed character class"),
    ({"guided_grammar": "start: missing_rule"}, "guided_grammar", "missing_rule"),
    ({"guided_grammar": 'root ::= "a'}, "guided_grammar", "GBNF"),
    ({"structured_outputs": {"regex": "(x"}}, "structured_outputs", "unclosed group"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "xml"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "both constrain"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "set one"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", "not supported"),
    ({"guided_regex": "a+", "ignore_eos": True}, "ignore_eos", "ignore_eos"),
    # The grammar library panics on this schema (it cuts its error message inside a 4-byte
    # character): still the client's 400, and the server goes on.
    ({"guided_json": {"pattern": ["a" * 84 + "\U0004efac" * 4, False]}}, "guided_json", "could not read"),
]


@pytest.mark.parametrize("path", sorted(BODIES))
@pytest.mark.parametrize("fields, param, words", BAD)
async def test_bad_constraints_are_named_before_queueing(client: httpx.AsyncClient, fake: FakeScheduler,
                                                         path: str, fields: dict[str, Any], param: str,
                                                         words: str) -> None:
    reply = await client.post(path, json={**BODIES[path], **fields})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert fake.requests == []


async def test_grpc_text_api_takes_the_constraint_in_its_sampling(make_app: Any, fake: FakeScheduler) -> None:
    state = make_app(fake).state.gateway
    server = GrpcServer([(add_to_server, TextGenerationServicer(state))], [SERVICE_NAME], "127.0.0.1", 0)
    await server.start()
    channel = insecure_channel(f"127.0.0.1:{server.port}")
    try:
        stub = gateway_pb2_grpc.TextGenerationStub(channel)
        choice = Constraint(ConstraintKind.CHOICE, choices=("yes", "no"))
        sampling = common_pb2.SamplingParams(constraint=constraint_to_proto(choice))
        await stub.Generate(gateway_pb2.TextRequest(prompt="Hi", max_tokens=2, sampling=sampling), timeout=10)
        assert fake.requests[-1].spec.sampling.constraint == choice
        bad = common_pb2.SamplingParams(constraint=constraint_to_proto(Constraint(ConstraintKind.REGEX, "(")))
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.Generate(gateway_pb2.TextRequest(prompt="Hi", max_tokens=2, sampling=bad), timeout=10)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling.constraint" in raised.value.details()
    finally:
        await channel.close()
        await server.stop(0)
    assert len(fake.requests) == 1


def test_the_constraint_survives_the_proto_round_trip() -> None:
    for constraint in [Constraint(ConstraintKind.JSON_OBJECT), Constraint(ConstraintKind.JSON_SCHEMA, SCHEMA_TEXT),
                       Constraint(ConstraintKind.CHOICE, choices=("a", "b")), None]:
        params = SamplingParams(temperature=0.5, constraint=constraint)
        assert sampling_from_proto(sampling_to_proto(params)) == params


def test_checking_a_constraint_imports_no_torch() -> None:
    code = ("import sys; from common.grammar import check, json_schema_constraint; "
            "check(json_schema_constraint({'type': 'object'})); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=False), st.text(max_size=12)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(
        st.sampled_from(["type", "properties", "schema", "json_schema", "json", "regex", "choice", "grammar",
                         "items", "enum", "required", "minimum", "pattern", "json_object", "x"]), inner, max_size=4)),
    max_leaves=16)


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(["response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                             "structured_outputs"]), value=json_values)
def test_any_value_is_a_constraint_or_a_400(name: str, value: Any) -> None:
    try:
        constraint, param = read_constraint(ConstraintFields(**{name: value}))
        check_constraint(RequestFields(constraint=constraint, constraint_param=param or name))
    except ApiError as error:
        assert error.status == 400 and error.param and error.param.startswith(name)


@pytest.mark.parametrize(("fields", "param"), [
    ({"guided_choice": [f"option {i}" for i in range(20_000)]}, "guided_choice"),
    ({"structured_outputs": {"choice": [f"o{i}" for i in range(2000)]}}, "structured_outputs"),
    ({"guided_choice": ["x" * 40_000, "y" * 40_000]}, "guided_choice"),
    ({"guided_regex": "a" * 70_000}, "guided_regex"),
    ({"guided_grammar": "start: " + " | ".join(f'"w{i}"' for i in range(12_000))}, "guided_grammar"),
    ({"guided_json": {"type": "object", "description": "d" * 70_000}}, "guided_json"),
])
async def test_constraints_past_the_workers_limits_are_refused_before_compiling(
        client: httpx.AsyncClient, fake: FakeScheduler, monkeypatch: pytest.MonkeyPatch,
        fields: dict[str, Any], param: str) -> None:
    """The worker's limits (common/grammar.py): a 20,000-option guided_choice once passed the
    gateway and failed in the worker after a second of compiling."""
    import common.grammar

    def never(_constraint: Any) -> str:
        raise AssertionError("compiled")

    monkeypatch.setattr(common.grammar, "grammar_of", never)
    reply = await client.post("/v1/completions", json={**COMPLETION, **fields})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["code"] == "constraint_too_large"
    assert fake.requests == []


def test_the_size_limits_are_the_workers() -> None:
    from common.grammar import MAX_CHOICES, MAX_ITEMS_IN_ROW, check, parser_limits

    assert parser_limits().max_items_in_row == MAX_ITEMS_IN_ROW == MAX_CHOICES + 1
    check(Constraint(ConstraintKind.CHOICE, choices=tuple(f"c{i}" for i in range(MAX_CHOICES))))
