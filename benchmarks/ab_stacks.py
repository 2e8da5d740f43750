"""Two fairserve stacks side by side, A and B, on the same W1 load, rounds alternating.

A change is measured against the code before it (or a setting against its default) on the
same machine in the same minutes: both stacks start first and stay up, and each round sends
the same fresh W1 requests (274-token prompts that each start differently, greedy, exactly
`--max-tokens` new tokens, streamed) closed-loop at `--concurrency` to one stack, then to the
other, the order flipping every round (A B, B A, ...). Each stack runs from its own checkout
(`--a-tree`, `--b-tree`: a worktree of the commit before, say; each needs its stubs, `make
proto`) with its own settings (`--a-env`, `--b-env`).

    python -m benchmarks.ab_stacks --b-tree ../before --concurrency 32 --rounds 6
    python -m benchmarks.ab_stacks --b-env HOST_MEMORY_RELEASE_ROWS=0 --concurrency 8 --rounds 4
    python -m benchmarks.ab_stacks --prefix --b-env EVENT_LOOP=asyncio --rounds 8   # cached prompts' TTFT
    python -m benchmarks.ab_stacks --quick        # tiny model: checks the script

Prints each round (output tok/s, TPOT p50, the worker's and the gateway's peak resident MB)
and then each side's medians and the paired ratios B / A round by round: the machine's speed
drifts by more than most changes within minutes, so a ratio of two runs side by side is the
figure to quote, with how many rounds went which way.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.ab_prefix import prefix_round, prefix_summary
from benchmarks.head_to_head.resident import ResidentSampler
from benchmarks.head_to_head.sweep import Driver, Plan, warm_up
from benchmarks.head_to_head.systems import Served
from benchmarks.head_to_head.workload import unique_requests
from benchmarks.prefix_cache_bench import first_token
from benchmarks.serving_bench import fairserve_settings
from common.model_store import default_cache_dir, default_model_dir, is_prepared
from fairserve.launcher.stack import ROOT, Stack, StackPorts
from loadsim.stats import summarize

QUICK_ENV = {"DECODE_STEP_MS": "0"}     # the tiny model's runs take a millisecond or two (tests' TINY_ENV)


@dataclass(frozen=True)
class Side:
    name: str
    tree: Path
    env: dict[str, str]


@dataclass(frozen=True)
class Round:
    tokens_per_s: float
    tpot_ms: float
    worker_mb: float
    gateway_mb: float


def order(round_index: int) -> tuple[int, int]:
    """Which side goes first: A in even rounds, B in odd ones."""
    return (0, 1) if round_index % 2 == 0 else (1, 0)


def paired_ratios(a: list[Round], b: list[Round]) -> list[float]:
    """B's output tok/s over A's, round by round."""
    return [y.tokens_per_s / x.tokens_per_s for x, y in zip(a, b) if x.tokens_per_s > 0]


def describe(side: Side) -> str:
    """`A (/path/to/tree, NAME=VALUE ...)`."""
    settings = "".join(f", {name}={value}" for name, value in side.env.items())
    return f"{side.name} ({side.tree}{settings})"


def summary(sides: tuple[Side, Side], rounds: tuple[list[Round], list[Round]]) -> list[str]:
    """Each side's medians and peaks, then B / A paired by round."""
    lines = []
    for side, runs in zip(sides, rounds):
        lines.append(f"{describe(side)}: {statistics.median(r.tokens_per_s for r in runs):.1f} tok/s,"
                     f" TPOT p50 {statistics.median(r.tpot_ms for r in runs):.2f} ms (medians of {len(runs)}),"
                     f" worker peak {max(r.worker_mb for r in runs):,.0f} MB, gateway {max(r.gateway_mb for r in runs):,.0f}")
    ratios = paired_ratios(*rounds)
    if ratios:
        higher = sum(1 for r in ratios if r > 1)
        lines.append(f"B / A output tok/s, paired by round: median {statistics.median(ratios):.3f}"
                     f" ({min(ratios):.3f}-{max(ratios):.3f}; B higher in {higher} of {len(ratios)}):"
                     f" {' '.join(f'{r:.3f}' for r in ratios)}")
    return lines


async def one_round(stack: Stack, concurrency: int, requests: int, max_tokens: int, seed: int,
                    short: bool) -> Round:
    model = str(httpx.get(stack.url + "/v1/models", timeout=10).json()["data"][0]["id"])
    driver = Driver("fairserve", Served(stack.url, model), Plan(max_tokens=max_tokens, short_prompts=short))
    try:
        await warm_up(driver)
        resident = ResidentSampler({name: p.pid for name, p in stack.processes.items()}).start()
        run = await driver.closed(concurrency, unique_requests(requests, max_tokens, seed=seed, short=short))
        peaks = resident.finish().peak_mb
    finally:
        await driver.close()
    summary = summarize(run.records, run.duration_s)      # as the head-to-head reports a point
    tpot_s = summary.tpot_s.p50
    return Round(summary.output_tokens_per_s, tpot_s * 1000 if tpot_s is not None else 0.0,
                 peaks.get("worker-0", 0.0), peaks.get("gateway", 0.0))


def prefix_rounds(sides: tuple[Side, Side], stacks: list[Stack], model_dir: Path,
                  args: argparse.Namespace) -> list[str]:
    """--prefix: a document a round on both stacks (ab_prefix.py); returns the summary's lines."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    urls = (stacks[0].url, stacks[1].url)
    rounds = []
    with httpx.Client() as a, httpx.Client() as b:
        for url, client in zip(urls, (a, b)):
            first_token(client, url, "Warm up the engine.", None)
        for index in range(args.rounds):
            pair = prefix_round(urls, (a, b), tokenizer, 5000 + index, 120 if args.quick else 1500,
                                max(1, args.variants))
            rounds.append(pair)
            for side, times in zip(sides, pair):
                print(f"round {index + 1} {side.name}: warm prefix {times.median('warm'):.2f} ms, identical "
                      f"{times.median('exact'):.2f} ms, cold {times.median('cold'):,.1f} ms", flush=True)
    return [f"Prefix TTFT, {args.rounds} documents, {max(1, args.variants)} warm prompts each, alternating:",
            *prefix_summary((describe(sides[0]), describe(sides[1])), rounds)]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a-tree", type=Path, default=ROOT, help="checkout A runs from (default: this one)")
    parser.add_argument("--b-tree", type=Path, default=ROOT, help="checkout B runs from (default: this one)")
    parser.add_argument("--a-env", action="append", default=[], metavar="NAME=VALUE", help="a setting of A's")
    parser.add_argument("--b-env", action="append", default=[], metavar="NAME=VALUE", help="a setting of B's")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=0, help="per round and side (default 1.5 x concurrency)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--prefix", action="store_true",
                        help="cached prompts' first tokens instead of W1 (benchmarks/ab_prefix.py): a new "
                             "document a round, request by request alternating")
    parser.add_argument("--variants", type=int, default=10, help="--prefix: warm prompts a round and side")
    parser.add_argument("--quick", action="store_true", help="tiny model, small load: checks the script")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sides = (Side("A", args.a_tree.resolve(), fairserve_settings(args.a_env, "--a-env")),
             Side("B", args.b_tree.resolve(), fairserve_settings(args.b_env, "--b-env")))
    if args.quick:
        args.concurrency, args.max_tokens = min(args.concurrency, 2), min(args.max_tokens, 6)
        args.rounds = min(args.rounds, 2)
        args.variants = min(args.variants, 2)
    requests = args.requests or max(2, round(args.concurrency * 1.5))
    results: tuple[list[Round], list[Round]] = ([], [])
    with tempfile.TemporaryDirectory(prefix="ab-stacks-") as scratch:
        if args.quick:
            from tests.fixtures.tiny_model import save_tiny_model
            model_dir, base = save_tiny_model(Path(scratch) / "tiny"), QUICK_ENV
        else:
            model_dir, base = default_model_dir(default_cache_dir()), {}
            if not is_prepared(model_dir):
                raise SystemExit("default model not prepared: run `make prepare-model` first")
        stacks: list[Stack] = []
        try:
            for side in sides:
                env = {"MODEL_NAME": str(model_dir), "LOG_LEVEL": "warning", "PYTHONPATH": str(side.tree),
                       **base, **side.env}
                stacks.append(Stack(ports=StackPorts.free(1), env=env, log_dir=Path(scratch) / side.name,
                                    root=side.tree).start(timeout_s=900))
                print(f"[{side.name}] {side.tree} serving at {stacks[-1].url}", file=sys.stderr, flush=True)
            if args.prefix:
                print("\n".join(prefix_rounds(sides, stacks, model_dir, args)))
                return 0
            for index in range(args.rounds):
                for which in order(index):
                    run = asyncio.run(one_round(stacks[which], args.concurrency, requests, args.max_tokens,
                                                seed=1000 + index, short=args.quick))
                    results[which].append(run)
                    print(f"round {index + 1} {sides[which].name}: {run.tokens_per_s:.1f} tok/s, TPOT p50"
                          f" {run.tpot_ms:.2f} ms, worker {run.worker_mb:,.0f} MB, gateway {run.gateway_mb:,.0f} MB",
                          flush=True)
        finally:
            for stack in stacks:
                stack.stop()
    print(f"W1 closed loop at {args.concurrency} in flight, {requests} requests of {args.max_tokens} tokens a round:")
    print("\n".join(summary(sides, results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
