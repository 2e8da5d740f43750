"""Weight codes at their native width against 8-bit codes, two engines in one process.

    python -m benchmarks.code_width_bench              # default model, ~2 min
    python -m benchmarks.code_width_bench --rounds 5 --steps 64

Builds the engine twice on the same checkpoint, CPU_WEIGHT_CODES=narrow (codes in the fewest
of 4-6 bits that hold them) and =8bit (a byte a code), and prints a markdown table: how
many linears each width serves, the codes' resident bytes, decode tokens/s at batch 1 and 8
(the median of the rounds, the two engines alternating, so a machine whose speed drifts
moves both alike), whether both engines decode the same greedy tokens, and what `auto`'s
calibration picks on this CPU.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
from collections import Counter

import torch

from benchmarks.engine_bench import EngineRunner, _model_dir, make_prompts
from benchmarks.machine import cpu_name
from services.worker.engine.engine import Engine
from services.worker.engine.config import EngineConfig
from common.step import NewSequence, StepBatch, WorkItem
from services.worker.engine.cpu.kernels.native_build import default_cache_dir
from services.worker.engine.cpu.linear.narrow_calibration import time_widths
from services.worker.engine.cpu.linear.weight_codes import load_coded_linear
from services.worker.wiring import build_engine

MODES = ("narrow", "8bit")


def _coded(engine: Engine) -> list:
    return [module for module in engine.model.modules() if getattr(module, "coded", None) is not None]


def _widths(engine: Engine) -> str:
    counts = Counter(linear.coded.bits for linear in _coded(engine))
    return ", ".join(f"{count} × {bits}-bit" for bits, count in sorted(counts.items()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default="", help="default: the prepared default model")
    parser.add_argument("--rounds", type=int, default=3, help="measurements per engine, alternating")
    parser.add_argument("--steps", type=int, default=32, help="decode steps a measurement")
    parser.add_argument("--batches", default="1,8", help="decode batch sizes, comma-separated")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    model_dir = _model_dir(args)
    engines = {mode: build_engine(EngineConfig(model_dir=model_dir, model_key=os.path.basename(model_dir),
                                               cpu_weight_codes=mode))
               for mode in MODES}
    for engine in engines.values():
        engine.wait_for_screen()
    runners = {mode: EngineRunner(engine, 512) for mode, engine in engines.items()}
    vocab = engines["narrow"].info.vocab_size
    batches = [int(b) for b in args.batches.split(",")]
    rates: dict[tuple[str, int], list[float]] = {}
    for index in range(args.rounds + 1):           # round 0 warms up
        for batch in batches:
            prompts = make_prompts(batch, 64, vocab, seed=100 * index + batch)
            for mode in MODES:
                rate = runners[mode].decode_tokens_per_s(prompts, args.steps)
                if index:
                    rates.setdefault((mode, batch), []).append(rate)
    prompts = make_prompts(4, 32, vocab, seed=7)
    same = _tokens(engines["narrow"], prompts) == _tokens(engines["8bit"], prompts)
    picks = _calibration(engines)
    print(f"Code widths: {model_dir}, {cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {args.steps} decode steps, median of {args.rounds} rounds "
          f"alternating; same greedy tokens: {'yes' if same else 'NO'}; auto's calibration: {picks}.\n")
    print("| CPU_WEIGHT_CODES | linears | codes MB | " + " | ".join(f"decode tok/s @ {b}" for b in batches) + " |")
    print("|---|---|---|" + "---|" * len(batches))
    for mode, engine in engines.items():
        megabytes = sum(linear.coded.nbytes for linear in _coded(engine)) / 1e6
        cells = " | ".join(f"{statistics.median(rates[(mode, b)]):.1f}" for b in batches)
        print(f"| {mode} | {_widths(engine)} | {megabytes:.0f} | {cells} |")


def _calibration(engines: dict[str, Engine]) -> str:
    """What `auto`'s start-up calibration (narrow_calibration.py) finds on the two engines' codes."""
    kernel = load_coded_linear(default_cache_dir())
    wide = [linear.coded for linear in _coded(engines["8bit"])]
    narrow = [linear.coded for linear in _coded(engines["narrow"])]
    if kernel is None or len(wide) != len(narrow):
        return "not run"
    try:
        timings = time_widths(kernel, wide, narrow)
    except ValueError:
        return "nothing narrower to time, picks 8-bit codes"
    return f"{timings.describe()}, picks {'narrow' if timings.keeps_narrow else '8-bit'} codes"


def _tokens(engine: Engine, prompts: list[list[int]], new_tokens: int = 24) -> list[list[int]]:
    """Greedy tokens of each prompt, decoded together."""
    ids = [f"greedy{i}" for i in range(len(prompts))]
    out = engine.step(StepBatch(new_sequences=[NewSequence(i, p) for i, p in zip(ids, prompts)],
                                work=[WorkItem(i, len(p)) for i, p in zip(ids, prompts)]))
    tokens = {i: [] for i in ids}
    for _ in range(new_tokens):
        for result in out.results:
            tokens[result.seq_id].extend(result.token_ids)
        out = engine.step(StepBatch(work=[WorkItem(i, 1) for i in ids]))
    engine.step(StepBatch(free_seq_ids=ids))
    return [tokens[i] for i in ids]


if __name__ == "__main__":
    main()
