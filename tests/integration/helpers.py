"""Small HTTP/SSE helpers for driving the gateway in integration tests."""

from __future__ import annotations

import json
from typing import Any

import httpx


def sse_events(response: httpx.Response) -> list[dict[str, Any]]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[len("data: "):]))
    return events


def stream_generate(base_url: str, body: dict[str, Any], timeout: float = 120) -> list[dict[str, Any]]:
    with httpx.stream("POST", f"{base_url}/generate", json={**body, "stream": True},
                      timeout=timeout) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return sse_events(response)
