"""How many workers one scheduler keeps busy (docs/scaling.md): for each worker count, the real
kvcache index and scheduler as processes of their own, that many simulated workers
(sim_workers.py: the real worker server over a step-time model) in one more, and a closed-loop
load driven through the scheduler's GenerateMany (or Generate) that saturates the ideal (two
full decode batches per worker: one running, one queued behind it). A row per count: output
tok/s against the ideal (the one-worker row's rate times the count), efficiency, the
scheduler's CPU per step and per token, the workers' idle gap between a step's end and the next
step's start (p50/p99), TTFT p50/p99, and the share of prompt tokens the
workers served from their prefix caches (the simulated workers publish their blocks to the index;
`--shared-prefix N` starts every prompt of a tenant with the same N tokens, as a system prompt
would, so that the scheduler's cache-aware routing has matches to find).

    python -m benchmarks.scale_bench --workers 1,16,64 --seconds 20 --out FILE [--plot PNG]
    python -m benchmarks.scale_bench --quick        # seconds, 1 and 2 workers (the unit test)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.lean_streams import LeanStreams, StreamRefused
from benchmarks.scale_stack import Stack, StackConfig
from benchmarks.sim_engine import StepCosts


STREAMS_PER_CONNECTION = 256


@dataclass
class LoadResult:
    tokens: int = 0
    prompt_tokens: int = 0      # of the requests that finished in the window
    cached_tokens: int = 0
    ttfts_s: list[float] = field(default_factory=list)
    tokens_by_tenant: dict[str, int] = field(default_factory=dict)
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)

    def error(self, kind: str) -> None:
        self.errors += 1
        self.error_kinds[kind[:120]] = self.error_kinds.get(kind[:120], 0) + 1


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Tally:
    """Counts one request's events into the load result: its tokens and finish in the measured
    window, its TTFT when its first tokens come in that window."""

    def __init__(self, result: LoadResult, window: tuple[float, float], tenant: str) -> None:
        self.result, self.window, self.tenant = result, window, tenant
        self.started = time.monotonic()
        self.first = True

    def __call__(self, event) -> None:
        result, now = self.result, time.monotonic()
        within = self.window[0] <= now < self.window[1]
        count = len(event.token_ids) or len(event.tokens)     # packed (packed_tokens) or not
        if count and self.first:
            self.first = False
            if within:
                result.ttfts_s.append(now - self.started)
        if within:
            result.tokens += count
            result.tokens_by_tenant[self.tenant] = result.tokens_by_tenant.get(self.tenant, 0) + count
        if event.HasField("finish") and event.finish.finish_reason == "error":
            result.error(event.finish.message)
        elif event.HasField("finish") and within:
            result.prompt_tokens += event.finish.usage.prompt_tokens
            result.cached_tokens += event.finish.usage.cached_tokens


async def _tallied(events, tally: Tally) -> None:
    async for event in events:
        tally(event)


def tenant_prefixes(tenants: int, tokens: int, seed: int = 1) -> list[list[int]]:
    """Each tenant's shared prompt start (its system prompt), `tokens` long."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 30000) for _ in range(tokens)] for _ in range(tenants)]


async def drive(stack: Stack, concurrency: int, warmup_s: float, seconds: float, prompt_tokens: int,
                max_tokens: int, tenants: int = 4, shared_prefix: int = 0, stream: str = "lean",
                gateways: int = 4, pin_tenant: bool = False, authenticated: bool = False,
                range_ratio: float = 0.0) -> LoadResult:
    """`concurrency` closed loops of requests; tokens and TTFTs counted in the measured window.
    A prompt is its tenant's first `shared_prefix` tokens, then random ones to `prompt_tokens`.
    With `range_ratio` r, each request's prompt and output lengths are drawn uniformly from
    [(1 - r) n, (1 + r) n] (as vLLM's serving benchmark's random range ratio), so that requests
    started together do not all end together.
    `stream`: `lean`, the loops' requests over `gateways` GenerateMany calls, each event counted as
    it is read (lean_streams.py); `multiplexed`, the same calls through the gateway's own client
    (scheduler_streams.py: one call per gateway process, a queue per request); `per_request`,
    a Generate call each, STREAMS_PER_CONNECTION to a connection. With shards, each request goes
    to the shard with the fewest of the driver's requests in flight (a gateway's own count);
    with `pin_tenant`, tenant-0's all go to the first shard (as its cache or sessions would hold
    it there) and the other tenants' take the shards in turn (as their own prefixes and sessions
    would spread them); `authenticated`: the tenants are API-key tenants, ordered by VTC."""
    from fairserve.v1 import scheduler_pb2
    from services.gateway.streaming.scheduler_streams import SchedulerStreams
    rng, result = random.Random(0), LoadResult()
    shards = stack.config.shards
    client = LeanStreams if stream == "lean" else (lambda stub: SchedulerStreams(stub, lambda: None))
    calls = [[client(stack.scheduler_stub(index, shard)) for shard in range(shards)] for index in range(gateways)]
    token_ids = range(3, 30000)
    in_flight = [0] * shards
    turns = iter(range(1 << 62))
    prefixes = tenant_prefixes(tenants, min(shared_prefix, prompt_tokens))
    start = time.monotonic()
    window = (start + warmup_s, start + warmup_s + seconds)
    counter = iter(range(1 << 62))

    def drawn(mean: int) -> int:
        return max(1, round(mean * rng.uniform(1.0 - range_ratio, 1.0 + range_ratio))) if range_ratio else mean

    async def loop(index: int) -> None:
        tenant = f"tenant-{index % tenants}"
        while time.monotonic() < window[1]:
            if not pin_tenant:
                shard = min(range(shards), key=in_flight.__getitem__)
            else:
                shard = 0 if index % tenants == 0 else next(turns) % shards
            stub = stack.scheduler_stub(index // STREAMS_PER_CONNECTION, shard)
            mux = calls[index % gateways][shard]
            prefix = prefixes[index % tenants]
            request = scheduler_pb2.GenerateRequest(
                request_id=f"scale-{index}-{next(counter)}", max_tokens=drawn(max_tokens), ignore_eos=True,
                prompt_token_ids=prefix + rng.choices(token_ids, k=max(1, drawn(prompt_tokens) - len(prefix))),
                client_id=tenant, authenticated=authenticated, packed_tokens=True)
            in_flight[shard] += 1
            try:
                tally = Tally(result, window, tenant)
                if stream == "lean":
                    await mux.generate(request, tally)
                else:
                    await _tallied(stub.Generate(request) if stream == "per_request" else
                                   mux.generate(request, request.request_id, ""), tally)
            except asyncio.CancelledError:
                raise
            except Exception as error:   # noqa: BLE001  (a refused or broken stream counts, the loop goes on)
                code = getattr(error, "code", None)
                if time.monotonic() < window[1]:   # not the end of the run cancelling it
                    result.error(f"{code().name}: {error.details()}" if callable(code) else
                                 str(error) if isinstance(error, StreamRefused) else repr(error))
                await asyncio.sleep(0.05)
            finally:
                in_flight[shard] -= 1

    tasks = [asyncio.create_task(loop(index)) for index in range(concurrency)]
    await asyncio.sleep(window[0] - time.monotonic())
    await stack.mark()
    await asyncio.sleep(max(0.0, window[1] - time.monotonic()))
    await stack.mark_end()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for gateway in calls:
        for call in gateway:
            await call.close()
    return result


# Output tokens/s one scheduler keeps up with on one core of the Zen 4 VM (docs/scaling.md, with
# GenerateMany), by the decode runs a step may take (DECODE_STEPS): ~30-35 µs of its CPU a token
# with one, ~15 with four, ~8 with sixteen. The default layout gives each shard at most this much
# of the workers' ideal rate.
SCHEDULER_TOKENS_PER_S = {1: 28_000, 4: 55_000, 16: 107_000}
# What docs/scaling.md recommends for a pool of GPU-class workers: sixteen runs a step, also in the
# steps that prefill (PREFILL_DECODE_STEPS).
RECOMMENDED_DECODE_STEPS = 16
# The load that saturates a worker: its running batch and as many requests queued behind it, so
# that a finished request's slot is taken in the next step, not after its client's round trip.
BATCHES_PER_WORKER = 2
# The schedulers' MAX_BATCH_TOKENS for GPU-class workers: a step's token budget as vLLM's tuning
# guide advises for throughput on large GPUs (8k and above), so that a batch's worth of W1-sized
# prompts is admitted in one step rather than one slice of it a step.
GPU_MAX_BATCH_TOKENS = 8192


# The schedulers' settings of the recommended layout: (flag, default, help).
_LAYOUT_SETTINGS = (
    ("--decode-steps", RECOMMENDED_DECODE_STEPS,
     "the schedulers' DECODE_STEPS: decode runs a step may take (docs/scaling.md recommends 16 for "
     "GPU-class workers; 1: one decode a step)"),
    ("--prefill-decode-steps", RECOMMENDED_DECODE_STEPS,
     "the schedulers' PREFILL_DECODE_STEPS: decode runs a step that also prefills may take, the new "
     "sequences decoding on (docs/scaling.md recommends the same as --decode-steps; 1: a new request's "
     "first token comes with its prefill)"),
    ("--max-batch-tokens", GPU_MAX_BATCH_TOKENS,
     "the schedulers' MAX_BATCH_TOKENS (default: 8192, for GPU-class workers; the scheduler's own "
     "default, 2048, suits the CPU engine)"),
)


def scheduler_tokens_per_s(decode_steps: int) -> int:
    """What one scheduler keeps up with at `decode_steps` (the measured figure at or below it)."""
    return SCHEDULER_TOKENS_PER_S[max(runs for runs in SCHEDULER_TOKENS_PER_S if runs <= max(decode_steps, 1))]


def default_shards(workers: int, costs: StepCosts, decode_steps: int = RECOMMENDED_DECODE_STEPS) -> int:
    """The layout docs/scaling.md recommends for `workers` such workers: one scheduler while their
    decode rate (a full batch every decode step) is within what one keeps up with, else as many
    shards as that rate needs (64 H200-class workers at sixteen runs a step: 2)."""
    rate = workers * costs.decode_batch * 1000.0 / costs.decode_ms
    return max(1, min(workers, math.ceil(rate / scheduler_tokens_per_s(decode_steps))))


def measure(workers: int, args: argparse.Namespace, costs: StepCosts) -> dict:
    profile = f"{args.profile}/scheduler-{workers}.prof" if args.profile else None
    decode_steps = args.decode_steps
    shards = (default_shards(workers, costs, decode_steps) if args.shards == "auto"
              else min(int(args.shards), workers))
    config = StackConfig(workers=workers, costs=costs, tokens=args.tokens, max_batch=costs.decode_batch,
                         profile=profile, log_dir=args.logs, log_level=args.log_level,
                         shards=shards, exchange=not args.no_exchange, decode_steps=decode_steps,
                         prefill_decode_steps=args.prefill_decode_steps, max_batch_tokens=args.max_batch_tokens)
    with Stack(config) as stack:
        load = asyncio.run(_measured(stack, workers * (args.per_worker or BATCHES_PER_WORKER * costs.decode_batch),
                                     args))
        gaps, busy = stack.worker_steps()
    seconds = args.seconds
    steps, index = stack.steps_in_window, stack.index_in_window
    cpu = stack.scheduler_cpu_in_window
    tok_s = load.tokens / seconds
    return {"workers": workers, "output_tok_s": round(tok_s, 1), "scheduler_cpu_util": round(cpu / seconds, 3),
            "scheduler_cpu_ms_per_step": round(1000.0 * cpu / steps, 3) if steps else None,
            "scheduler_cpu_us_per_token": round(1e6 * cpu / load.tokens, 2) if load.tokens else None,
            "steps_per_s": round(steps / seconds, 1),
            "dispatch_gap_ms_p50": round(percentile(gaps, 0.5), 2),
            "dispatch_gap_ms_p99": round(percentile(gaps, 0.99), 2),
            "device_busy": round(busy, 3),
            "ttft_ms_p50": round(1000 * percentile(load.ttfts_s, 0.5), 1),
            "ttft_ms_p99": round(1000 * percentile(load.ttfts_s, 0.99), 1),
            "cached_token_share": round(load.cached_tokens / load.prompt_tokens, 3) if load.prompt_tokens else 0.0,
            "index_hit_token_share": _share(index.get("hit_tokens", 0), index.get("lookup_tokens", 0)),
            "index_blocks": index.get("blocks", 0),
            "errors": load.errors, "error_kinds": dict(sorted(load.error_kinds.items(), key=lambda kv: -kv[1])[:3]),
            "slowdown": args.slowdown, "stream": args.stream, "shards": config.shards,
            "decode_steps": config.decode_steps,
            "prefill_decode_steps": config.prefill_decode_steps,
            "max_batch_tokens": config.max_batch_tokens,
            "exchange": config.exchange and config.shards > 1,
            "scheduler_cpu_util_by_shard": [round(value / seconds, 3) for value in stack.scheduler_cpu_by_shard],
            "tenant_token_shares": {tenant: round(tokens / load.tokens, 3) for tenant, tokens
                                    in sorted(load.tokens_by_tenant.items())} if load.tokens else {}}


async def _measured(stack: Stack, concurrency: int, args: argparse.Namespace) -> LoadResult:
    await stack.wait_registered()
    try:
        return await drive(stack, concurrency, args.warmup, args.seconds, args.prompt_tokens, args.max_tokens,
                           shared_prefix=args.shared_prefix, stream=args.stream, gateways=args.gateways,
                           tenants=args.tenants, pin_tenant=args.pin_tenant, authenticated=args.vtc,
                           range_ratio=args.range_ratio)
    finally:
        await stack.close_channels()


def _share(part: int, whole: int) -> float:
    return round(part / whole, 3) if whole else 0.0


def with_ideal(rows: list[dict]) -> list[dict]:
    """Each row's ideal: the one-worker row's rate times its count."""
    one = next(row for row in rows if row["workers"] == 1)["output_tok_s"]
    for row in rows:
        row["ideal_tok_s"] = round(one * row["workers"], 1)
        row["efficiency"] = round(row["output_tok_s"] / row["ideal_tok_s"], 3) if one else 0.0
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| workers | tok/s | ideal | efficiency | sched CPU | ms CPU/step | us CPU/token | gap p50/p99 ms "
             "| TTFT p50/p99 ms | cached |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['workers']} | {r['output_tok_s']:.0f} | {r['ideal_tok_s']:.0f} | {r['efficiency']:.2f} "
                     f"| {r['scheduler_cpu_util']:.2f} | {r['scheduler_cpu_ms_per_step']} "
                     f"| {r['scheduler_cpu_us_per_token']} | {r['dispatch_gap_ms_p50']:.1f}/"
                     f"{r['dispatch_gap_ms_p99']:.1f} | {r['ttft_ms_p50']:.0f}/{r['ttft_ms_p99']:.0f} "
                     f"| {100 * r.get('cached_token_share', 0.0):.0f} % |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    counts = [r["workers"] for r in rows]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(counts, [r["ideal_tok_s"] for r in rows], "k--", label="ideal")
    left.plot(counts, [r["output_tok_s"] for r in rows], "o-", label="measured")
    left.set(xlabel="simulated workers", ylabel="output tok/s", title="throughput")
    left.legend()
    right.plot(counts, [r["efficiency"] for r in rows], "o-")
    right.axhline(0.9, color="grey", linestyle=":")
    right.set(xlabel="simulated workers", ylabel="efficiency", ylim=(0, 1.05), title="efficiency")
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="1,16,64", help="comma-separated worker counts")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--out", help="JSON rows here")
    parser.add_argument("--plot", help="a PNG of throughput and efficiency here")
    parser.add_argument("--slowdown", type=float, default=1.0,
                        help="every simulated step this many times as long (a slower device)")
    parser.add_argument("--costs", help="JSON step costs instead of the H200 model (sim_engine.StepCosts)")
    parser.add_argument("--per-worker", type=int, default=0,
                        help="concurrent requests per worker (default: two full decode batches, one "
                             "queued behind the other)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--range-ratio", type=float, default=0.0,
                        help="prompt and output lengths drawn from [(1-r) n, (1+r) n] (0: every request the same)")
    parser.add_argument("--shared-prefix", type=int, default=0,
                        help="tokens every prompt of a tenant starts with (a system prompt; 0: none)")
    parser.add_argument("--stream", default="lean", choices=["lean", "multiplexed", "per_request"],
                        help="requests over GenerateMany calls as a gateway sends them, each event counted as "
                             "it is read (lean) or through the gateway's own client, a queue per request "
                             "(multiplexed); or a Generate call each")
    parser.add_argument("--gateways", type=int, default=4, help="GenerateMany calls the load spreads over")
    parser.add_argument("--shards", default="auto", type=_shards_arg,
                        help="schedulers, each with its share of the workers and the others as SCHEDULER_PEERS; "
                             "auto: the layout docs/scaling.md recommends for each count (one scheduler per "
                             "what one keeps up with at --decode-steps, of the workers' decode rate)")
    for flag, default, text in _LAYOUT_SETTINGS:
        parser.add_argument(flag, type=int, default=default, help=text)
    parser.add_argument("--no-exchange", action="store_true", help="shards do not exchange their tenants' service")
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--pin-tenant", action="store_true",
                        help="tenant-0's requests all go to the first shard (its cache or sessions there), "
                             "the other tenants' take the shards in turn")
    parser.add_argument("--vtc", action="store_true",
                        help="the tenants are authenticated (API keys): ordered by VTC, not arrival")
    parser.add_argument("--tokens", action="store_true", help="INTERNAL_TOKEN and WORKER_TOKEN set everywhere")
    parser.add_argument("--profile", help="a folder for the scheduler's cProfile stats, one file per count")
    parser.add_argument("--logs", help="keep the processes' logs in this folder")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--quick", action="store_true", help="1 and 2 workers, 2 s, small batches")
    args = parser.parse_args(argv)
    if args.quick:
        args.workers, args.seconds, args.warmup, args.tokens = "1,2", 2.0, 1.0, True
        args.prompt_tokens, args.max_tokens, args.shared_prefix = 48, 16, 32
    return args


def _shards_arg(value: str) -> str:
    if value != "auto" and not (value.isdigit() and int(value) >= 1):
        raise argparse.ArgumentTypeError("a count of schedulers (1 or more), or auto")
    return value


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse(argv)
    costs = (StepCosts.from_json(args.costs) if args.costs else StepCosts()).scaled(args.slowdown)
    if args.quick:
        costs = StepCosts(costs.decode_ms, 4, costs.prefill_tok_s)
    counts = sorted({1, *(int(n) for n in args.workers.split(","))})
    rows = []
    for count in counts:
        began = time.monotonic()
        rows.append(measure(count, args, costs))
        rows[-1]["row_wall_s"] = round(time.monotonic() - began, 1)
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    rows = with_ideal(rows)
    print(table(rows))
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "costs": costs.__dict__, "command": sys.argv,
                                              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
                                             indent=1))
    if args.plot:
        plot(rows, args.plot)
    return rows


if __name__ == "__main__":
    main()
