"""Talking to a gateway by URL: wait until it is ready, ask which model it serves,
and one closed-loop run (for benchmarks that drive the load simulator from Python)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx

from loadsim.runner import RunLimits, RunResult, run_closed_loop
from loadsim.transport import HttpTransport
from loadsim.users import make_users
from loadsim.workload import Workload


async def first_model(url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=10.0) as client:
        response = await client.get(url.rstrip("/") + "/v1/models", headers=headers)
        response.raise_for_status()
        models = response.json().get("data") or []
    if not models:
        raise RuntimeError("the gateway lists no models")
    return str(models[0]["id"])


async def wait_ready(url: str, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
    """Polls /ready until it answers 200; raises RuntimeError after `timeout_s`."""
    deadline = clock() + timeout_s
    last = "no answer"
    async with httpx.AsyncClient(timeout=5.0) as client:
        while True:
            try:
                response = await client.get(url.rstrip("/") + "/ready")
                if response.status_code == 200:
                    return
                last = f"HTTP {response.status_code}: {response.text[:200]}"
            except httpx.HTTPError as error:
                last = f"{type(error).__name__}: {error}"
            if clock() >= deadline:
                raise RuntimeError(f"not ready after {timeout_s:g} s ({last})")
            await asyncio.sleep(1.0)



async def drive_closed_loop(url: str, workload: Workload, users: int, seconds: float, seed: int,
                            model: str | None = None, api_key: str | None = None) -> RunResult:
    """`users` simulated users for `seconds`; the model defaults to the server's first."""
    model = model or await first_model(url, api_key)
    transport = HttpTransport(url, api_key)
    try:
        return await run_closed_loop(make_users(workload, users, seed, model), transport,
                                     RunLimits(duration_s=seconds))
    finally:
        await transport.close()
