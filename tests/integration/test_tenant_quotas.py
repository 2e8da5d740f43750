"""Tenant quotas that hold across gateway replicas, and fairness by default with
API keys, on a real stack (tiny model) with TWO gateways in front of one
scheduler, every other setting at its default:

- a tenant with max_in_flight=2 has its third concurrent generation refused,
  its first two running on different gateways (each gateway alone sees one);
- a tokens_per_minute budget spent through both gateways holds once, not per
  gateway;
- the attack: tenant A asks n=8 long generations, and tenant B's 3-token
  request does not wait behind them (SCHEDULING_POLICY unset is auto: VTC for
  authenticated tenants).

No timing is asserted: only which request finishes first, and counts.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from fairserve.launcher.stack import Stack, free_ports
from tests.integration.conftest import start_stack

KEYS = {"a": "key-a", "t": "key-t", "heavy": "key-heavy", "b": "key-b"}
TOKENS_PER_MINUTE = 200
TENANTS = {"tenants": {"a": {"max_in_flight": 2}, "t": {"tokens_per_minute": TOKENS_PER_MINUTE}}}
PROMPT = "Tell me a story about a quiet harbour town and the boats in it."


@pytest.fixture(scope="module")
def two_gateways(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    tmp = tmp_path_factory.mktemp("quotas")
    tenants_file = tmp / "tenants.json"
    tenants_file.write_text(json.dumps(TENANTS))
    env = {"API_KEYS": ",".join(f"{name}={key}" for name, key in KEYS.items()),
           "TENANTS_FILE": str(tenants_file)}
    assert "SCHEDULING_POLICY" not in env
    stack = start_stack(tmp, tiny_model_dir, extra_env=env)
    try:
        second = _second_gateway(stack)
        yield stack.url, second
    finally:
        stack.stop()


def _second_gateway(stack: Stack) -> str:
    http_port, grpc_port = free_ports(2)
    stack._spawn("gateway-2", "services.gateway.main",
                 {"GATEWAY_PORT": str(http_port), "GATEWAY_GRPC_PORT": str(grpc_port)})
    url = f"http://127.0.0.1:{http_port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        stack.check_alive()
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"the second gateway is not ready:\n{stack.tail('gateway-2')}")


def _headers(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


def _complete(url: str, tenant: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", headers=_headers(tenant), timeout=120,
                      json={"prompt": PROMPT, "max_tokens": 3, **body})


def _assert_quota_429(reply: httpx.Response, words: str) -> None:
    assert reply.status_code == 429, reply.text
    error = reply.json()["error"]
    assert error["code"] == "tenant_quota_exceeded" and words in error["message"], error
    assert int(reply.headers["retry-after"]) >= 1


def test_max_in_flight_holds_across_two_gateways(two_gateways: tuple[str, str]) -> None:
    first, second = two_gateways
    body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120, headers=_headers("a")) as client:
        with client.stream("POST", f"{first}/v1/completions", json=body) as one, \
                client.stream("POST", f"{second}/v1/completions", json=body) as two:
            # Kept: a line iterator dropped closes its stream (the generation would be cancelled).
            streams = [running.iter_lines() for running in (one, two)]
            assert one.status_code == two.status_code == 200
            for lines in streams:
                next(line for line in lines if line.startswith("data: "))
            # Each gateway has one of a's generations; the scheduler has both.
            _assert_quota_429(_complete(first, "a"), "2 generations in flight")
            _assert_quota_429(_complete(second, "a"), "2 generations in flight")
            assert _complete(second, "b").status_code == 200      # another tenant is not touched
    # Both streams closed: the scheduler released them, and a is served again.
    deadline = time.monotonic() + 30
    while (reply := _complete(first, "a")).status_code == 429 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert reply.status_code == 200, reply.text


def test_a_token_budget_holds_once_across_two_gateways(two_gateways: tuple[str, str]) -> None:
    started = time.monotonic()
    spent, served_by, refusal = 0, set(), None
    for index in range(40):
        url = two_gateways[index % 2]
        reply = _complete(url, "t", max_tokens=8, ignore_eos=True)
        if reply.status_code == 429:
            refusal = reply
            break
        assert reply.status_code == 200, reply.text
        usage = reply.json()["usage"]
        spent += usage["prompt_tokens"] + usage["completion_tokens"]
        served_by.add(url)
    assert refusal is not None, f"no refusal after {spent} tokens"
    _assert_quota_429(refusal, f"{TOKENS_PER_MINUTE} tokens a minute")
    assert served_by == set(two_gateways)
    # The budget, its refill while the test ran, and the last request's output (charged
    # as produced): not twice the budget, as one budget per gateway would allow.
    refill = (time.monotonic() - started) * TOKENS_PER_MINUTE / 60
    assert TOKENS_PER_MINUTE * 0.5 < spent <= TOKENS_PER_MINUTE + refill + 8, spent
    assert _complete(two_gateways[1], "b").status_code == 200


def test_a_flood_of_long_generations_does_not_hold_up_another_tenants_short_request(
        two_gateways: tuple[str, str]) -> None:
    """The attack: heavy asks n=8 long generations (the tiny stack's whole batch);
    b's 3-token request must finish while they still run, not after them."""
    first, second = two_gateways
    first_chunk, stop = threading.Event(), threading.Event()
    heavy_finished: list[float] = []

    def flood() -> None:
        body = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True, "n": 8}
        with httpx.stream("POST", f"{first}/v1/completions", json=body, headers=_headers("heavy"),
                          timeout=120) as reply:
            assert reply.status_code == 200, reply.read()
            for line in reply.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                first_chunk.set()
                if any(choice.get("finish_reason") for choice in json.loads(line[6:])["choices"]):
                    heavy_finished.append(time.monotonic())
                if stop.is_set():
                    return

    heavy = threading.Thread(target=flood, daemon=True)
    heavy.start()
    try:
        assert first_chunk.wait(60), "the flood never started"
        light = _complete(second, "b", max_tokens=3, ignore_eos=True)
        light_done = time.monotonic()
        assert light.status_code == 200, light.text
        assert light.json()["usage"]["completion_tokens"] == 3
        assert not heavy_finished or heavy_finished[0] > light_done, \
            "b's 3 tokens waited for heavy's generations to end"
    finally:
        stop.set()
        heavy.join(timeout=120)
