"""Speculative decoding through the real processes (tiny model): with
SPECULATIVE_TOKENS on, greedy and seeded streams carry the same tokens as with
it off, drafts are verified and kept (the worker's counters say so), and
max_tokens is never passed."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import httpx

from tests.integration.conftest import start_stack

PROMPT = "one two three four one two three four one two three four one two three four"
BODIES = {
    "greedy": {"prompt": PROMPT, "max_tokens": 48, "raw": True, "ignore_eos": True, "temperature": 0},
    "seeded": {"prompt": PROMPT, "max_tokens": 40, "raw": True, "ignore_eos": True, "temperature": 0.1,
               "seed": 5},
    "short": {"prompt": PROMPT + " one", "max_tokens": 3, "raw": True, "ignore_eos": True, "temperature": 0},
}


async def stream_tokens(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[list[int], str]:
    tokens: list[int] = []
    finish = ""
    async with client.stream("POST", "/generate", json={**body, "stream": True}) as response:
        assert response.status_code == 200, (await response.aread()).decode()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            assert "error" not in event, event
            if "token_id" in event:
                tokens.append(event["token_id"])
            finish = event.get("finish_reason") or finish
    return tokens, finish


def speculative_counts(metrics: str) -> dict[str, float]:
    return {kind: float(value) for kind, value in re.findall(
        r'fairserve_worker_speculative_tokens_total\{kind="(\w+)",worker="[^"]+"\} ([0-9.e+]+)', metrics)}


async def run_all(url: str) -> dict[str, tuple[list[int], str]]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        results = await asyncio.gather(*(stream_tokens(client, body) for body in BODIES.values()))
    return dict(zip(BODIES, results))


def test_speculation_changes_no_token(tiny_model_dir: Path, tmp_path: Path) -> None:
    outputs = {}
    counts = {}
    for tokens in ("0", "4"):
        stack = start_stack(tmp_path / f"spec{tokens}", tiny_model_dir,
                            extra_env={"SPECULATIVE_TOKENS": tokens, "SPECULATIVE_MAX_BATCH": "4",
                                       "SPECULATIVE_SAMPLED": "true"})
        try:
            outputs[tokens] = asyncio.run(run_all(stack.url))
            metrics = httpx.get(f"http://127.0.0.1:{stack.ports.workers[0][1]}/metrics", timeout=10).text
            counts[tokens] = speculative_counts(metrics)
        finally:
            stack.stop()
    assert outputs["4"] == outputs["0"]
    for name, body in BODIES.items():
        tokens, finish = outputs["4"][name]
        assert len(tokens) == body["max_tokens"] and finish == "length", name
    assert counts["0"] == {"drafted": 0.0, "accepted": 0.0}
    assert counts["4"]["drafted"] > 0 and 0 < counts["4"]["accepted"] <= counts["4"]["drafted"]
