"""Chaos suite (`make chaos`): concurrent greedy streams against two workers,
then against one (the default `make run`), while, in turn, a worker, the
scheduler, the KV index service, the gateway (background /v1/responses
streams, which the client resumes with starting_after) and (with
KV_INDEX_BACKEND=redis, two workers) Redis are killed with SIGKILL mid-stream
and started again. With one worker
its death leaves none: the streams wait for it to come back (WORKER_RECOVERY_S). Each stream is compared with the same request run undisturbed just
before; the report counts accepted, completed, lost, differing and duplicated
streams and 5xx replies per fault (a markdown table and a JSON file) and the
exit code is 1 when any of these is not clean.

    python -m benchmarks.chaos                  # default model, 12 streams x 128 tokens
    python -m benchmarks.chaos --quick          # tiny model, 4 streams x 100 tokens
    python -m benchmarks.chaos --workers 1 --faults worker   # one round, one fault
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.chaos_faults import Fault, RedisProcess, faults_for
from benchmarks.chaos_report import FaultReport, StreamResult, exit_code, fault_report, markdown_table
from benchmarks.chaos_responses import response_bodies, stream_response
from fairserve.launcher.stack import ROOT, Stack, StackPorts

# The tiny model's runs take a millisecond or two: quick runs (DECODE_STEP_MS) would finish its
# 100-token streams in a step or two, before the kill they are there for (as conftest's TINY_ENV).
QUICK_ENV = {
    "KV_CACHE_BLOCK_SIZE": "4", "KV_CACHE_NUM_BLOCKS": "512", "MAX_BATCH_SIZE": "8",
    "PREFILL_CHUNK_SIZE": "16", "TORCH_THREADS": "1", "DECODE_STEP_MS": "0",
}
COMMON_ENV = {"WORKER_HEARTBEAT_INTERVAL_S": "0.5", "LOG_LEVEL": "info"}
STREAM_TIMEOUT_S = 300.0
# The quick mode's faults: the cascade needs streams longer than its kills take.
QUICK_FAULTS = ("worker", "scheduler", "kvcache", "gateway", "redis")


@dataclass
class ChaosSettings:
    quick: bool = False
    streams: int = 12
    tokens: int = 128
    kill_after: int = 16               # every stream has streamed this many chunks at the kill
    down_s: float = 1.0                # how long the target stays dead
    redis: bool | None = None          # None: a Redis round when redis-server is installed
    workers: tuple[int, ...] = (2, 1)  # a round per worker count
    faults: tuple[str, ...] = ()       # only these faults (names as in chaos_faults.py); (): all
    cascade_gap_s: float = 4.0         # the cascade fault: seconds between its kills
    out_dir: Path = field(default_factory=lambda: ROOT / ".cache" / "chaos")

    @classmethod
    def quick_mode(cls, **overrides: Any) -> "ChaosSettings":
        return cls(**{"quick": True, "streams": 4, "tokens": 100, "kill_after": 6, "faults": QUICK_FAULTS,
                      **overrides})


async def stream(client: httpx.AsyncClient, body: dict[str, Any], seen: StreamResult) -> StreamResult:
    """Streams one completion into `seen` (which a watcher may read meanwhile)."""
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            seen.status = response.status_code
            if response.status_code != 200:
                seen.error = (await response.aread()).decode(errors="replace")[:300]
                return seen
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    _take(seen, json.loads(line[len("data: "):]))
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        seen.error = f"{type(error).__name__}: {error}"
    return seen


def _take(seen: StreamResult, event: dict[str, Any]) -> None:
    if "error" in event:
        seen.error = json.dumps(event["error"])[:300]
        return
    for choice in event.get("choices", []):
        seen.text += choice.get("text") or ""
        seen.chunks += 1
        if choice.get("finish_reason"):
            seen.finish_reason = choice["finish_reason"]


def bodies(fault: str, settings: ChaosSettings) -> list[dict[str, Any]]:
    return [{"prompt": f"Chaos round {fault}, stream {index}: tell me a long story about the sea.",
             "max_tokens": settings.tokens, "temperature": 0, "ignore_eos": True, "stream": True}
            for index in range(settings.streams)]


async def until(predicate, what: str, timeout_s: float = STREAM_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s}s for {what}")
        await asyncio.sleep(0.02)


async def run_fault(client: httpx.AsyncClient, fault: Fault, settings: ChaosSettings) -> FaultReport:
    if fault.resumes:      # the gateway's own death: background responses, resumed (chaos_responses.py)
        requests, streamer = response_bodies(fault.name, settings.streams, settings.tokens), stream_response
    else:
        requests, streamer = bodies(fault.name, settings), stream
    references = await asyncio.gather(*(streamer(client, body, StreamResult()) for body in requests))
    broken = [r for r in references if r.status != 200 or r.error or r.finish_reason is None]
    if broken:
        raise RuntimeError(f"{fault.name}: the undisturbed run failed: {broken[0]}")
    started = time.monotonic()
    seen = [StreamResult() for _ in requests]
    tasks = [asyncio.create_task(streamer(client, body, s)) for body, s in zip(requests, seen)]
    await until(lambda: all(s.chunks >= settings.kill_after or s.finish_reason or s.error for s in seen),
                f"{settings.kill_after} chunks on every stream")
    chunks_at_kill = [s.chunks for s in seen]
    killed = time.monotonic()
    await asyncio.to_thread(fault.kill)
    await asyncio.sleep(settings.down_s)
    await asyncio.to_thread(fault.restart)
    recovery_s = time.monotonic() - killed
    results = await asyncio.wait_for(asyncio.gather(*tasks), STREAM_TIMEOUT_S)
    await asyncio.to_thread(fault.settle)
    return fault_report(fault.name, list(results), [r.text for r in references], chunks_at_kill,
                        recovery_s, time.monotonic() - started)


async def run_round(stack: Stack, faults: list[Fault], settings: ChaosSettings) -> list[FaultReport]:
    reports = []
    async with httpx.AsyncClient(base_url=stack.url, timeout=STREAM_TIMEOUT_S) as client:
        for fault in faults:
            report = await run_fault(client, fault, settings)
            print(f"[chaos] {fault.name}: {'ok' if report.ok else 'NOT OK'} "
                  f"({report.duration_s:.1f}s)", flush=True)
            reports.append(report)
    return reports


def start_stack(settings: ChaosSettings, model_dir: Path | None, log_dir: Path,
                extra: dict[str, str], workers: int = 2) -> Stack:
    env = {**COMMON_ENV, **(QUICK_ENV if settings.quick else {}), **extra}
    if model_dir is not None:
        env["MODEL_NAME"] = str(model_dir)
    stack = Stack(ports=StackPorts.free(workers), env=env, log_dir=log_dir).start(timeout_s=300)
    try:
        stack.wait_workers(workers, 120)
    except BaseException:
        stack.stop()
        raise
    return stack


def one_round(settings: ChaosSettings, model_dir: Path | None, run_dir: Path, backend: str,
              workers: int = 2) -> list[FaultReport]:
    redis = RedisProcess(run_dir / "redis") if backend == "redis" else None
    extra = {} if redis is None else {"KV_INDEX_BACKEND": "redis", "REDIS_URL": redis.start()}
    try:
        stack = start_stack(settings, model_dir, run_dir / f"logs-{backend}-{workers}w", extra, workers)
        try:
            faults = [f for f in faults_for(stack, redis, workers, settings.cascade_gap_s)
                      if not settings.faults or f.name.split(" ")[0] in settings.faults]
            return asyncio.run(run_round(stack, faults, settings))
        finally:
            stack.stop()
    finally:
        if redis is not None:
            redis.stop()


def run_suite(settings: ChaosSettings) -> list[FaultReport]:
    """Every round (memory index, then Redis when there is one); writes the JSON
    and returns the reports."""
    run_dir = settings.out_dir / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    run_dir.mkdir(parents=True, exist_ok=True)
    with_redis = settings.redis if settings.redis is not None else bool(shutil.which("redis-server"))
    with tempfile.TemporaryDirectory(prefix="chaos-") as scratch:
        model_dir = tiny_model(Path(scratch)) if settings.quick else None
        reports: list[FaultReport] = []
        for workers in settings.workers:
            reports += one_round(settings, model_dir, run_dir, "memory", workers)
        if with_redis and 2 in settings.workers and (not settings.faults or "redis" in settings.faults):
            reports += one_round(settings, model_dir, run_dir, "redis")
    (run_dir / "chaos.json").write_text(json.dumps({
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(settings).items()},
        "faults": [r.to_json() for r in reports], "ok": exit_code(reports) == 0,
        "logs": str(run_dir)}, indent=2))
    print(f"[chaos] report and service logs: {run_dir}", flush=True)
    return reports


def tiny_model(scratch: Path) -> Path:
    from tests.fixtures.tiny_model import save_tiny_model
    return save_tiny_model(scratch / "tiny")


def parse_args(argv: list[str] | None) -> ChaosSettings:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 4 streams of 100 tokens")
    parser.add_argument("--streams", type=int)
    parser.add_argument("--tokens", type=int)
    parser.add_argument("--kill-after", type=int, help="chunks every stream has before the kill")
    parser.add_argument("--down-s", type=float, help="seconds the target stays dead")
    parser.add_argument("--redis", choices=("auto", "yes", "no"), default="auto")
    parser.add_argument("--out", type=Path, help="directory for the JSON report and logs")
    parser.add_argument("--workers", type=int, nargs="+", choices=(1, 2), help="worker counts, a round each")
    parser.add_argument("--faults", nargs="+", help="only these: worker scheduler kvcache gateway cascade redis")
    parser.add_argument("--cascade-gap-s", type=float, help="seconds between the cascade fault's kills")
    args = parser.parse_args(argv)
    overrides = {key: value for key, value in (
        ("streams", args.streams), ("tokens", args.tokens), ("kill_after", args.kill_after),
        ("down_s", args.down_s), ("out_dir", args.out)) if value is not None}
    overrides["redis"] = {"auto": None, "yes": True, "no": False}[args.redis]
    if args.workers:
        overrides["workers"] = tuple(args.workers)
    if args.faults:
        overrides["faults"] = tuple(args.faults)
    if args.cascade_gap_s is not None:
        overrides["cascade_gap_s"] = args.cascade_gap_s
    return ChaosSettings.quick_mode(**overrides) if args.quick else ChaosSettings(**overrides)


def main(argv: list[str] | None = None) -> int:
    reports = run_suite(parse_args(argv))
    print(markdown_table(reports))
    for report in reports:
        for line in report.details:
            print(f"- {report.fault}: {line}")
    return exit_code(reports)


if __name__ == "__main__":
    sys.exit(main())
