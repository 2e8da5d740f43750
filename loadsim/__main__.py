"""Command line: python -m loadsim --help."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import httpx

from loadsim.drive import first_model, wait_ready
from loadsim.report import render_summary, render_sweep, summary_json
from loadsim.runner import RunLimits, RunResult, run_closed_loop, run_open_loop
from loadsim.stats import summarize
from loadsim.transport import HttpTransport
from loadsim.users import make_users
from loadsim.workload import DEFAULT_WORKLOAD, Workload, WorkloadError, load_workload

EPILOG = """examples:
  python -m loadsim --users 8 --duration 60              8 users with think time, for a minute
  python -m loadsim --users 16 --requests 200 --json out.json
  python -m loadsim --rates 0.5,1,2,4 --requests 40      throughput-vs-latency sweep (open loop)
  python -m loadsim --workload my.json --seed 7          a workload file (see docs/loadsim.md)
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loadsim", description=__doc__, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway's base URL")
    parser.add_argument("--api-key", default=None, help="sent as a bearer token")
    parser.add_argument("--model", default="", help="model name to send (default: the gateway's first model)")
    parser.add_argument("--workload", default="", help="workload JSON file (default: the built-in mix)")
    parser.add_argument("--users", type=_positive_int, default=8, help="simulated users (default 8)")
    parser.add_argument("--duration", type=_positive_float, default=None,
                        help="seconds to keep starting requests (per rate in a sweep)")
    parser.add_argument("--requests", type=_positive_int, default=None,
                        help="requests to send (per rate in a sweep)")
    parser.add_argument("--rate", type=_positive_float, default=None,
                        help="open loop: Poisson arrivals at this many requests/s instead of think times")
    parser.add_argument("--rates", type=_rates, default=None,
                        help="open-loop sweep over comma-separated request rates, one table row per rate")
    parser.add_argument("--seed", type=int, default=0, help="same seed, same requests (default 0)")
    parser.add_argument("--timeout", type=_positive_float, default=300.0, help="per-request timeout in seconds")
    parser.add_argument("--json", default="", help="also write the results to this JSON file")
    parser.add_argument("--wait", type=float, default=0.0,
                        help="seconds to wait for the gateway's /ready before starting (default: no wait)")
    args = parser.parse_args(argv)
    if args.duration is None and args.requests is None:
        args.duration = 60.0
    if args.rate is not None and args.rates is not None:
        parser.error("give --rate or --rates, not both")
    return args


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, not {text}")
    return value


def _rates(text: str) -> list[float]:
    problem = argparse.ArgumentTypeError(f"expected comma-separated positive numbers, not {text!r}")
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise problem from None
    if not rates or not all(rate > 0 for rate in rates):
        raise problem
    return rates


async def run(args: argparse.Namespace, workload: Workload) -> dict[str, Any]:
    if args.wait > 0:
        await wait_ready(args.url, args.wait)
    model = args.model or await first_model(args.url, args.api_key)
    limits = RunLimits(duration_s=args.duration, max_requests=args.requests)
    transport = HttpTransport(args.url, args.api_key, timeout_s=args.timeout)
    try:
        if args.rates:
            rows = []
            for rate in args.rates:
                result = await run_open_loop(make_users(workload, args.users, args.seed, model), transport,
                                             rate, limits, seed=args.seed)
                rows.append((rate, summarize(result.records, result.duration_s)))
                print(f"rate {rate:g}/s done", file=sys.stderr, flush=True)
            print(render_sweep(rows))
            return {"model": model, "sweep": [{"rate": rate, **summary_json(s)} for rate, s in rows]}
        users = make_users(workload, args.users, args.seed, model)
        result: RunResult
        if args.rate is not None:
            result = await run_open_loop(users, transport, args.rate, limits, seed=args.seed)
            title = f"Open loop, {args.rate:g} requests/s, {model}:"
        else:
            result = await run_closed_loop(users, transport, limits)
            title = f"Closed loop, {args.users} users, {model}:"
        summary = summarize(result.records, result.duration_s)
        print(render_summary(summary, title))
        errors = sorted({f"{r.outcome}: {r.error}" for r in result.records if r.error})
        for line in errors[:10]:
            print(f"  {line}", file=sys.stderr)
        return {"model": model, "summary": summary_json(summary),
                "records": [vars(r) for r in result.records]}
    finally:
        await transport.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        workload = load_workload(args.workload) if args.workload else DEFAULT_WORKLOAD
    except WorkloadError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        output = asyncio.run(run(args, workload))
    except (httpx.HTTPError, RuntimeError) as error:
        print(f"error: cannot drive {args.url}: {error}", file=sys.stderr)
        return 1
    if args.json:
        Path(args.json).write_text(json.dumps(output, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
