"""Engine benchmark on the default model, in-process, against transformers.

    python -m benchmarks.engine_bench            # full run (minutes; `make bench-engine`)
    python -m benchmarks.engine_bench --quick    # small sizes, checks the script end to end

Measures the engine's prefill tokens/s, decode tokens/s at several batch sizes
and end-to-end output tokens/s for N concurrent prompts driven the way the
scheduler drives a worker (decodes first, then prefill chunks under a token
budget), and in the same run transformers' sequential `generate` and its
continuous batching (`generate_batch`). Prints a markdown table.

With `--rounds N` the end-to-end runs and the transformers baselines are measured
N times, alternating (engine, generate, generate_batch, then again, each round on
prompts of its own), and the table shows the medians: a machine whose speed drifts
over minutes then moves both sides of a ratio alike.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from benchmarks.machine import cpu_name
from benchmarks.memory import resident_mb
from common.model_store import default_cache_dir, default_model_dir, is_prepared
from services.worker.engine.engine import Engine
from services.worker.engine.config import EngineConfig
from common.step import NewSequence, StepBatch, WorkItem
from services.worker.wiring import build_engine

BOS = 2


@dataclass(frozen=True)
class BenchSizes:
    prompt_len: int
    new_tokens: int
    concurrency: tuple[int, ...]
    decode_batches: tuple[int, ...]
    decode_steps: int
    prefill_prompts: int
    token_budget: int
    generate_prompts: int


FULL = BenchSizes(prompt_len=256, new_tokens=64, concurrency=(8, 32), decode_batches=(1, 8, 32),
                  decode_steps=32, prefill_prompts=8, token_budget=512, generate_prompts=8)
QUICK = BenchSizes(prompt_len=32, new_tokens=8, concurrency=(2, 4), decode_batches=(1, 4),
                   decode_steps=4, prefill_prompts=2, token_budget=64, generate_prompts=2)


def make_prompts(count: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    # Ordinary vocabulary ids (well past the special tokens), distinct per prompt.
    low = min(1000, vocab_size // 2)      # a tiny test vocabulary has no id 1000
    body = torch.randint(low, min(vocab_size, 200_000), (count, length - 1), generator=generator)
    return [[BOS] + row for row in body.tolist()]


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


# ---- engine ----------------------------------------------------------------------------------


class EngineRunner:
    def __init__(self, engine: Engine, token_budget: int, draft_tokens: int = 0) -> None:
        self.engine = engine
        self.token_budget = token_budget
        self.draft_tokens = draft_tokens     # n-gram speculative tokens each decode may verify
        self._next_id = 0

    def _ids(self, count: int) -> list[str]:
        ids = [f"r{self._next_id + i}" for i in range(count)]
        self._next_id += count
        return ids

    def prefill_tokens_per_s(self, prompts: list[list[int]]) -> float:
        seq_ids = self._ids(len(prompts))
        seconds, _ = timed(lambda: self._serve(seq_ids, prompts, new_tokens=1))
        self.engine.step(StepBatch(free_seq_ids=seq_ids))
        return sum(len(p) for p in prompts) / seconds

    def decode_tokens_per_s(self, prompts: list[list[int]], steps: int) -> float:
        seq_ids = self._ids(len(prompts))
        self._serve(seq_ids, prompts, new_tokens=1, free=False)
        work = StepBatch(work=[WorkItem(seq_id, 1, self.draft_tokens) for seq_id in seq_ids])
        seconds, outputs = timed(lambda: [self.engine.step(work) for _ in range(steps)])
        self.engine.step(StepBatch(free_seq_ids=seq_ids))
        return sum(len(r.token_ids) for out in outputs for r in out.results) / seconds

    def end_to_end_tokens_per_s(self, prompts: list[list[int]], new_tokens: int) -> float:
        seq_ids = self._ids(len(prompts))
        seconds, produced = timed(lambda: self._serve(seq_ids, prompts, new_tokens))
        return produced / seconds

    def _serve(self, seq_ids: list[str], prompts: list[list[int]], new_tokens: int, free: bool = True) -> int:
        """Scheduler-like loop: every running decode each step, then prefill chunks in
        arrival order until the token budget is spent."""
        remaining_prompt = dict(zip(seq_ids, (len(p) for p in prompts)))
        produced = dict.fromkeys(seq_ids, 0)
        new = [NewSequence(seq_id, prompt) for seq_id, prompt in zip(seq_ids, prompts)]
        while any(count < new_tokens for count in produced.values()):
            budget = self.token_budget
            work: list[WorkItem] = []
            for seq_id in seq_ids:
                if remaining_prompt[seq_id] == 0 and produced[seq_id] < new_tokens:
                    drafts = max(0, min(self.draft_tokens, new_tokens - produced[seq_id] - 1, budget - 1))
                    work.append(WorkItem(seq_id, 1, drafts))
                    budget -= 1 + drafts
            for seq_id in seq_ids:
                if budget <= 0:
                    break
                if remaining_prompt[seq_id] > 0:
                    chunk = min(budget, remaining_prompt[seq_id])
                    work.append(WorkItem(seq_id, chunk))
                    budget -= chunk
            out = self.engine.step(StepBatch(new_sequences=new, work=work))
            new = []
            for result in out.results:
                if result.error:
                    raise RuntimeError(f"engine step failed: {result}")
                if remaining_prompt[result.seq_id] > 0:
                    prompt_len = len(prompts[seq_ids.index(result.seq_id)])
                    remaining_prompt[result.seq_id] = max(0, prompt_len - result.num_computed_tokens)
                if result.sampled:
                    produced[result.seq_id] = min(new_tokens, produced[result.seq_id] + len(result.token_ids))
        if free:
            self.engine.step(StepBatch(free_seq_ids=seq_ids))
        return sum(produced.values())


# ---- transformers -----------------------------------------------------------------------------


def generate_tokens_per_s(model, prompts: list[list[int]], new_tokens: int) -> float:
    produced = 0
    started = time.perf_counter()
    for prompt in prompts:
        input_ids = torch.tensor([prompt])
        with torch.inference_mode():
            output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                    max_new_tokens=new_tokens, do_sample=False)
        produced += output.shape[1] - len(prompt)
    return produced / (time.perf_counter() - started)


def generate_decode_tokens_per_s(model, prompt: list[int], steps: int) -> float:
    """Decode rate of `generate` at batch 1: (time for 1 + steps tokens) - (time for 1 token)."""
    input_ids = torch.tensor([prompt])
    mask = torch.ones_like(input_ids)

    def run(count: int) -> int:
        with torch.inference_mode():
            output = model.generate(input_ids, attention_mask=mask, max_new_tokens=count, do_sample=False,
                                    min_new_tokens=count)
        return output.shape[1] - len(prompt)

    first, _ = timed(lambda: run(1))
    total, produced = timed(lambda: run(1 + steps))
    return (produced - 1) / max(total - first, 1e-9)


def generate_batch_tokens_per_s(model, prompts: list[list[int]], new_tokens: int, token_budget: int) -> float:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    page = 256
    pages_per_request = math.ceil((len(prompts[0]) + new_tokens) / page)
    # The cache is sized by num_blocks; the memory share only caps it, and transformers takes it of
    # the NUMA node's memory less this process's (the engine's included), which on a small VM can
    # fall below what it needs at its CPU default of 0.6.
    cb_config = ContinuousBatchingConfig(num_blocks=pages_per_request * len(prompts) + 4,
                                         max_batch_tokens=token_budget, max_memory_percent=0.9)
    gen_config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False,
                                  eos_token_id=model.generation_config.eos_token_id,
                                  pad_token_id=model.generation_config.pad_token_id)
    seconds, results = timed(lambda: model.generate_batch(inputs=prompts, generation_config=gen_config,
                                                          continuous_batching_config=cb_config,
                                                          max_new_tokens=new_tokens))
    produced = sum(len(result.generated_tokens) for result in results.values())
    if len(results) != len(prompts):
        raise RuntimeError(f"generate_batch returned {len(results)} of {len(prompts)} results")
    return produced / seconds


# ---- rounds -----------------------------------------------------------------------------------


@dataclass
class Round:
    engine: dict[int, float]                # concurrency -> end-to-end output tokens/s
    generate_decode: float | None = None
    generate: float | None = None
    generate_batch: dict[int, float | None] = field(default_factory=dict)


def _round(runner: EngineRunner, reference, sizes: BenchSizes, fresh: Callable[[int, int], list[list[int]]],
           index: int) -> Round:
    """One round: the engine's end-to-end runs, then transformers' on the same prompts
    (prompts of this round's own, so nothing an earlier round computed is cached)."""
    prompts = {n: fresh(n, 100 + n + 1000 * index) for n in sizes.concurrency}
    result = Round(engine={n: runner.end_to_end_tokens_per_s(prompts[n], sizes.new_tokens)
                           for n in sizes.concurrency},
                   generate_batch=dict.fromkeys(sizes.concurrency))
    if reference is None:
        return result
    result.generate_decode = generate_decode_tokens_per_s(reference, fresh(1, 11 + 1000 * index)[0],
                                                          sizes.decode_steps)
    result.generate = generate_tokens_per_s(reference, prompts[min(sizes.concurrency)][:sizes.generate_prompts],
                                            sizes.new_tokens)
    for n in sizes.concurrency:
        result.generate_batch[n] = generate_batch_tokens_per_s(reference, prompts[n], sizes.new_tokens,
                                                               sizes.token_budget)
    return result


def _median(values: list[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return statistics.median(present) if present else None


# ---- report -----------------------------------------------------------------------------------


def _fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:,.1f}"


def _ratio(ours: float | None, theirs: float | None) -> str:
    return "—" if not ours or not theirs else f"{ours / theirs:.1f}×"


Row = tuple[str, float | None, float | None, float | None]   # metric, engine, generate, generate_batch


def render(rows: list[Row], header: str) -> str:
    lines = [header, "",
             "| metric | engine | transformers generate | transformers generate_batch | vs generate | vs generate_batch |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, ours, generate, batch in rows:
        lines.append(f"| {name} | {_fmt(ours)} | {_fmt(generate)} | {_fmt(batch)} | "
                     f"{_ratio(ours, generate)} | {_ratio(ours, batch)} |")
    return "\n".join(lines)


def render_rounds(rounds: list[Round], concurrency: tuple[int, ...]) -> str:
    """Each round's end-to-end rates and ratios, in the order they ran."""
    header = "| round | " + " | ".join(f"{n} concurrent: engine / generate / generate_batch, ratios"
                                        for n in concurrency) + " |"
    lines = ["Per round:", "", header, "|---|" + "---:|" * len(concurrency)]
    for index, result in enumerate(rounds, 1):
        cells = [f"{_fmt(result.engine[n])} / {_fmt(result.generate)} / {_fmt(result.generate_batch[n])}, "
                 f"{_ratio(result.engine[n], result.generate)} / {_ratio(result.engine[n], result.generate_batch[n])}"
                 for n in concurrency]
        lines.append(f"| {index} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes: checks the script, not the speed")
    parser.add_argument("--model-dir", default="", help="default: the prepared default model")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--skip-transformers", action="store_true", help="engine numbers only")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="weights and activations, for the engine and transformers alike")
    parser.add_argument("--linear-kernel", default="auto", choices=("auto", "mkl", "onednn"),
                        help="the engine's packed CPU kernel (CPU_LINEAR_KERNEL)")
    parser.add_argument("--lm-head-screen", default="auto", choices=("auto", "on", "off"),
                        help="the engine's int8 LM head screen for greedy rows (LM_HEAD_SCREEN)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="end-to-end and transformers measurements, alternating; the table shows medians")
    parser.add_argument("--num-blocks", type=int, default=0,
                        help="KV pool blocks (0: the engine's default size)")
    parser.add_argument("--speculative-tokens", type=int, default=0,
                        help="n-gram draft tokens each engine decode may verify (SPECULATIVE_TOKENS)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    return args


def _model_dir(args: argparse.Namespace) -> str:
    if args.model_dir:
        return args.model_dir
    if not is_prepared(default_model_dir(default_cache_dir())):
        raise SystemExit("default model not prepared: run `make prepare-model` first")
    return str(default_model_dir(default_cache_dir()))


def _engine_only_rows(runner: EngineRunner, engine: Engine, sizes: BenchSizes,
                      fresh: Callable[[int, int], list[list[int]]]) -> tuple[list[Row], dict[int, float]]:
    """Prefill, decode per batch, and the engine's own resident memory (measured before
    transformers' reference model joins it in this process)."""
    rows: list[Row] = [(f"prefill tokens/s ({sizes.prefill_prompts}×{sizes.prompt_len}, "
                        f"budget {sizes.token_budget})",
                        runner.prefill_tokens_per_s(fresh(sizes.prefill_prompts, 1)), None, None)]
    decode_rates = {batch: runner.decode_tokens_per_s(fresh(batch, 10 + batch), sizes.decode_steps)
                    for batch in sizes.decode_batches}
    rows.append((f"engine process resident MB ({engine.pool_stats().total_blocks}-block KV pool, "
                 "before the reference loads)", resident_mb(), None, None))
    return rows, decode_rates


def _header(args: argparse.Namespace, model_dir: str, engine: Engine, sizes: BenchSizes, e2e_hit_tokens: int) -> str:
    linear_kernel = engine.linear_kernel.kernel if engine.linear_kernel is not None else "plain"
    screened = "on" if engine.lm_head_screened else "off"
    packs = f" (prefill packs: {engine.prefill_linear_kernel})" if engine.prefill_linear_kernel else ""
    return (f"Engine benchmark ({'quick' if args.quick else 'full'}): {model_dir}, "
            f"{cpu_name()}, {os.cpu_count()} CPUs, "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, "
            f"engine linear kernel {linear_kernel}, weight codes on {engine.coded_linears} linears{packs}, "
            f"LM head screen {screened}, forward {engine.direct_forward}, "
            f"speculative tokens {args.speculative_tokens}. "
            f"Sequential generate runs {sizes.generate_prompts} prompts one after another. "
            f"End-to-end rows: median of {args.rounds} round(s), engine and transformers alternating. "
            f"Prompt tokens the end-to-end runs took from the prefix cache: {e2e_hit_tokens}.")


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    sizes = QUICK if args.quick else FULL
    model_dir = _model_dir(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = build_engine(EngineConfig(model_dir=model_dir, model_key=os.path.basename(model_dir), dtype=args.dtype,
                                       cpu_linear_kernel=args.linear_kernel, lm_head_screen=args.lm_head_screen,
                                       num_blocks=args.num_blocks))
    engine.wait_for_screen()       # `auto` builds it in the background; measure the steady state
    runner = EngineRunner(engine, sizes.token_budget, args.speculative_tokens)
    vocab = engine.info.vocab_size

    # Every measurement gets prompts of its own: with prefix caching on, prompts an
    # earlier phase computed would skip their prefill, which transformers cannot do.
    def fresh(count: int, seed: int) -> list[list[int]]:
        return make_prompts(count, sizes.prompt_len, vocab, seed=seed)

    runner.end_to_end_tokens_per_s(fresh(1, 99), 2)   # warm-up
    rows, decode_rates = _engine_only_rows(runner, engine, sizes, fresh)
    reference = None
    if not args.skip_transformers:
        from transformers import AutoModelForCausalLM

        reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).eval()
    hits_before = engine.pool_stats().prefix_hit_tokens
    rounds = [_round(runner, reference, sizes, fresh, index) for index in range(args.rounds)]
    e2e_hit_tokens = engine.pool_stats().prefix_hit_tokens - hits_before

    generate_decode = _median([r.generate_decode for r in rounds])
    generate_rate = _median([r.generate for r in rounds])
    for batch, rate in decode_rates.items():
        rows.append((f"decode tokens/s, batch {batch}", rate, generate_decode if batch == 1 else None, None))
    for n in sizes.concurrency:
        rows.append((f"end-to-end output tokens/s, {n} concurrent × {sizes.prompt_len}-token prompts, "
                     f"{sizes.new_tokens} new", _median([r.engine[n] for r in rounds]), generate_rate,
                     _median([r.generate_batch[n] for r in rounds])))
    print(render(rows, _header(args, model_dir, engine, sizes, e2e_hit_tokens)))
    if args.rounds > 1 and reference is not None:
        print()
        print(render_rounds(rounds, sizes.concurrency))

if __name__ == "__main__":
    main()
