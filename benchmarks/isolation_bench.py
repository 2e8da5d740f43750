"""One tenant's stream while another floods /tokenize: the victim's longest gap between streamed
tokens, alone and under the flood.

    python -m benchmarks.isolation_bench            # default model (`make bench-isolation`)
    python -m benchmarks.isolation_bench --quick    # tiny random model: checks the script
    python -m benchmarks.isolation_bench --gateway-only   # the gateway alone, a paced fake scheduler
    python -m benchmarks.isolation_bench --url http://127.0.0.1:8000 --key K --flood-key K2

Starts the stack with only API_KEYS set (alice and bob; every other setting at its default),
unless --url names a running one. alice streams greedy /v1/completions (EOS ignored) one after
another, first alone, then while `--flood-threads` clients of bob (processes of their own,
`--flood-nice`) post `--flood-kb` KB texts to
/tokenize back to back (the issue's attack: past the context, refused by length now), then while
they post texts that fit the context (about max_model_len tokens each: tokenized in full, the
most tokenizing one request can ask for). With --gateway-only the gateway runs alone in a process
of its own, with the default model's tokenizer and a fake scheduler sending a token every 20 ms
(`--max-model-len`, default 32768, Gemma 3 270M's context, past which 750 KB texts are tokenized
in full): what the gateway's own loop adds, without the model's steps competing for the CPU.
A gap is the time between two streamed chunks of one stream (the first
token's wait excluded); the table shows the longest and the median per phase, the ratio of the
longest gaps and bob's /tokenize answers. The target (issue 38): the longest gap under the flood
within 4x of alone, or under 300 ms.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.machine import cpu_name
from common.model_store import default_cache_dir, default_model_dir, is_prepared
from fairserve.launcher.stack import Stack, StackPorts

ALICE_KEY = "sk-bench-alice-0123456789"
BOB_KEY = "sk-bench-bob-0123456789"
WORDS = ("the of and to in is was for on that with as by at from his her an are were which this be "
         "or have had one not but all new more their time after first two may there would been when "
         "city river under between during system model tokenizer stream request answer ").split()


@dataclass
class Phase:
    name: str
    gaps_ms: list[float] = field(default_factory=list)
    floods: collections.Counter[str] = field(default_factory=collections.Counter)
    flood_s: list[float] = field(default_factory=list)

    @property
    def longest_ms(self) -> float:
        return max(self.gaps_ms)


def flood_text(kilobytes: int, seed: int) -> str:
    rng = random.Random(seed)
    words: list[str] = []
    size = 0
    while size < kilobytes * 1000:
        word = rng.choice(WORDS) + rng.choice(("", "", "", ",", ".", "\n"))
        words.append(word)
        size += len(word) + 1
    return " ".join(words)[: kilobytes * 1000]


def stream_gaps(client: httpx.Client, max_tokens: int, seed: int) -> list[float]:
    """One greedy stream's gaps between chunks, in ms (after the first)."""
    body = {"prompt": f"Write a long story about the city by the river, part {seed}.",
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    arrivals: list[float] = []
    with client.stream("POST", "/v1/completions", json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"victim stream: {reply.status_code} {reply.read()[:200]!r}")
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if any(choice.get("text") for choice in chunk.get("choices", [])):
                    arrivals.append(time.perf_counter())
    return [(later - earlier) * 1000.0 for earlier, later in zip(arrivals, arrivals[1:])]


def flood(url: str, key: str, text: str, stop: Any, answers: Any, nice: int) -> None:
    """Posts `text` to /tokenize until stopped (in a process of its own: the victim's client
    shares no GIL with it), then puts its answers and their seconds on `answers`."""
    if nice:
        os.nice(nice)
    body = json.dumps({"prompt": text}).encode()
    counts: collections.Counter[str] = collections.Counter()
    seconds: list[float] = []
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    with httpx.Client(base_url=url, timeout=120, headers=headers) as client:
        while not stop.is_set():
            started = time.perf_counter()
            try:
                reply = client.post("/tokenize", content=body)
                code = reply.json().get("error", {}).get("code", "") if reply.status_code != 200 else ""
                counts[f"{reply.status_code} {code}".strip()] += 1
            except httpx.HTTPError as error:
                counts[type(error).__name__] += 1
            seconds.append(time.perf_counter() - started)
    answers.put((dict(counts), seconds))


def fitting_kb(url: str, key: str) -> int:
    """KB of flood text that makes about 90% of the context's tokens."""
    sample = flood_text(2, 99)
    with httpx.Client(base_url=url, timeout=60, headers={"authorization": f"Bearer {key}"}) as client:
        reply = client.post("/tokenize", json={"prompt": sample}).json()
    chars_per_token = len(sample) / reply["count"]
    return max(1, int(reply["max_model_len"] * 0.9 * chars_per_token / 1000))


def run_phase(url: str, args: argparse.Namespace, name: str, flood_kb: int = 0) -> Phase:
    phase = Phase(name)
    spawn = multiprocessing.get_context("spawn")
    stop, answers = spawn.Event(), spawn.Queue()
    floods = [spawn.Process(target=flood, args=(url, args.flood_key, flood_text(flood_kb, i), stop, answers,
                                                args.flood_nice), daemon=True)
              for i in range(args.flood_threads if flood_kb else 0)]
    for process in floods:
        process.start()
    try:
        if floods:
            time.sleep(2.0)   # the flood is under way before the victim starts
        with httpx.Client(base_url=url, timeout=300,
                          headers={"authorization": f"Bearer {args.key}"}) as client:
            for index in range(args.streams):
                phase.gaps_ms.extend(stream_gaps(client, args.max_tokens, index))
    finally:
        stop.set()
        for _ in floods:
            counts, seconds = answers.get(timeout=120)
            phase.floods.update(counts)
            phase.flood_s.extend(seconds)
        for process in floods:
            process.join(timeout=30)
    return phase


def render(phases: list[Phase], args: argparse.Namespace, model: str) -> str:
    alone = phases[0]
    lines = [f"{cpu_name()}, {model}: alice streams {args.streams} x {args.max_tokens} tokens; bob "
             f"floods /tokenize from {args.flood_threads} processes (nice {args.flood_nice})", "",
             "| phase | longest gap ms | median gap ms | longest / alone | target met | bob's /tokenize answers |",
             "|---|---:|---:|---:|---|---|"]
    for phase in phases:
        ratio = phase.longest_ms / alone.longest_ms
        met = "yes" if ratio <= 4 or phase.longest_ms < 300 else "NO"
        answers = ", ".join(f"{count} x {status}" for status, count in sorted(phase.floods.items()))
        each = f" (median {statistics.median(phase.flood_s) * 1000:.0f} ms)" if phase.flood_s else ""
        lines.append(f"| {phase.name} | {phase.longest_ms:.0f} | {statistics.median(phase.gaps_ms):.0f} | "
                     f"{ratio:.2f}x | {met} | {answers or '-'}{each} |")
    lines += ["", "target (issue 38): the longest gap under a flood within 4x of alone, or under 300 ms"]
    return "\n".join(lines)


def serve_fake_gateway(port: int, max_model_len: int) -> None:
    """The real gateway app (the default model's tokenizer, only API_KEYS set) over a fake
    scheduler pacing its tokens at 20 ms, served by uvicorn as main.py does, until killed."""
    import uvicorn

    from services.gateway.app import create_app
    from services.gateway.http_limits import uvicorn_limits
    from services.gateway.main import load_tokenizer
    from services.gateway.settings import GatewaySettings
    from tests.unit.gateway.fakes import FakeScheduler

    env = {"API_KEYS": f"alice={ALICE_KEY},bob={BOB_KEY}", "MAX_MODEL_LEN": str(max_model_len),
           "LOG_LEVEL": "warning"}
    settings = GatewaySettings.from_env(env)
    fake = FakeScheduler(reply_ids=list(range(1000, 1000 + 4096)), token_delay_s=0.02,
                         model_len=max_model_len)
    app = create_app(settings, fake, load_tokenizer(settings))
    uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, access_log=False,
                                  lifespan="off", **uvicorn_limits(settings))).run()


def start_fake_gateway(args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str]:
    from fairserve.launcher.stack import free_port

    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "benchmarks.isolation_bench", "--serve-fake-gateway",
                                str(port), "--max-model-len", str(args.max_model_len)], env=os.environ)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.5)
    process.kill()
    raise SystemExit("the fake-scheduler gateway did not start")


def start_stack(args: argparse.Namespace, scratch: Path) -> tuple[Stack, str]:
    if args.quick:
        from tests.fixtures.tiny_model import save_tiny_model
        model_dir = save_tiny_model(scratch / "tiny")
    else:
        model_dir = default_model_dir(default_cache_dir())
        if not is_prepared(model_dir):
            raise SystemExit("the default model is not prepared: run `make prepare-model`")
    env = {"MODEL_NAME": str(model_dir), "LOG_LEVEL": "warning", "WORKER_HEARTBEAT_TIMEOUT_S": "60",
           "API_KEYS": f"alice={ALICE_KEY},bob={BOB_KEY}"}
    stack = Stack(ports=StackPorts.free(1), env=env, log_dir=scratch / "logs").start(timeout_s=600)
    return stack, model_dir.name


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny random model, short streams")
    parser.add_argument("--url", help="a running gateway (else a stack is started)")
    parser.add_argument("--key", default=ALICE_KEY, help="the victim's API key (with --url)")
    parser.add_argument("--flood-key", default=BOB_KEY, help="the flooder's API key (with --url)")
    parser.add_argument("--streams", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--flood-threads", type=int, default=2, help="flooding clients (each a process)")
    parser.add_argument("--flood-nice", type=int, default=0,
                        help="niceness of the flooding clients (19: as if they ran on another machine)")
    parser.add_argument("--flood-kb", type=int, default=750)
    parser.add_argument("--gateway-only", action="store_true",
                        help="the gateway alone over a fake scheduler (a token every 20 ms)")
    parser.add_argument("--max-model-len", type=int, default=32768, help="with --gateway-only")
    parser.add_argument("--serve-fake-gateway", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_fake_gateway:
        serve_fake_gateway(args.serve_fake_gateway, args.max_model_len)
        return
    if args.quick:
        args.streams, args.max_tokens = min(args.streams, 2), min(args.max_tokens, 24)
    stack: Stack | None = None
    fake: subprocess.Popen[bytes] | None = None
    if args.url:
        url, model = args.url, "a running gateway"
    elif args.gateway_only:
        fake, url = start_fake_gateway(args)
        model = f"the gateway alone (Gemma 3 tokenizer, max_model_len {args.max_model_len}, fake scheduler)"
    else:
        stack, model = start_stack(args, Path(tempfile.mkdtemp(prefix="isolation-bench-")))
        url = stack.url
    try:
        run_phase(url, argparse.Namespace(**{**vars(args), "streams": 1}), "warm-up")
        fits = fitting_kb(url, args.flood_key)
        phases = [run_phase(url, args, "alone"),
                  run_phase(url, args, f"{args.flood_kb} KB texts", args.flood_kb),
                  run_phase(url, args, f"{fits} KB texts (fit the context)", fits)]
        for phase in phases:
            print(f"{phase.name}: longest gap {phase.longest_ms:.0f} ms", file=sys.stderr, flush=True)
    finally:
        if stack is not None:
            stack.stop()
        if fake is not None:
            fake.kill()
            fake.wait()
    print(render(phases, args, model))


if __name__ == "__main__":
    main()
