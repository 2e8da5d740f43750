"""Prefix-cache benchmark through the gateway, on real service processes.

    python -m benchmarks.prefix_cache_bench            # default model (minutes)
    python -m benchmarks.prefix_cache_bench --quick    # tiny random model: checks the script

1. One worker: time to first token of a long prompt cold (a prefix never seen),
   the same prompt with a different last sentence (warm prefix), and the
   identical prompt again (exact match), and the ratios cold/warm and
   cold/exact, on a stack as deployed by default (tracing off). Then, on a
   second stack with tracing on, the same requests and where their time went,
   from the services' own spans (exported to a receiver in this process,
   benchmarks/span_sink.py): the client's HTTP, the gateway's parsing and
   tokenizing, the hop to the scheduler, the queue until the first step, the
   steps (the worker's forward and the rest of each step: planning, gRPC,
   block hashing, applying the reply), the way back to the gateway (the
   scheduler's events reaching it: its `first_event` span event) and on to the
   client's first SSE event. The traced TTFTs are printed beside the untraced ones: exporting
   the spans costs CPU on the same cores while the next request runs.
2. Two workers, eight sessions each repeating its own long prefix (all sessions
   at once, each session's turns one after another): the fraction of the
   repeated prefix tokens served from cache (usage.cached_tokens).
3. One worker, `n` choices of one long prompt in a single request: the prompt
   tokens the worker computed and the time to the last choice, with followers
   waiting for the first choice's prefill (the default) and, on a second stack,
   with PREFIX_WAIT_MIN_TOKENS=0.

Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.machine import cpu_name
from benchmarks.span_sink import SpanSink, Trace
from common.model_store import default_cache_dir, default_model_dir, is_prepared
from fairserve.launcher.stack import Stack, StackPorts

WORDS = ("river", "lantern", "copper", "meadow", "signal", "harbor", "orchard", "granite", "violet",
         "engine", "compass", "thunder", "willow", "marble", "falcon", "canyon", "ember", "glacier",
         "saddle", "quartz", "timber", "beacon", "cobalt", "prairie")


@dataclass(frozen=True)
class BenchSizes:
    prompt_tokens: int
    repeats: int
    sessions: int
    session_turns: int
    session_prefix_tokens: int


FULL = BenchSizes(prompt_tokens=1500, repeats=5, sessions=8, session_turns=3, session_prefix_tokens=512)
QUICK = BenchSizes(prompt_tokens=120, repeats=2, sessions=8, session_turns=3, session_prefix_tokens=64)
N_CHOICES = 4


STAGES = ("client to gateway", "tokenize", "gateway, other", "gateway to scheduler", "queue",
          "worker forward", "steps, outside the forward", "scheduler to gateway", "gateway to the client")
SPANS_NEEDED = ("POST /generate", "tokenize", "scheduler.Generate", "scheduler.request", "queue_wait",
                "prefill_chunk", "worker.forward")


@dataclass
class Timed:
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    stages_ms: dict[str, float]    # STAGES: where the time to the first token went


def stages_of(trace: Trace, sent_ns: int, first_event_ns: int) -> dict[str, float]:
    """Where a traced request's time to its first event went, in ms: consecutive stages
    from the client's send to its first SSE event (one host's clock), so they add up
    to the TTFT."""
    post = trace.first("POST /generate")
    generate = trace.first("scheduler.Generate")
    request = trace.first("scheduler.request")
    queue = trace.first("queue_wait")
    chunks = trace.named("prefill_chunk")
    assert post and generate and request and queue and chunks, f"trace {trace.trace_id} lacks spans"
    tokenize = sum(span.duration_ms for span in trace.named("tokenize"))
    # The prefill chunks' forwards: a decode step after the first token is in the trace too.
    chunk_steps = {span.attributes.get("fairserve.step_id") for span in chunks}
    forward = sum(span.duration_ms for span in trace.named("worker.forward")
                  if span.attributes.get("fairserve.step_id") in chunk_steps)
    steps = (chunks[-1].end_ns - chunks[0].start_ns) / 1e6
    answered_ns = generate.events.get("first_event")   # the scheduler's first answer at the gateway
    assert answered_ns is not None, f"trace {trace.trace_id}: the gateway's span lacks its first_event"
    return {"client to gateway": (post.start_ns - sent_ns) / 1e6,
            "tokenize": tokenize,
            "gateway, other": (generate.start_ns - post.start_ns) / 1e6 - tokenize,
            "gateway to scheduler": (request.start_ns - generate.start_ns) / 1e6,
            "queue": (chunks[0].start_ns - request.start_ns) / 1e6,
            "worker forward": forward,
            "steps, outside the forward": steps - forward,
            "scheduler to gateway": (answered_ns - chunks[-1].end_ns) / 1e6,
            "gateway to the client": (first_event_ns - answered_ns) / 1e6}


# ---- prompts -------------------------------------------------------------------------------

def sentence(seed: int, index: int) -> str:
    words = [WORDS[(seed * 7 + index * 5 + k * 3) % len(WORDS)] for k in range(9)]
    return f"Note {index}: the {words[0]} near the {words[1]} carried {words[2]} and {words[3]} " \
           f"past a {words[4]} {words[5]}, while {words[6]} {words[7]} watched the {words[8]}."


def long_body(tokenizer: Any, document: int, tokens: int) -> str:
    """Text of about `tokens` tokens that starts with its own document number, so
    that two documents share no cached block."""
    parts = [f"Document {document}."]
    index = 0
    while len(tokenizer(" ".join(parts + [sentence(document, index)]))["input_ids"]) < tokens - 16:
        parts.append(sentence(document, index))
        index += 1
    filler = 0
    while len(tokenizer(" ".join(parts))["input_ids"]) < tokens - 16:
        parts.append(WORDS[filler % len(WORDS)])
        filler += 1
    return " ".join(parts)


def last_sentence(variant: int) -> str:
    return f" Question {variant}: which {WORDS[variant % len(WORDS)]} came last, and why?"


# ---- measuring -----------------------------------------------------------------------------

def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return reply.read().decode()


def prompt_tokens_computed(stack: Stack) -> float:
    """The workers' fairserve_worker_tokens_total{kind="prompt"}: prefill actually paid."""
    pattern = re.compile(r'^fairserve_worker_tokens_total\{[^}]*kind="prompt"[^}]*\} ([0-9.eE+-]+)$', re.MULTILINE)
    return sum(float(value) for _, port in stack.ports.workers for value in pattern.findall(scrape(port)))


def n_choices_row(stack: Stack, tokenizer: Any, sizes: BenchSizes, label: str) -> tuple[str, str]:
    prompt = tokenizer(long_body(tokenizer, 900 + len(label), sizes.prompt_tokens))["input_ids"]
    before = prompt_tokens_computed(stack)
    started = time.perf_counter()
    reply = httpx.post(f"{stack.url}/v1/completions", timeout=600, json={
        "prompt": prompt, "n": N_CHOICES, "max_tokens": 8, "temperature": 1.0, "seed": 1, "ignore_eos": True})
    seconds = time.perf_counter() - started
    reply.raise_for_status()
    time.sleep(0.5)    # the last step's counters
    computed = prompt_tokens_computed(stack) - before
    return (f"n={N_CHOICES} choices of one {len(prompt):,}-token prompt, {label}",
            f"{seconds:,.2f} s to the last choice; {computed:,.0f} prompt tokens computed "
            f"({computed / len(prompt):.2f}× the prompt)")


def first_token(client: httpx.Client, base_url: str, prompt: str, sink: SpanSink | None) -> Timed:
    """One streamed /generate of a raw prompt with max_tokens 1; TTFT is the
    time to the first SSE event, its stages from the request's trace (with a sink)."""
    body = {"prompt": prompt, "raw": True, "max_tokens": 1, "ignore_eos": True, "temperature": 0,
            "stream": True}
    first_event_ns = None
    usage: dict[str, int] = {}
    # One clock for the TTFT and the spans (the host's, in ns), so that the stages add up to it.
    sent_ns = time.time_ns()
    ttft = None
    with client.stream("POST", f"{base_url}/generate", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if ttft is None:
                first_event_ns = time.time_ns()
                ttft = (first_event_ns - sent_ns) / 1e9
            if '"usage"' in line:
                usage = json.loads(line[len("data: "):])["usage"]
    assert ttft is not None and first_event_ns is not None and usage, "no events from /generate"
    if sink is None:
        return Timed(ttft, usage["prompt_tokens"], usage["cached_tokens"], {})
    traces = sink.wait_traces(1, "POST /generate", sent_ns, needs=SPANS_NEEDED)
    assert traces, "the request's spans did not arrive"
    return Timed(ttft, usage["prompt_tokens"], usage["cached_tokens"],
                 stages_of(traces[0], sent_ns, first_event_ns))


LABELS = {"cold": "cold", "warm": "warm prefix (different last sentence)", "exact": "identical prompt"}


def first_tokens(stack: Stack, tokenizer: Any, sizes: BenchSizes, sink: SpanSink | None) -> dict[str, list[Timed]]:
    """Each repeat: a new document cold, with another last sentence (warm), and again (exact)."""
    runs: dict[str, list[Timed]] = {"cold": [], "warm": [], "exact": []}
    # One keep-alive client, as a real one would: building a client costs tens of ms.
    with httpx.Client() as client:
        first_token(client, stack.url, "Warm up the engine.", sink)
        for repeat in range(sizes.repeats):
            body = long_body(tokenizer, 1000 + repeat, sizes.prompt_tokens)
            runs["cold"].append(first_token(client, stack.url, body + last_sentence(0), sink))
            runs["warm"].append(first_token(client, stack.url, body + last_sentence(repeat + 1), sink))
            runs["exact"].append(first_token(client, stack.url, body + last_sentence(0), sink))
    return runs


def ttft_rows(runs: dict[str, list[Timed]]) -> list[tuple[str, str]]:
    """The TTFT medians and the two ratios."""
    median = {kind: statistics.median(t.ttft_s for t in timed) for kind, timed in runs.items()}
    rows = []
    for kind, timed in runs.items():
        rows.append((f"TTFT, {LABELS[kind]}",
                     f"{median[kind] * 1000:,.1f} ms (prompt {timed[0].prompt_tokens:,} tokens, cached "
                     f"{timed[0].cached_tokens:,})"))
    rows.append(("cold / warm prefix", f"**{median['cold'] / median['warm']:.1f}x**"))
    rows.append(("cold / identical", f"**{median['cold'] / median['exact']:.1f}x**"))
    return rows


def breakdown(runs: dict[str, list[Timed]], labels: dict[str, str] = LABELS) -> str:
    """A table of where the time to the first token went: each stage's median, in ms."""
    kinds = list(runs)
    lines = ["| stage (median ms) | " + " | ".join(labels[kind] for kind in kinds) + " |",
             "|---|" + "---:|" * len(kinds)]
    for stage in STAGES:
        cells = [f"{statistics.median(t.stages_ms[stage] for t in runs[kind]):,.1f}" for kind in kinds]
        lines.append(f"| {stage} | " + " | ".join(cells) + " |")
    sums = [f"{statistics.median(sum(t.stages_ms.values()) for t in runs[kind]):,.1f}" for kind in kinds]
    ttfts = [f"{statistics.median(t.ttft_s for t in runs[kind]) * 1000:,.1f}" for kind in kinds]
    lines.append("| sum of the stages | " + " | ".join(sums) + " |")
    lines.append("| TTFT measured by the client | " + " | ".join(ttfts) + " |")
    return "\n".join(lines)


# ---- sessions over two workers -------------------------------------------------------------

def session_rows(stack: Stack, vocab_size: int, sizes: BenchSizes) -> list[tuple[str, str]]:
    rng = random.Random(0)
    low, high = min(1000, vocab_size // 4), min(vocab_size, 200_000)
    prefixes = [[rng.randrange(low, high) for _ in range(sizes.session_prefix_tokens)]
                for _ in range(sizes.sessions)]

    def run_session(index: int) -> list[int]:
        local = random.Random(index)
        cached = []
        for _ in range(sizes.session_turns):
            prompt = prefixes[index] + [local.randrange(low, high) for _ in range(12)]
            reply = httpx.post(f"{stack.url}/v1/completions", timeout=600, json={
                "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                "session_id": f"session-{index}"})
            reply.raise_for_status()
            cached.append(reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        return cached

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=sizes.sessions) as pool:
        per_session = list(pool.map(run_session, range(sizes.sessions)))
    elapsed = time.perf_counter() - started
    repeated = sizes.sessions * (sizes.session_turns - 1) * sizes.session_prefix_tokens
    served = sum(min(c, sizes.session_prefix_tokens) for turns in per_session for c in turns[1:])
    blocks = httpx.get(f"{stack.url}/stats", timeout=10).json()["kvcache"]["blocks_by_worker"]
    return [
        (f"{sizes.sessions} sessions x {sizes.session_turns} turns, {sizes.session_prefix_tokens}-token "
         f"prefix each, 2 workers", f"{elapsed:,.1f} s"),
        ("repeated-prefix tokens served from cache", f"**{served / repeated:.1%}** ({served:,} of {repeated:,})"),
        ("index blocks by worker afterwards", ", ".join(f"{w}: {n}" for w, n in sorted(blocks.items()))),
    ]


# ---- stacks --------------------------------------------------------------------------------

def start(model_dir: Path, num_workers: int, env: dict[str, str], log_dir: Path) -> Stack:
    stack = Stack(ports=StackPorts.free(num_workers), env={"MODEL_NAME": str(model_dir), **env},
                  log_dir=log_dir)
    stack.start(timeout_s=600)
    try:
        stack.wait_workers(num_workers, timeout_s=600)
    except BaseException:
        stack.stop()
        raise
    return stack


def other_rows(model_dir: Path, tokenizer: Any, sizes: BenchSizes, env: dict[str, str],
               logs: Path) -> list[tuple[str, str]]:
    """Parts 2 and 3 past the first stack: `n` choices all admitted at once, then the sessions."""
    stack = start(model_dir, 1, {**env, "PREFIX_WAIT_MIN_TOKENS": "0"}, logs / "no-wait")
    try:
        rows = [n_choices_row(stack, tokenizer, sizes, "all admitted at once (PREFIX_WAIT_MIN_TOKENS=0)")]
    finally:
        stack.stop()
    # Two workers share the CPUs: one thread each.
    stack = start(model_dir, 2, {**env, "TORCH_THREADS": "1"}, logs / "sessions")
    try:
        rows += session_rows(stack, len(tokenizer), sizes)
    finally:
        stack.stop()
    return rows


def render(rows: list[tuple[str, str]], header: str) -> str:
    lines = [header, "", "| measure | value |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny random model, small sizes")
    parser.add_argument("--model-dir", default="", help="default: the prepared default model")
    parser.add_argument("--ttft-only", action="store_true", help="part 1 alone: the TTFTs and their stages")
    parser.add_argument("--logs", default="", help="where the services write logs (default: a temp dir)")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    # A SIGTERM (a `timeout`) must still stop the services this run started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="prefix-bench-") as scratch:
        if args.quick:
            from tests.fixtures.tiny_model import save_tiny_model
            model_dir = save_tiny_model(Path(scratch) / "tiny")
        else:
            model_dir = Path(args.model_dir) if args.model_dir else default_model_dir(default_cache_dir())
            if not is_prepared(model_dir) and not args.model_dir:
                raise SystemExit(f"{model_dir} is not prepared: run `python -m common.model_store` first")
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        logs = Path(args.logs) if args.logs else Path(scratch) / "logs"
        env = {"LOG_LEVEL": "warning", "WORKER_HEARTBEAT_INTERVAL_S": "0.5"}

        stack = start(model_dir, 1, env, logs / "ttft")     # as deployed: tracing off
        try:
            rows = ttft_rows(first_tokens(stack, tokenizer, sizes, None))
            if not args.ttft_only:
                rows.append(n_choices_row(stack, tokenizer, sizes, "followers wait for the first prefill"))
        finally:
            stack.stop()
        sink = SpanSink.start()
        stack = start(model_dir, 1, {**env, **sink.environment()}, logs / "traced")
        try:
            stages = breakdown(first_tokens(stack, tokenizer, sizes, sink))
        finally:
            stack.stop()
            sink.stop()
        if not args.ttft_only:
            rows += other_rows(model_dir, tokenizer, sizes, env, logs)

    header = (f"Model {model_dir.name}, through the gateway (`/generate` raw, streamed, max_tokens 1 for "
              f"TTFT; median of {sizes.repeats}); {cpu_name()}, "
              f"{os.cpu_count()} CPUs.")
    print(render(rows, header))
    print("\nWhere the time to the first token went, on a second stack with tracing on (the services' "
          "spans, median of each stage; exporting them takes CPU beside the requests):\n")
    print(stages)


if __name__ == "__main__":
    main()
