"""Malformed and random bodies never produce a 5xx, and a well-formed
request still completes afterwards."""

from __future__ import annotations

from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings
from tests.unit.gateway.fakes import FakeScheduler

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                         st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)
FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
          "top_k", "min_p", "seed", "stop", "n", "stream", "stream_options", "logprobs",
          "top_logprobs", "priority", "session_id", "user", "raw", "min_tokens",
          "repetition_penalty", "ignore_eos", "presence_penalty", "frequency_penalty", "echo"]
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "x"]),
                                 "content": st.one_of(st.text(max_size=30), json_values)})
bodies = st.one_of(
    json_values,
    st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6),
    st.fixed_dictionaries({"prompt": st.text(max_size=40), "messages": st.lists(message, max_size=3)},
                          optional={name: json_scalars for name in FIELDS[2:]}),
)
PATHS = ["/generate", "/v1/completions", "/v1/chat/completions"]


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(PATHS), body=bodies)
def test_no_5xx_for_random_bodies(tokenizer: Any, path: str, body: Any) -> None:
    import asyncio

    async def run() -> int:
        fake = FakeScheduler(reply_ids=[40, 41, 42])
        transport = httpx.ASGITransport(app=create_app(GatewaySettings(), fake, tokenizer),
                                        raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
            response = await http.post(path, content=_encode(body),
                                       headers={"content-type": "application/json"})
            if response.status_code >= 400:
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}
            return response.status_code

    status = asyncio.run(run())
    assert status < 500, (path, body)


def _encode(body: Any) -> bytes:
    import json

    return json.dumps(body).encode()


async def test_raw_garbage_bytes_are_4xx(tokenizer: Any) -> None:
    fake = FakeScheduler(reply_ids=[40, 41, 42])
    transport = httpx.ASGITransport(app=create_app(GatewaySettings(), fake, tokenizer),
                                    raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
        for payload in [b"\xff\xfe\x00", b"{", b"null", b"[]", b'"text"', b"1e999999",
                        b'{"prompt": "\\ud800"}', b'{"prompt": 1}']:
            for path in PATHS:
                response = await http.post(path, content=payload)
                assert 400 <= response.status_code < 500, (path, payload, response.text)
        ok = await http.post("/generate", json={"prompt": "Hi", "stream": False, "raw": True})
        assert ok.status_code == 200
