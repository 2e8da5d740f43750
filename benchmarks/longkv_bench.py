"""Long sequences in bounded memory: what each KV policy costs in quality, and what it
saves in memory and decode time.

Quality: the perplexity of one long text (the Python standard library's documentation as
pydoc renders it, a fixed list of modules: deterministic for a Python version, at least
16k tokens) scored in a streaming fashion: the engine prefills it in chunks of --chunk
tokens with prompt logprobs, so each token is scored with what the policy left in the
cache, under full, window, sink and h2o at budgets 256, 512 and 1024 tokens. The
StreamingLLM paper (Xiao et al., 2023) finds that window-only attention's perplexity jumps
once the first tokens leave the cache, while keeping a few sink tokens stays close to full.

Speed and memory: a sequence of --context tokens, then --new-tokens greedy decodes, full
against sink (budget 1024), under the hybrid layout (the sliding layers' K/V for about one
window, sliding_blocks.py) and with one cache for every layer (KV_CACHE_HYBRID=false): KV
bytes the sequence holds at the end and decode tokens/s.

    python -m benchmarks.longkv_bench            # default model: long (a forward per token per policy)
    python -m benchmarks.longkv_bench --quick    # tiny random model: checks the script
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import pydoc
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.machine import cpu_name
from common.model_store import default_cache_dir, default_model_dir, is_prepared
from common.step import KvPolicy, NewSequence, StepBatch, WorkItem
from common.types import SamplingParams
from services.worker.engine.engine import Engine
from services.worker.engine.config import EngineConfig
from services.worker.engine.kv.kv_cache import SLIDING_GROUP, PagedKVCache
from services.worker.wiring import build_engine

MODULES = ("collections", "itertools", "functools", "textwrap", "string", "json", "csv", "argparse",
           "logging", "pathlib", "shutil", "tempfile", "datetime", "calendar", "decimal", "fractions",
           "statistics", "random", "heapq", "bisect", "difflib", "unittest", "doctest", "pdb",
           "subprocess", "threading", "queue", "socket", "http.client", "email.message")
POLICIES = ("window", "sink", "h2o")
BUDGETS = (256, 512, 1024)
SINK_TOKENS = 4


def long_text(tokenizer, min_tokens: int) -> list[int]:
    """Token ids of the modules' documentation, in order, until there are min_tokens."""
    parts: list[str] = []
    ids: list[int] = []
    for name in MODULES:
        parts.append(pydoc.plain(pydoc.render_doc(name, renderer=pydoc.plaintext)))
        ids = tokenizer("\n\n".join(parts))
        if len(ids) >= min_tokens:
            return ids[:min_tokens]
    raise SystemExit(f"the documentation of {len(MODULES)} modules makes only {len(ids)} tokens")


@dataclass
class Scored:
    policy: str
    budget: int
    perplexity: float
    most_blocks: int
    seconds: float


def score(engine: Engine, ids: list[int], policy: KvPolicy, chunk: int, tag: str) -> Scored:
    """Perplexity of `ids` scored chunk by chunk under `policy`."""
    params = SamplingParams(prompt_logprobs=True)
    new = [NewSequence(tag, tuple(ids), (), params, kv_policy=policy)]
    logprobs: dict[int, float] = {}
    most_blocks = 0
    started = time.perf_counter()
    while True:
        out = engine.step(StepBatch(new_sequences=new, work=[WorkItem(tag, chunk)]))
        new = []
        (result,) = out.results
        if result.error:
            raise SystemExit(f"{policy}: the engine failed the sequence: {result.error}")
        for offset, logprob in enumerate(result.prompt_logprobs):
            logprobs[result.prompt_logprobs_start + offset] = logprob.logprob
        most_blocks = max(most_blocks, len(engine.pool.table(tag)))
        if result.sampled:
            break
    seconds = time.perf_counter() - started
    engine.step(StepBatch(free_seq_ids=[tag]))
    assert len(logprobs) == len(ids) - 1
    return Scored(policy.kind, policy.budget_tokens, math.exp(-sum(logprobs.values()) / len(logprobs)),
                  most_blocks, seconds)


def decode(engine: Engine, ids: list[int], policy: KvPolicy, new_tokens: int, tag: str) -> tuple[float, int]:
    """(decode tokens/s, KV bytes held at the end) for one sequence of `ids` then `new_tokens` decodes."""
    new = [NewSequence(tag, tuple(ids), (), SamplingParams(), kv_policy=policy)]
    while True:
        (result,) = engine.step(StepBatch(new_sequences=new, work=[WorkItem(tag, 512)])).results
        new = []
        if result.sampled:
            break
    started = time.perf_counter()
    for _ in range(new_tokens - 1):
        (result,) = engine.step(StepBatch(work=[WorkItem(tag, 1)])).results
        assert result.sampled and not result.error, result
    rate = (new_tokens - 1) / (time.perf_counter() - started)
    held = sequence_kv_bytes(engine, tag)
    engine.step(StepBatch(free_seq_ids=[tag]))
    return rate, held


def sequence_kv_bytes(engine: Engine, tag: str) -> int:
    """K/V bytes sequence `tag` holds: its pool blocks in the full group's layers, and the
    sliding blocks its window pins in the sliding group's (every layer's without one)."""
    specs, size = _specs(engine), engine.block_size
    full = [group != SLIDING_GROUP for group in engine.kv.group]
    held = len(engine.pool.table(tag)) * PagedKVCache.bytes_per_block(specs, size, engine.dtype, full)
    if engine.sliding is not None:
        held += len(engine.sliding.pinned(tag)) * PagedKVCache.bytes_per_block(
            specs, size, engine.dtype, [not f for f in full])
    return held


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny random model, short text")
    parser.add_argument("--tokens", type=int, default=16384, help="length of the scored text")
    parser.add_argument("--chunk", type=int, default=32, help="tokens per prefill chunk while scoring")
    parser.add_argument("--context", type=int, default=8192, help="context of the decode measurement")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--budgets", default=",".join(map(str, BUDGETS)), help="lossy policies' budgets, tokens")
    parser.add_argument("--out", default=".cache/bench-longkv", help="where results.json goes")
    parser.add_argument("--decode-only", action="store_true", help="skip the perplexity runs")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    budgets, block_size = tuple(int(b) for b in args.budgets.split(",")), 16
    if args.quick:
        args.tokens, args.context, args.new_tokens, budgets, block_size = 600, 300, 8, (64, 128), 4
    engine, tokenizer, model_name = _engine(args, block_size)
    ids = long_text(tokenizer, max(args.tokens, args.context))
    rows = [] if args.decode_only else [_progress(score(engine, ids[:args.tokens], KvPolicy(), 512, "full"))]
    for budget in sorted(budgets, reverse=True) if rows else ():
        for kind in POLICIES:
            rows.append(_progress(score(engine, ids[:args.tokens], KvPolicy(kind, budget, SINK_TOKENS), args.chunk,
                                        f"{kind}{budget}")))
    speed = {}
    for kind in ("full", "sink"):
        policy = KvPolicy(kind, max(budgets), SINK_TOKENS)
        speed[kind] = decode(engine, ids[:args.context], policy, args.new_tokens, f"d{kind}")
    del engine
    flat, _, _ = _engine(args, block_size, hybrid=False)
    speed["full, one cache"] = decode(flat, ids[:args.context], KvPolicy(), args.new_tokens, "dflat")
    _report(args, model_name, args.tokens, rows, speed, budgets)


def _progress(row: Scored) -> Scored:
    print(f"scored: {row}", flush=True)
    return row


def _specs(engine: Engine):
    return [None if keys is None else type("Spec", (), {"num_kv_heads": keys.shape[1], "head_dim": keys.shape[2]})
            for keys in engine.kv.keys]


def _engine(args, block_size: int, hybrid: bool = True):
    blocks = -(-max(args.tokens, args.context) // block_size) + 64
    config = dict(num_blocks=blocks, block_size=block_size, enable_prefix_caching=False,
                  max_model_len=max(args.tokens, args.context) + 128, kv_hybrid=hybrid)
    if args.quick:
        from tests.fixtures.tiny_model import build_model, gemma3_config

        engine = build_engine(EngineConfig(model_dir="", model_key="tiny", **config),
                              model=build_model(gemma3_config()))
        return engine, (lambda text: [2] + [10 + ord(c) % 300 for c in text]), "tiny random model"
    path = default_model_dir(default_cache_dir())
    if not is_prepared(path):
        raise SystemExit("default model not prepared: run `make prepare-model` first")
    from transformers import AutoTokenizer

    engine = build_engine(EngineConfig(model_dir=str(path), model_key=path.name, **config))
    hf = AutoTokenizer.from_pretrained(path)
    return engine, (lambda text: hf(text)["input_ids"]), path.name


def _report(args, model_name: str, length: int, rows: list[Scored], speed: dict, budgets) -> None:
    full = rows[0].perplexity if rows else 0.0
    print(f"Long-context KV policies: {model_name}, {cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"Python {platform.python_version()} documentation ({length} tokens), scored in chunks of {args.chunk} "
          f"(full: 512), sink = first {SINK_TOKENS} tokens rounded up to a block.")
    print()
    print(f"{torch.get_num_threads()} torch threads.")
    if rows:
        print("| policy | budget (tokens) | perplexity | vs full | most KV blocks held | seconds |")
        print("|---|---:|---:|---:|---:|---:|")
    for row in rows:
        budget = "-" if row.policy == "full" else str(row.budget)
        print(f"| {row.policy} | {budget} | {row.perplexity:.3f} | {row.perplexity / full - 1:+.1%} | "
              f"{row.most_blocks} | {row.seconds:.0f} |")
    print()
    print(f"| {args.context}-token context, then {args.new_tokens} decodes | KV MiB per sequence | decode tok/s |")
    print("|---|---:|---:|")
    for kind, (rate, kv_bytes) in speed.items():
        label = f"sink, budget {max(budgets)}" if kind == "sink" else kind
        print(f"| {label} | {kv_bytes / 2**20:.1f} | {rate:.1f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({
        "model": model_name, "tokens": length, "chunk": args.chunk,
        "perplexity": [row.__dict__ for row in rows],
        "decode": {kind: {"tok_s": rate, "kv_bytes": kv} for kind, (rate, kv) in speed.items()}}, indent=2))


if __name__ == "__main__":
    main()
