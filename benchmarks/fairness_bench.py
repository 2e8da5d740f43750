"""Fairness through the gateway: a heavy client keeps many requests in flight
while a light client sends one request at a time; we compare the light
client's TTFT under fcfs and vtc with its TTFT on an otherwise idle system.

The tenants scenario does the same between two tenants (API_KEYS a=..., b=...,
vtc): tenant A keeps its requests in flight while rotating `session_id` and
`user` on every request and asking for the highest priority; tenant B sends
one request at a time. B's median TTFT is compared with B alone on the same
stack (target: at most 1.5x), and no raw key may appear in /stats, in any
service's /metrics or in the services' logs.

    python -m benchmarks.fairness_bench            # default model, MAX_BATCH_SIZE=8
    python -m benchmarks.fairness_bench --quick    # tiny model, checks the script
    python -m benchmarks.fairness_bench --scenario tenants

Every policy runs on a freshly started stack, one after another, in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.machine import cpu_name
from common.model_store import default_cache_dir, default_model_dir, is_prepared
from fairserve.launcher.stack import Stack, StackPorts

WORDS = ("river", "stone", "market", "signal", "garden", "engine", "harbor", "lantern", "orbit",
         "canvas", "meadow", "copper", "thunder", "velvet", "summit", "anchor")


@dataclass(frozen=True)
class Load:
    heavy_in_flight: int
    prompt_words: int
    max_tokens: int
    light_requests: int
    idle_requests: int


FULL = Load(heavy_in_flight=32, prompt_words=60, max_tokens=48, light_requests=6, idle_requests=5)
QUICK = Load(heavy_in_flight=8, prompt_words=12, max_tokens=8, light_requests=4, idle_requests=2)


def prompt(index: int, words: int) -> str:
    return " ".join(WORDS[(index * 7 + i) % len(WORDS)] for i in range(words)) + f" #{index}"


async def timed_request(client: httpx.AsyncClient, user: str, text: str, max_tokens: int,
                        key: str | None = None, **fields: object) -> float:
    """Streams one raw completion (as tenant `key`, if given); returns the time
    to its first token."""
    body = {"prompt": text, "max_tokens": max_tokens, "raw": True, "stream": True, "user": user,
            "ignore_eos": True, **fields}
    headers = {"Authorization": f"Bearer {key}"} if key else None
    started = time.perf_counter()
    ttft = float("nan")
    async with client.stream("POST", "/generate", json=body, headers=headers) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and "token_id" in json.loads(line[6:]) and ttft != ttft:
                ttft = time.perf_counter() - started
    return ttft


async def heavy_client(client: httpx.AsyncClient, load: Load, stop: asyncio.Event) -> int:
    done = 0

    async def lane(lane_index: int) -> None:
        nonlocal done
        index = lane_index
        while not stop.is_set():
            await timed_request(client, "heavy", prompt(1000 + index, load.prompt_words), load.max_tokens)
            done += 1
            index += load.heavy_in_flight

    await asyncio.gather(*(lane(i) for i in range(load.heavy_in_flight)))
    return done


async def light_client(client: httpx.AsyncClient, load: Load, count: int) -> list[float]:
    return [await timed_request(client, "light", prompt(i, load.prompt_words), load.max_tokens)
            for i in range(count)]


async def measure(url: str, load: Load, contended: bool) -> tuple[list[float], int]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await light_client(client, load, 1)  # warm-up
        if not contended:
            return await light_client(client, load, load.idle_requests), 0
        stop = asyncio.Event()
        heavy = asyncio.create_task(heavy_client(client, load, stop))
        await asyncio.sleep(3.0)  # let the heavy client's queue form
        ttfts = await light_client(client, load, load.light_requests)
        stop.set()
        return ttfts, await heavy


def run_policy(model_dir: Path, policy: str, load: Load, contended: bool, logs: Path) -> tuple[list[float], int]:
    env = {"MODEL_NAME": str(model_dir), "SCHEDULING_POLICY": policy, "MAX_BATCH_SIZE": "8",
           "MAX_QUEUE_LEN": "4096", "QUEUE_TIMEOUT_S": "600", "LOG_LEVEL": "warning"}
    stack = Stack(ports=StackPorts.free(1), env=env, log_dir=logs / f"{policy}-{contended}")
    stack.start(timeout_s=600)
    try:
        return asyncio.run(measure(stack.url, load, contended))
    finally:
        stack.stop()


# ---- tenants ----

TOP_PRIORITY = 2**31 - 1     # what tenant A asks for; the gateway lowers it to A's max_priority
TTFT_TARGET = 1.5            # B's median TTFT under A's load, over B alone


@dataclass
class TenantOutcome:
    b_alone: list[float]
    b_contended: list[float]
    a_done: int
    a_refused: dict[int, int]               # HTTP status -> A's requests refused with it
    clients: list[dict[str, object]]        # /stats scheduler.clients after the run
    leaks: list[str] = field(default_factory=list)   # where a raw key was seen

    @property
    def ratio(self) -> float:
        return statistics.median(self.b_contended) / statistics.median(self.b_alone)


async def tenant_a(client: httpx.AsyncClient, key: str, load: Load, stop: asyncio.Event,
                   refused: dict[int, int]) -> int:
    """Keeps load.heavy_in_flight requests in flight, each with a new session and user."""
    done = 0

    async def lane(lane_index: int) -> None:
        nonlocal done
        index = lane_index
        while not stop.is_set():
            try:
                await timed_request(client, f"a-user-{index}", prompt(1000 + index, load.prompt_words),
                                    load.max_tokens, key=key, session_id=f"a-session-{index}",
                                    priority=TOP_PRIORITY)
                done += 1
            except httpx.HTTPStatusError as error:
                refused[error.response.status_code] = refused.get(error.response.status_code, 0) + 1
                await asyncio.sleep(0.1)
            index += load.heavy_in_flight

    await asyncio.gather(*(lane(i) for i in range(load.heavy_in_flight)))
    return done


async def tenant_b(client: httpx.AsyncClient, key: str, load: Load, count: int) -> list[float]:
    return [await timed_request(client, "b-user", prompt(i, load.prompt_words), load.max_tokens, key=key)
            for i in range(count)]


async def measure_tenants(url: str, keys: dict[str, str], load: Load) -> TenantOutcome:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await tenant_b(client, keys["b"], load, 1)  # warm-up
        alone = await tenant_b(client, keys["b"], load, load.idle_requests)
        stop, refused = asyncio.Event(), {}
        a_task = asyncio.create_task(tenant_a(client, keys["a"], load, stop, refused))
        await asyncio.sleep(3.0)  # let A's queue form
        contended = await tenant_b(client, keys["b"], load, load.light_requests)
        stop.set()
        a_done = await a_task
        # /stats is private: only an admin key sees every tenant's counters.
        stats = (await client.get("/stats", headers={"Authorization": f"Bearer {keys['ops']}"})).json()
    clients = (stats.get("scheduler") or {}).get("clients", [])
    return TenantOutcome(alone, contended, a_done, refused, clients)


def metrics_urls(stack: Stack) -> dict[str, str]:
    """Every /metrics endpoint of the stack, by service."""
    ports = stack.ports
    urls = {"gateway": f"{stack.url}/metrics",
            "scheduler": f"http://127.0.0.1:{ports.scheduler_metrics}/metrics",
            "kvcache": f"http://127.0.0.1:{ports.kvcache_metrics}/metrics"}
    for index, (_, metrics_port) in enumerate(ports.workers):
        urls[f"worker-{index}"] = f"http://127.0.0.1:{metrics_port}/metrics"
    return urls


def exposed_texts(stack: Stack, key: str) -> dict[str, str]:
    """What the running stack shows: /stats (as tenant `key` sees it) and
    every service's /metrics, by place."""
    stats = httpx.get(f"{stack.url}/stats", headers={"Authorization": f"Bearer {key}"}, timeout=30)
    texts = {"/stats": stats.text}
    for service, url in metrics_urls(stack).items():
        texts[f"{service} /metrics"] = httpx.get(url, timeout=30).text
    return texts


def places_with(keys: Sequence[str], texts: dict[str, str]) -> list[str]:
    return [place for place, text in texts.items() if any(key in text for key in keys)]


def run_tenants(model_dir: Path, load: Load, logs: Path) -> TenantOutcome:
    # Keys no other text can contain by chance.
    keys = {name: f"sk-{name}-{secrets.token_hex(12)}" for name in ("a", "b", "ops")}
    env = {"MODEL_NAME": str(model_dir), "SCHEDULING_POLICY": "vtc", "MAX_BATCH_SIZE": "8",
           "MAX_QUEUE_LEN": "4096", "QUEUE_TIMEOUT_S": "600", "LOG_LEVEL": "info",
           "API_KEYS": f"a={keys['a']},b={keys['b']}", "ADMIN_KEYS": f"ops={keys['ops']}"}
    stack = Stack(ports=StackPorts.free(1), env=env, log_dir=logs / "tenants")
    stack.start(timeout_s=600)
    try:
        outcome = asyncio.run(measure_tenants(stack.url, keys, load))
        texts = exposed_texts(stack, keys["a"])
    finally:
        stack.stop()
    # The logs once every service has exited, so nothing is left unwritten.
    texts |= {log.name: log.read_text(errors="replace") for log in sorted(stack.log_dir.glob("*.log"))}
    outcome.leaks = places_with(list(keys.values()), texts)
    return outcome


def print_tenants(outcome: TenantOutcome, load: Load, quick: bool) -> None:
    print(f"\nmodel: {'tiny' if quick else 'gemma-3-270m'}; MAX_BATCH_SIZE=8; prompts ~{load.prompt_words} "
          f"words, {load.max_tokens} new tokens; {cpu_name()}")
    print(f"tenants: API_KEYS a=..,b=..; vtc; A keeps {load.heavy_in_flight} in flight, new session and user "
          f"per request, priority {TOP_PRIORITY}; B one at a time")
    print("\n| tenant B | TTFT median (s) | p90 (s) | × B alone |")
    print("|---|---|---|---|")
    alone = statistics.median(outcome.b_alone)
    for name, ttfts in (("alone", outcome.b_alone), ("with A", outcome.b_contended)):
        print(f"| {name} | {statistics.median(ttfts):.3f} | {p90(ttfts):.3f} | "
              f"{statistics.median(ttfts) / alone:.2f} |")
    verdict = "met" if outcome.ratio <= TTFT_TARGET else "MISSED"
    print(f"\nB with A over B alone: {outcome.ratio:.2f}x (target <= {TTFT_TARGET}x: {verdict}); "
          f"A requests done: {outcome.a_done}; A refused: {outcome.a_refused or 'none'}")
    shown = [{k: c.get(k) for k in ("client_id", "weight", "served_tokens")} for c in outcome.clients]
    print(f"/stats clients: {shown}")
    print(f"raw keys seen in: {', '.join(outcome.leaks) if outcome.leaks else 'none'}")


def p90(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


# ---- main ----

def run_flood(model_dir: Path, load: Load, logs: Path, quick: bool) -> None:
    idle, _ = run_policy(model_dir, "fcfs", load, contended=False, logs=logs)
    rows = [("idle (no heavy client)", idle, 0)]
    for policy in ("fcfs", "vtc"):
        ttfts, heavy_done = run_policy(model_dir, policy, load, contended=True, logs=logs)
        rows.append((f"{policy}, heavy client {load.heavy_in_flight} in flight", ttfts, heavy_done))
    idle_median = statistics.median(idle)
    print(f"\nmodel: {'tiny' if quick else 'gemma-3-270m'}; MAX_BATCH_SIZE=8; prompts ~"
          f"{load.prompt_words} words, {load.max_tokens} new tokens; {cpu_name()}")
    print("\n| setting | light client TTFT median (s) | p90 (s) | × idle median | heavy requests done |")
    print("|---|---|---|---|---|")
    for name, ttfts, heavy_done in rows:
        median = statistics.median(ttfts)
        print(f"| {name} | {median:.3f} | {p90(ttfts):.3f} | {median / idle_median:.2f} | {heavy_done} |")


def main(argv: Sequence[str] | None = None) -> TenantOutcome | None:
    """Runs the scenarios; returns the tenants scenario's outcome when it ran."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny model, small load")
    parser.add_argument("--scenario", choices=("all", "flood", "tenants"), default="all",
                        help="flood: heavy and light client under fcfs and vtc; tenants: two API-key tenants")
    args = parser.parse_args(argv)
    load = QUICK if args.quick else FULL
    outcome = None
    with tempfile.TemporaryDirectory() as scratch:
        if args.quick:
            from tests.fixtures.tiny_model import save_tiny_model
            model_dir = save_tiny_model(Path(scratch) / "tiny")
        else:
            model_dir = default_model_dir(default_cache_dir())
            if not is_prepared(model_dir):
                raise SystemExit("default model not prepared: run `make prepare-model`")
        logs = Path(scratch) / "logs"
        if args.scenario in ("all", "flood"):
            run_flood(model_dir, load, logs, args.quick)
        if args.scenario in ("all", "tenants"):
            outcome = run_tenants(model_dir, load, logs)
            print_tenants(outcome, load, args.quick)
    return outcome


if __name__ == "__main__":
    main()
