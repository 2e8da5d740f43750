"""TPOT with a JSON schema against TPOT without one, at 8 concurrent streams.

    python -m benchmarks.structured_bench            # default model, 3 rounds (`make bench-structured`)
    python -m benchmarks.structured_bench --quick    # tiny random model: checks the script

Starts the whole stack once (defaults), then alternates rounds: 8 concurrent streaming
/v1/completions without a constraint (EOS ignored), then the same 8 with `response_format`
json_schema (a list of records: nested objects, enums, numbers in ranges, strings, arrays, at
least 50 records, so every stream runs to max_tokens), and again. Both sides sample at the same
temperature, so both compute the full LM head (a constrained row never takes the screen).
TPOT of a stream is (last token's time - first token's time) / (tokens - 1); the table shows the
median over each side's streams, per round and overall, and the ratio (target <= 1.15).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import jsonschema

from benchmarks.machine import cpu_name
from common.model_store import default_cache_dir, default_model_dir, is_prepared
from fairserve.launcher.stack import Stack, StackPorts

RECORD = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 18, "maximum": 90},
    "role": {"enum": ["admin", "engineer", "manager", "intern"]},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False},
    "skills": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    "active": {"type": "boolean"}},
    "required": ["name", "age", "role", "address", "skills", "active"], "additionalProperties": False}
SCHEMA = {"type": "object", "properties": {"employees": {"type": "array", "items": RECORD, "minItems": 50}},
          "required": ["employees"], "additionalProperties": False}
PROMPTS = [f"Company directory #{i}, exported as JSON with every employee's name, age, role, address, "
           f"skills and status:\n" for i in range(64)]


@dataclass
class Stream:
    tpot_ms: float
    tokens: int
    finish: str
    text: str


async def one_stream(client: httpx.AsyncClient, prompt: str, constrained: bool, max_tokens: int,
                     temperature: float, seed: int) -> Stream:
    body: dict = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "seed": seed,
                  "stream": True, "stream_options": {"include_usage": True}}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "directory", "schema": SCHEMA}}
    else:
        body["ignore_eos"] = True
    first = last = None
    tokens, finish, text = 0, "", []
    async with client.stream("POST", "/v1/completions", json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"{reply.status_code}: {await reply.aread()!r}")
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                if choice.get("text"):
                    last = time.perf_counter()
                    first = first or last
                    text.append(choice["text"])
                finish = choice.get("finish_reason") or finish
    if first is None or tokens < 2:
        raise RuntimeError(f"a stream produced {tokens} tokens")
    return Stream((last - first) * 1000.0 / (tokens - 1), tokens, finish, "".join(text))


async def one_round(url: str, constrained: bool, streams: int, max_tokens: int, temperature: float,
                    round_index: int) -> list[Stream]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        return await asyncio.gather(*(
            one_stream(client, PROMPTS[(round_index * streams + i) % len(PROMPTS)], constrained, max_tokens,
                       temperature, seed=round_index * 100 + i)
            for i in range(streams)))


def check_prefix(stream: Stream) -> None:
    """A constrained stream cut at max_tokens is a prefix of a match; one that stopped is a match."""
    if stream.finish == "stop":
        jsonschema.validate(json.loads(stream.text), SCHEMA)
    elif not stream.text.startswith('{"employees":['):
        raise AssertionError(f"constrained output does not follow the schema: {stream.text[:80]!r}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny random model, short streams")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.7)
    args = parser.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="structured-bench-"))
    if args.quick:
        from tests.fixtures.tiny_model import save_tiny_model
        model_dir, max_tokens, rounds = save_tiny_model(scratch / "tiny"), 24, 1
    else:
        model_dir, max_tokens, rounds = default_model_dir(default_cache_dir()), args.max_tokens, args.rounds
        if not is_prepared(model_dir):
            raise SystemExit("the default model is not prepared: run `make prepare-model`")
    # A shared machine can starve a worker's heartbeats for 10 s (the default timeout) while it loads.
    env = {"MODEL_NAME": str(model_dir), "LOG_LEVEL": "warning", "WORKER_HEARTBEAT_TIMEOUT_S": "60"}
    stack = Stack(ports=StackPorts.free(1), env=env, log_dir=scratch / "logs").start(timeout_s=600)
    results: dict[bool, list[list[Stream]]] = {False: [], True: []}
    try:
        for constrained in (False, True):   # warm-up: compiles, caches, the tokenizer's first masks
            asyncio.run(one_round(stack.url, constrained, args.streams, min(max_tokens, 16), args.temperature, 99))
        for round_index in range(rounds):
            order = (False, True) if round_index % 2 == 0 else (True, False)
            for constrained in order:
                print(f"round {round_index + 1}, {'JSON schema' if constrained else 'no constraint'}",
                      file=sys.stderr, flush=True)
                streams = asyncio.run(one_round(stack.url, constrained, args.streams, max_tokens,
                                                args.temperature, round_index))
                if constrained:
                    for stream in streams:
                        check_prefix(stream)
                results[constrained].append(streams)
    finally:
        stack.stop()
    print(render(results, args, model_dir, max_tokens))


def render(results: dict[bool, list[list[Stream]]], args: argparse.Namespace, model_dir: Path,
           max_tokens: int) -> str:
    lines = [f"{cpu_name()}, {model_dir.name}, {args.streams} concurrent streams of {max_tokens} tokens, "
             f"temperature {args.temperature}", "",
             "| round | TPOT ms, no constraint | TPOT ms, JSON schema | ratio |", "|---|---:|---:|---:|"]
    for index, (plain, constrained) in enumerate(zip(results[False], results[True])):
        a = statistics.median(s.tpot_ms for s in plain)
        b = statistics.median(s.tpot_ms for s in constrained)
        lines.append(f"| {index + 1} | {a:.1f} | {b:.1f} | {b / a:.3f} |")
    a = statistics.median(s.tpot_ms for run in results[False] for s in run)
    b = statistics.median(s.tpot_ms for run in results[True] for s in run)
    lines.append(f"| all | {a:.1f} | {b:.1f} | **{b / a:.3f}** |")
    tokens = [s.tokens for run in results[True] for s in run]
    lines.append("")
    lines.append(f"constrained streams: {min(tokens)}-{max(tokens)} tokens, finish reasons "
                 f"{sorted({s.finish for run in results[True] for s in run})}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
