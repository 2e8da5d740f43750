"""A scheduler killed mid-stream and started again loses nothing (tiny model): the
gateway waits for it and resubmits each stream as a continuation, every stream
ends with the text it gives undisturbed and right usage, no client sees a 5xx,
a request sent while the scheduler is down is served once it is back, and the
worker frees the sequences the dead scheduler left (no KV block leaks)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from fairserve.launcher.stack import Stack
from tests.integration.conftest import start_stack
from tests.integration.test_scheduler_stack import Prompts, generate_body, until, wait_drained

TOKENS = 120
WAIT_S = 120.0


@dataclass
class Streamed:
    status: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, int] | None = None
    error: dict[str, Any] | None = None


async def stream(client: httpx.AsyncClient, body: dict[str, Any], seen: Streamed | None = None) -> Streamed:
    result = seen if seen is not None else Streamed()
    async with client.stream("POST", "/generate", json=body) as response:
        result.status = response.status_code
        if response.status_code != 200:
            await response.aread()
            return result
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            result.error = event.get("error", result.error)
            result.text += event.get("token", "")
            if "token_id" in event:
                result.token_ids.append(event["token_id"])
            if "finish_reason" in event:
                result.finish_reason, result.usage = event["finish_reason"], event["usage"]
    return result


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = start_stack(tmp_path_factory.mktemp("scheduler-restart"), tiny_model_dir,
                        extra_env={"SCHEDULER_RECOVERY_S": "60"})
    yield stack
    stack.stop()


async def test_streams_survive_a_scheduler_killed_and_started_again(stack: Stack) -> None:
    prompts = Prompts()
    bodies = {f"s{i}": generate_body(prompts.next(), TOKENS) for i in range(4)}
    late_body = generate_body(prompts.next(), 16)
    async with httpx.AsyncClient(base_url=stack.url, timeout=WAIT_S) as client:
        seen = {name: Streamed() for name in bodies}
        tasks = {name: asyncio.create_task(stream(client, body, seen[name])) for name, body in bodies.items()}
        await until(lambda: all(len(s.token_ids) >= 8 for s in seen.values()), "every stream's 8th token")

        await asyncio.to_thread(stack.kill, "scheduler")   # SIGKILL, as a crash would
        cut = {name: len(s.token_ids) for name, s in seen.items()}
        late = asyncio.create_task(stream(client, late_body))   # sent while no scheduler runs
        await asyncio.sleep(1.0)
        await asyncio.to_thread(stack.start_scheduler_again)

        results = await asyncio.wait_for(asyncio.gather(*tasks.values()), WAIT_S)
        late_result = await asyncio.wait_for(late, WAIT_S)
        assert all(count < TOKENS for count in cut.values()), cut   # killed mid-stream
        for name, result in zip(bodies, results):
            assert result.status == 200 and result.error is None, (name, result)
            assert result.finish_reason == "length" and len(result.token_ids) == TOKENS, (name, result)
            assert result.usage is not None and result.usage["completion_tokens"] == TOKENS
        assert late_result.status == 200 and late_result.error is None and len(late_result.token_ids) == 16

        # Exactly what the same requests give undisturbed: no gap, no repeat.
        for name, result in zip(bodies, results):
            alone = await stream(client, bodies[name])
            assert (result.token_ids, result.text) == (alone.token_ids, alone.text), name
            assert result.usage == {**alone.usage, "cached_tokens": result.usage["cached_tokens"]}
        # The dead scheduler's sequences were freed on the worker: no block is left held.
        await wait_drained(client, stack, [0])
    assert "freed the sequences of an earlier scheduler registration" in (
        stack.log_dir / "worker-0.log").read_text()
