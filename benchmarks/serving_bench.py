"""fairserve against transformers' own OpenAI-compatible server, same model, same load.

    python -m benchmarks.serving_bench              # default model, ~8 min
    python -m benchmarks.serving_bench --quick      # tiny random model: checks the script

Starts one server at a time on this machine and drives it with the load
simulator over /v1/completions (the default model has no chat template, so
both sides get raw prompts):

* fairserve: the whole stack (gateway, scheduler, one worker, kvcache), defaults;
* transformers: `transformers serve MODEL --continuous-batching` (its paged,
  continuously batched generation), float32 on CPU like the worker.

Both get the same requests in the same order per user (same seed). Runs
alternate (fairserve, transformers, fairserve, ...) so a drift of the machine
hits both. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from benchmarks.head_to_head.systems import wait_healthy
from common.model_store import default_cache_dir, default_model_dir, is_prepared
from loadsim import default_texts
from loadsim.drive import drive_closed_loop
from loadsim.stats import Summary, summarize
from loadsim.workload import Workload, parse_workload
from fairserve.launcher.stack import Stack, StackPorts, free_port

SERVERS = ("fairserve", "transformers")


def completion_workload(long_prompts: bool = True) -> Workload:
    """Completions only; `long_prompts` adds the ~370-token support manual as a shared prefix."""
    manual = [{"name": "manual", "weight": 3, "endpoint": "completions", "prefix": default_texts.MANUAL_SYSTEM + "\n",
               "prompts": [f"Q: {q}\nA:" for q in default_texts.MANUAL_QUESTIONS], "max_tokens": 48,
               "temperature": 0.7}]
    return parse_workload({
        "templates": [
            {"name": "question", "weight": 4, "endpoint": "completions",
             "prompts": [f"Q: {q}\nA:" for q in default_texts.SHORT_QUESTIONS], "max_tokens": 48,
             "temperature": 0.7},
            {"name": "code", "weight": 2, "endpoint": "completions", "prompts": list(default_texts.CODE_PROMPTS),
             "max_tokens": 64},
            *(manual if long_prompts else []),
        ],
        "users": [{"name": "busy", "think_time_s": 0.0, "think_jitter": 0.0}],
    })


@dataclass(frozen=True)
class Run:
    server: str
    summary: Summary


@contextmanager
def fairserve(model_dir: Path, log_dir: Path, settings: dict[str, str] | None = None) -> Iterator[str]:
    # Torch threads: the default, as for transformers.
    env = {"MODEL_NAME": str(model_dir), "LOG_LEVEL": "warning", **(settings or {})}
    stack = Stack(ports=StackPorts.free(1), env=env, log_dir=log_dir).start(timeout_s=600)
    try:
        yield stack.url
    finally:
        stack.stop()


@contextmanager
def transformers_serve(model_dir: Path, log_dir: Path, num_blocks: int, max_batch_tokens: int) -> Iterator[str]:
    executable = shutil.which("transformers", path=str(Path(sys.executable).parent)) or "transformers"
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / "transformers-serve.log"
    log = open(log_path, "w")
    process = subprocess.Popen(
        [executable, "serve", str(model_dir), "--continuous-batching", "--cb-num-blocks", str(num_blocks),
         "--cb-max-batch-tokens", str(max_batch_tokens),
         "--device", "cpu", "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(process, url, log_path, timeout_s=600)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


async def drive(url: str, model: str | None, workload: Workload, users: int, seconds: float,
                seed: int) -> Summary:
    result = await drive_closed_loop(url, workload, users, seconds, seed, model=model)
    for problem in sorted({f"{r.outcome}: {r.error}" for r in result.records if r.error})[:5]:
        print(f"  {url}: {problem}", file=sys.stderr)
    return summarize(result.records, result.duration_s)


def one_run(server: str, model_dir: Path, args: argparse.Namespace, round_index: int, scratch: Path) -> Run:
    log_dir = scratch / f"logs-{server}-{round_index}"
    workload = completion_workload(long_prompts=not args.quick)   # the tiny model holds 1024 tokens
    if server == "fairserve":
        context, model = fairserve(model_dir, log_dir, fairserve_settings(args.env)), None
    else:
        context, model = transformers_serve(model_dir, log_dir, args.cb_num_blocks, args.max_batch_tokens), str(model_dir)
    with context as url:
        asyncio.run(drive(url, model, workload, args.users, min(args.seconds, 5.0), seed=999))   # warm-up
        summary = asyncio.run(drive(url, model, workload, args.users, args.seconds, seed=round_index))
    return Run(server, summary)


def fairserve_settings(pairs: list[str], flag: str = "--env") -> dict[str, str]:
    """`flag`'s NAME=VALUE options -> settings for the fairserve stack; a malformed one is an
    error naming `flag`."""
    settings = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise SystemExit(f"{flag} expects NAME=VALUE, got {pair!r}")
        settings[name] = value
    return settings


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value * 1000:,.0f}"


def render(runs: list[Run], header: str) -> str:
    lines = [header, "",
             "| run | server | requests ok / sent | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | "
             "TPOT p99 ms | latency p50 ms |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for index, run in enumerate(runs, 1):
        s = run.summary
        lines.append(f"| {index} | {run.server} | {s.outcomes.get('ok', 0)} / {s.requests} | "
                     f"{s.output_tokens_per_s:,.1f} | {_ms(s.ttft_s.p50)} | {_ms(s.ttft_s.p99)} | "
                     f"{_ms(s.tpot_s.p50)} | {_ms(s.tpot_s.p99)} | {_ms(s.latency_s.p50)} |")
    rates = {server: [r.summary.output_tokens_per_s for r in runs if r.server == server] for server in SERVERS}
    if all(rates.values()) and statistics.median(rates["transformers"]) > 0:
        ratio = statistics.median(rates["fairserve"]) / statistics.median(rates["transformers"])
        lines += ["", f"Median output tokens/s: fairserve {statistics.median(rates['fairserve']):,.1f}, "
                      f"transformers serve {statistics.median(rates['transformers']):,.1f} ({ratio:.2f}x)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--users", type=int, default=8, help="simulated users with no think time")
    parser.add_argument("--seconds", type=float, default=60.0, help="measured seconds per run")
    parser.add_argument("--rounds", type=int, default=2, help="pairs of runs (fairserve, transformers)")
    parser.add_argument("--cb-num-blocks", type=int, default=64,
                        help="transformers' KV pages of 256 tokens (on CPU it sizes its cache from RAM otherwise)")
    parser.add_argument("--max-batch-tokens", type=int, default=2048,
                        help="transformers' tokens per step (fairserve's MAX_BATCH_TOKENS default)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="a setting for the fairserve stack, e.g. SPECULATIVE_TOKENS=4 (repeatable)")
    parser.add_argument("--quick", action="store_true", help="tiny random model, one short round")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.rounds, args.users, args.cb_num_blocks = 3.0, 1, 2, 16
    with tempfile.TemporaryDirectory(prefix="serving-bench-") as name:
        scratch = Path(name)
        if args.quick:
            from tests.fixtures.tiny_model import save_tiny_model
            model_dir = save_tiny_model(scratch / "tiny")
        else:
            model_dir = default_model_dir(default_cache_dir())
            if not is_prepared(model_dir):
                raise SystemExit("default model not prepared: run `make prepare-model` first")
        runs = [one_run(server, model_dir, args, round_index, scratch)
                for round_index in range(args.rounds) for server in SERVERS]
    settings = f", fairserve with {' '.join(args.env)}" if args.env else ""
    header = (f"Serving benchmark ({'quick' if args.quick else 'full'}): {model_dir.name}, /v1/completions, "
              f"{args.users} users with no think time, {args.seconds:g} s per run, {os.cpu_count()} CPUs{settings}.")
    print(render(runs, header))


if __name__ == "__main__":
    main()
