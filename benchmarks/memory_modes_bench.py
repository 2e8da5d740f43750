"""The engine's memory settings: speed and resident memory of three engines.

    python -m benchmarks.memory_modes_bench              # default model, ~4 min
    python -m benchmarks.memory_modes_bench --rounds 5

Three engines of the same checkpoint:
- default: the coded layers' wide steps (prefill chunks) expand their codes into oneDNN's pack
  layout where it is learned (CPU_PREFILL_WEIGHTS=auto), the LM head screen multiplies the
  head's own codes (LM_HEAD_SCREEN_WEIGHTS=auto), the grammar tokenizer waits for a first
  constrained request (GRAMMAR_TOKENIZER=first_use);
- copies: every coded layer keeps a float32 pack for its wide steps, the screen an int8 copy
  of the head, the grammar tokenizer built at start (the defaults before 2026-12-02);
- lean: the default with CPU_WEIGHT_CODES=narrow (codes at the checkpoint's 4-6 bits) and
  LM_HEAD_SCREEN=off (every LM head row from its codes).
Speed: the engines in one process, prefill chunks (8 prompts at a 512-token budget) and
decode steps at batch 1 and 8 alternating between them, medians of the rounds, and whether
all decode the same greedy tokens. Memory: each engine (64-block KV pool, screen built, the
grammar tokenizer where it builds at start) in a fresh process of its own, its VmRSS.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys

import torch

from benchmarks.code_width_bench import _tokens
from benchmarks.engine_bench import EngineRunner, _model_dir, make_prompts
from benchmarks.machine import cpu_name
from benchmarks.memory import resident_mb
from services.worker.engine.engine import Engine
from services.worker.engine.config import EngineConfig
from services.worker.wiring import build_engine

MODES = {
    "default": {},
    "copies (packs, int8 screen, grammar at start)": {"cpu_prefill_weights": "packs",
                                                      "lm_head_screen_weights": "copy",
                                                      "grammar_tokenizer": "start"},
    "lean (+ narrow codes, no screen)": {"cpu_weight_codes": "narrow", "lm_head_screen": "off"},
}


def _config(model_dir: str, mode: str, **extra: int) -> EngineConfig:
    return EngineConfig(model_dir=model_dir, model_key=os.path.basename(model_dir), **MODES[mode], **extra)


def resident_of_fresh_engine(model_dir: str, mode: str) -> float:
    """VmRSS (MB) of a fresh process holding one engine of `mode` with a 64-block pool."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.memory_modes_bench", "--model-dir", model_dir,
                          "--resident-of", mode], check=True, capture_output=True, text=True).stdout
    return float(json.loads(out.strip().splitlines()[-1])["resident_mb"])


def _print_resident(model_dir: str, mode: str) -> None:
    engine = build_engine(_config(model_dir, mode, num_blocks=64))
    engine.wait_for_screen()
    if engine.grammars.tokenizer.started:
        engine.grammars.tokenizer.wait()
    print(json.dumps({"resident_mb": resident_mb()}))


def _measure(engines: dict[str, Engine], rounds: int, prompt_len: int, steps: int) -> dict[tuple[str, str], float]:
    runners = {mode: EngineRunner(engine, 512) for mode, engine in engines.items()}
    vocab = next(iter(engines.values())).info.vocab_size
    rates: dict[tuple[str, str], list[float]] = {}
    for index in range(rounds + 1):           # round 0 warms up
        prompts = make_prompts(8, prompt_len, vocab, seed=100 + index)
        order = list(engines) if index % 2 == 0 else list(engines)[::-1]
        for mode in order:
            got = {"prefill": runners[mode].prefill_tokens_per_s(prompts)}
            for batch in (1, 8):
                got[f"decode @ {batch}"] = runners[mode].decode_tokens_per_s(
                    make_prompts(batch, 64, vocab, seed=200 + index), steps)
            if index:
                for what, rate in got.items():
                    rates.setdefault((mode, what), []).append(rate)
    return {key: statistics.median(values) for key, values in rates.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default="", help="default: the prepared default model")
    parser.add_argument("--rounds", type=int, default=3, help="measurements per engine, alternating")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=16, help="decode steps a measurement")
    parser.add_argument("--resident-of", choices=tuple(MODES), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    model_dir = _model_dir(args)
    if args.resident_of:
        _print_resident(model_dir, args.resident_of)
        return
    engines = {mode: build_engine(_config(model_dir, mode)) for mode in MODES}
    for engine in engines.values():
        engine.wait_for_screen()
    rates = _measure(engines, args.rounds, args.prompt_len, args.steps)
    prompts = make_prompts(4, 96, engines["default"].info.vocab_size, seed=7)
    tokens = [_tokens(engine, prompts) for engine in engines.values()]
    same = all(t == tokens[0] for t in tokens)
    dropped = {mode: engine.prepared.speedups.dropped_bytes / 1e6 for mode, engine in engines.items()}
    del engines
    resident = {mode: resident_of_fresh_engine(model_dir, mode) for mode in MODES}
    print(f"Memory modes: {model_dir}, {cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, prefill 8 x {args.prompt_len}-token prompts at a 512-token "
          f"budget, {args.steps} decode steps, median of {args.rounds} rounds alternating; same greedy "
          f"tokens: {'yes' if same else 'NO'}.\n")
    print("| engine | prefill tok/s | decode tok/s @ 1 | decode tok/s @ 8 | weight copies dropped MB "
          "| resident MB (64 blocks) |")
    print("|---|---:|---:|---:|---:|---:|")
    for mode in MODES:
        print(f"| {mode} | {rates[(mode, 'prefill')]:.1f} | {rates[(mode, 'decode @ 1')]:.1f} "
              f"| {rates[(mode, 'decode @ 8')]:.1f} | {dropped[mode]:.0f} | {resident[mode]:,.0f} |")


if __name__ == "__main__":
    main()
