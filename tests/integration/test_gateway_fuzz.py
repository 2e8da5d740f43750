"""Fuzzing the real gateway (four processes, tiny model), without and with
API keys: a bounded schemathesis pass over its OpenAPI schema, a threaded
flood of malformed requests while a well-formed stream runs, and random and
malformed calls on its gRPC text API. No 5xx (nor a gRPC server failure),
ever."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from schemathesis import GenerationMode
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from benchmarks.fuzz_gateway import ERROR_FIELDS, run_fuzz
from benchmarks.fuzz_grpc import run_grpc_fuzz
from fairserve.launcher.stack import Stack
from tests.integration.conftest import start_stack

API_KEY = "sk-fuzz-integration"


@pytest.fixture(scope="module", params=["open", "keyed"])
def fuzz_stack(request: pytest.FixtureRequest, tiny_model_dir: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, str]]:
    # Generated bodies without max_tokens (up to n=16 choices each) get a
    # small default budget, which keeps the pass bounded in time.
    api_key = API_KEY if request.param == "keyed" else ""
    env = {"DEFAULT_MAX_TOKENS": "16", "LOG_LEVEL": "warning"}
    if api_key:
        env["API_KEYS"] = f"fuzz={api_key}"
    stack = start_stack(tmp_path_factory.mktemp(f"fuzz-{request.param}"), tiny_model_dir,
                        extra_env=env)
    yield stack, api_key
    stack.stop()


def _auth(api_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def test_schemathesis_finds_no_server_errors(fuzz_stack: tuple[Stack, str]) -> None:
    stack, api_key = fuzz_stack
    # Operation by operation rather than schema.parametrize(): the schema is
    # only known once the module's stack is up.
    schema = schemathesis.openapi.from_url(f"{stack.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {"POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models"} <= {
        operation.label for operation in operations}
    calls = 0
    for operation in operations:
        # Without a body or parameters there is nothing to make invalid.
        modes = list(GenerationMode) if operation.body else [GenerationMode.POSITIVE]
        for mode in modes:
            calls += _fuzz_operation(operation, mode, _auth(api_key))
    assert calls >= 200


def _fuzz_operation(operation: schemathesis.APIOperation, mode: GenerationMode,
                    headers: dict[str, str]) -> int:
    calls = 0

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=40, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def check(case: schemathesis.Case) -> None:
        nonlocal calls
        calls += 1
        response = case.call(timeout=30, headers=headers)
        case.validate_response(response, checks=[not_a_server_error])
        if response.status_code >= 400:
            assert set(response.json()["error"]) == ERROR_FIELDS, response.text

    check()
    return calls


def test_malformed_flood_while_a_stream_completes(fuzz_stack: tuple[Stack, str]) -> None:
    stack, api_key = fuzz_stack
    started = time.monotonic()
    report = run_fuzz(stack.url, requests=2000, threads=8, seed=0, stream_tokens=48,
                      api_key=api_key)
    assert time.monotonic() - started < 90, report.summary()
    assert report.requests == 2000
    assert report.ok, report.summary()
    assert report.server_errors == 0
    assert len(report.streams) >= 1 and all(stream.ok for stream in report.streams)
    assert report.statuses[200] > 0 and report.statuses[400] > 0 and report.statuses[422] > 0
    assert report.statuses[413] > 0 and report.statuses[405] > 0 and report.statuses[404] > 0
    assert (report.statuses[401] > 0) == bool(api_key), report.summary()

    headers = _auth(api_key)
    assert httpx.get(f"{stack.url}/ready", timeout=10).status_code == 200
    after = httpx.post(f"{stack.url}/v1/completions", timeout=60, headers=headers, json={
        "prompt": "Hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 8


def test_grpc_text_api_fuzz(fuzz_stack: tuple[Stack, str]) -> None:
    stack, api_key = fuzz_stack
    report = run_grpc_fuzz(f"127.0.0.1:{stack.ports.gateway_grpc}", requests=600, threads=4,
                           seed=0, api_key=api_key)
    assert report.ok, report.summary()
    assert report.codes["OK"] > 0 and report.codes["INVALID_ARGUMENT"] > 0, report.summary()
    assert report.codes["RESOURCE_EXHAUSTED"] >= sum(report.by_kind.get("over_limit", {}).values())
    assert (report.codes["UNAUTHENTICATED"] > 0) == bool(api_key), report.summary()
    assert httpx.get(f"{stack.url}/ready", timeout=10).status_code == 200


def test_tenants_and_no_key_downstream(fuzz_stack: tuple[Stack, str]) -> None:
    """With keys, the scheduler accounts requests to the tenant's name; the
    key appears in no stats or metrics of any service."""
    stack, api_key = fuzz_stack
    if not api_key:
        pytest.skip("the open gateway has no tenants")
    headers = _auth(api_key)
    reply = httpx.post(f"{stack.url}/v1/completions", timeout=60, headers=headers, json={
        "prompt": "Hi", "max_tokens": 2, "user": "end-user-1"})
    assert reply.status_code == 200, reply.text
    stats = httpx.get(f"{stack.url}/stats", headers=headers, timeout=10)
    clients = {client["client_id"] for client in stats.json()["scheduler"]["clients"]}
    assert "fuzz" in clients, clients
    texts = [stats.text, httpx.get(f"{stack.url}/metrics", timeout=10).text,
             httpx.get(f"http://127.0.0.1:{stack.ports.scheduler_metrics}/metrics", timeout=10).text]
    for text in texts:
        assert api_key not in text
