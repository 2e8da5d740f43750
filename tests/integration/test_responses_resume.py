"""A background /v1/responses stream whose gateway is killed with SIGKILL after
25 deltas: a gateway started again adopts the response from the scheduler, and
GET ?stream=true&starting_after=N gives every later event exactly once, the
final text that of an undisturbed run (tiny model, the official client for
the undisturbed run)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai

from tests.integration.conftest import start_stack

INPUT = "Tell me a long story about the sea and the ships on it."
TOKENS = 600


def _events(response: httpx.Response, limit: int | None = None) -> list[dict[str, Any]]:
    """SSE events as they come; stops after `limit` output_text.delta events."""
    events: list[dict[str, Any]] = []
    deltas = 0
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        event = json.loads(line[len("data: "):])
        events.append(event)
        deltas += event["type"] == "response.output_text.delta"
        if limit is not None and deltas >= limit:
            break
    return events


def test_a_background_stream_survives_its_gateway_and_resumes_exactly(tiny_model_dir: Path,
                                                                      tmp_path: Path) -> None:
    stack = start_stack(tmp_path, tiny_model_dir)
    try:
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)
        undisturbed = client.responses.create(model=tiny_model_dir.name, input=INPUT, temperature=0,
                                              max_output_tokens=TOKENS).output_text
        body = {"input": INPUT, "temperature": 0, "max_output_tokens": TOKENS, "background": True,
                "stream": True}
        with httpx.stream("POST", f"{stack.url}/v1/responses", json=body, timeout=120) as reply:
            assert reply.status_code == 200
            before = _events(reply, limit=25)
            stack.kill("gateway")                      # SIGKILL, mid-stream
        response_id = before[0]["response"]["id"]
        last = before[-1]["sequence_number"]
        stack.respawn("gateway")
        stack.wait_ready(120)
        with httpx.stream("GET", f"{stack.url}/v1/responses/{response_id}",
                          params={"stream": "true", "starting_after": last}, timeout=120) as reply:
            assert reply.status_code == 200, reply.read()
            after = _events(reply)
        # The premise: the generation was still running when its gateway died, and went on.
        assert "the caller of a detached request left" in (stack.log_dir / "scheduler.log").read_text()
    finally:
        stack.stop()
    numbers = [e["sequence_number"] for e in before + after]
    assert numbers == list(range(len(numbers)))                 # every event once, none repeated
    text = "".join(e["delta"] for e in before + after if e["type"] == "response.output_text.delta")
    assert after[-1]["type"] in ("response.completed", "response.incomplete")
    assert text == after[-1]["response"]["output_text"] == undisturbed
