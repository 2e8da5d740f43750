"""The chaos suite's gateway fault: a stream that survives its gateway is a
background /v1/responses stream, which the client resumes after a break with
GET /v1/responses/{id}?stream=true&starting_after=<last sequence_number>,
from whichever gateway answers, until it ends. An event numbered at or below
one already seen counts as repeated (StreamResult.error says so)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx

from benchmarks.chaos_report import StreamResult

RESUME_WAIT_S = 120.0
TERMINAL = ("response.completed", "response.incomplete", "response.failed")


def response_bodies(fault: str, streams: int, tokens: int) -> list[dict[str, Any]]:
    return [{"input": f"Chaos round {fault}, stream {index}: tell me a long story about the sea.",
             "max_output_tokens": tokens, "temperature": 0, "background": True, "stream": True}
            for index in range(streams)]


async def stream_response(client: httpx.AsyncClient, body: dict[str, Any], seen: StreamResult) -> StreamResult:
    """Streams one background response into `seen`, resuming it after any break."""
    state = {"id": None, "last": -1}
    deadline = time.monotonic() + RESUME_WAIT_S
    request = ("POST", "/v1/responses", {"json": body})
    while True:
        try:
            if await _read(client, request, seen, state):
                return seen
        except (httpx.HTTPError, json.JSONDecodeError):
            pass                                       # the gateway went away: resume
        if state["id"] is None or seen.error is not None or time.monotonic() > deadline:
            seen.error = seen.error or "the stream broke and could not be resumed"
            return seen
        await asyncio.sleep(0.2)
        request = ("GET", f"/v1/responses/{state['id']}",
                   {"params": {"stream": "true", "starting_after": state["last"]}})


async def _read(client: httpx.AsyncClient, request: tuple[str, str, dict[str, Any]], seen: StreamResult,
                state: dict[str, Any]) -> bool:
    """One connection's events; True once the response has ended (or failed for good)."""
    method, url, options = request
    async with client.stream(method, url, **options) as response:
        if response.status_code != 200:
            if state["id"] is not None and response.status_code >= 500:
                return False                            # a gateway starting: try again
            seen.status = seen.status or response.status_code
            seen.error = (await response.aread()).decode(errors="replace")[:300]
            return True
        seen.status = seen.status or 200
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[len("data: "):])
            if event["sequence_number"] <= state["last"]:
                seen.error = f"event {event['sequence_number']} repeated"
                return True
            state["last"] = event["sequence_number"]
            if event["type"] == "response.created":
                state["id"] = event["response"]["id"]
            elif event["type"] == "response.output_text.delta":
                seen.text += event["delta"]
                seen.chunks += 1
            elif event["type"] in TERMINAL:
                seen.finish_reason = event["response"]["status"]
                if event["type"] == "response.failed":
                    seen.error = json.dumps(event["response"].get("error"))[:300]
                return True
    return False
