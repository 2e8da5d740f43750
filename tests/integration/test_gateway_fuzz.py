"""Fuzzing the real gateway (four processes, tiny model): a bounded
schemathesis pass over its OpenAPI schema, and a threaded flood of
malformed requests while a well-formed stream runs. No 5xx, ever."""

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
from scripts.stack import Stack
from tests.integration.conftest import start_stack


@pytest.fixture(scope="module")
def fuzz_stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # Generated bodies without max_tokens (up to n=16 choices each) get a
    # small default budget, which keeps the pass bounded in time.
    stack = start_stack(tmp_path_factory.mktemp("fuzz"), tiny_model_dir,
                        extra_env={"DEFAULT_MAX_TOKENS": "16", "LOG_LEVEL": "warning"})
    yield stack
    stack.stop()


def test_schemathesis_finds_no_server_errors(fuzz_stack: Stack) -> None:
    # Operation by operation rather than schema.parametrize(): the schema is
    # only known once the module's stack is up.
    schema = schemathesis.openapi.from_url(f"{fuzz_stack.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {"POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models"} <= {
        operation.label for operation in operations}
    calls = 0
    for operation in operations:
        # Without a body or parameters there is nothing to make invalid.
        modes = list(GenerationMode) if operation.body else [GenerationMode.POSITIVE]
        for mode in modes:
            calls += _fuzz_operation(operation, mode)
    assert calls >= 200


def _fuzz_operation(operation: schemathesis.APIOperation, mode: GenerationMode) -> int:
    calls = 0

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=40, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def check(case: schemathesis.Case) -> None:
        nonlocal calls
        calls += 1
        response = case.call(timeout=30)
        case.validate_response(response, checks=[not_a_server_error])
        if response.status_code >= 400:
            assert set(response.json()["error"]) == ERROR_FIELDS, response.text

    check()
    return calls


def test_malformed_flood_while_a_stream_completes(fuzz_stack: Stack) -> None:
    started = time.monotonic()
    report = run_fuzz(fuzz_stack.url, requests=2000, threads=8, seed=0, stream_tokens=48)
    assert time.monotonic() - started < 90, report.summary()
    assert report.requests == 2000
    assert report.ok, report.summary()
    assert report.server_errors == 0
    assert len(report.streams) >= 1 and all(stream.ok for stream in report.streams)
    assert report.statuses[200] > 0 and report.statuses[400] > 0 and report.statuses[422] > 0
    assert report.statuses[413] > 0 and report.statuses[405] > 0 and report.statuses[404] > 0

    assert httpx.get(f"{fuzz_stack.url}/ready", timeout=10).status_code == 200
    after = httpx.post(f"{fuzz_stack.url}/v1/completions", timeout=60, json={
        "prompt": "Hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 8
