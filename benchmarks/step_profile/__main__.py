"""Where a concurrency-32 W1 step's time goes: the engine run in-process on the default
model the way the scheduler drives a worker (every running decode each step, then
prefill chunks in arrival order under the step's token budget, MAX_BATCH_TOKENS'
default 2048), on W1's prompts (the serving benchmark's: ~274 tokens each, each
starting differently; 64 new tokens, greedy), with timers around the engine's parts
(instrument.py: each category's exclusive wall time, so a step's categories add up
to its wall time).

    python -m benchmarks.step_profile            # make bench-profile (~2 min)
    python -m benchmarks.step_profile --quick    # tiny model: checks the script
    python -m benchmarks.step_profile --served   # also the worker's wait between steps in a served run

Two passes over fresh prompts: the first as served (decode-only steps' layers in one
C call), the second with decode-only steps on the Python path, where every piece is
timed (the C call runs the same kernels in the same order). After each step, outside
its timers, one layer's GEMMs alone through oneDNN in float32 at the step's rows
(gemm_peak.py): the kernel's rate at the same moments, the steps' GEMMs' reference.
"""

from __future__ import annotations

import argparse
import copy
import gc
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.engine_bench import EngineRunner, make_prompts
from benchmarks.machine import cpu_name
from benchmarks.step_profile.clock import StepClock
from benchmarks.step_profile.gemm_peak import ReferenceGemms
from benchmarks.step_profile.instrument import instrument, use_c_layers
from benchmarks.step_profile.report import Peak, kind_table, run_table
from common.model_store import default_cache_dir, default_model_dir, is_prepared
from services.worker.engine.engine import Engine
from services.worker.engine.config import EngineConfig
from services.worker.wiring import build_engine


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny test model, small sizes")
    parser.add_argument("--model-dir", default="", help="default: the prepared default model")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--token-budget", type=int, default=2048, help="tokens per step (MAX_BATCH_TOKENS)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--served", action="store_true",
                        help="also serve W1 at this concurrency through the whole stack and read the worker's "
                             "step time from its metrics: the rest of the wall time is between steps")
    return parser.parse_args(argv)


def w1_prompts(model_dir: str, count: int, seed: int, quick: bool, vocab: int) -> list[list[int]]:
    """W1's prompts as the model's tokenizer makes them (BOS first); the tiny model's are random ids."""
    if quick:
        return make_prompts(count, 24, vocab, seed=seed)
    from transformers import AutoTokenizer

    from benchmarks.head_to_head.workload import unique_requests
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [tokenizer(r.prompt).input_ids for r in unique_requests(count, 64, seed=seed)]


def _model_dir(args: argparse.Namespace, scratch: str) -> str:
    if args.quick:
        from tests.fixtures.tiny_model import save_tiny_model
        return str(save_tiny_model(Path(scratch) / "tiny"))
    if args.model_dir:
        return args.model_dir
    if not is_prepared(default_model_dir(default_cache_dir())):
        raise SystemExit("default model not prepared: run `make prepare-model` first")
    return str(default_model_dir(default_cache_dir()))


@dataclass
class Pass:
    title: str
    clock: StepClock            # a copy, as the pass left it
    wall_s: float
    prompts: int
    prompt_tokens: int
    output_tokens: int
    peaks: dict[str, Peak]      # per kind of step: oneDNN's rate on one layer's GEMMs at the same moments


def profile_pass(runner: EngineRunner, clock: StepClock, reference: ReferenceGemms, prompts: list[list[int]],
                 new_tokens: int, title: str) -> Pass:
    """One W1 run under the timers, from a reset clock and reference."""
    clock.reset()
    reference.reset()
    started = clock.now()
    runner.end_to_end_tokens_per_s(prompts, new_tokens)
    wall = clock.now() - started - clock.excluded_s
    peaks = {kind: Peak("oneDNN", round(reference.rows[kind] / reference.samples[kind]),
                        reference.rate(kind)) for kind in clock.kinds() if reference.samples.get(kind)}
    return Pass(title, copy.deepcopy(clock), wall, len(prompts), sum(map(len, prompts)), len(prompts) * new_tokens,
                peaks)


def render_pass(run: Pass) -> str:
    lines = [f"### {run.title}", "",
             f"{run.prompts} prompts ({run.prompt_tokens / run.prompts:.0f} tokens on average), "
             f"{run.output_tokens // run.prompts} new tokens each: {run.wall_s:.2f} s, "
             f"{run.output_tokens / run.wall_s:.1f} output tokens/s with the timers on.", ""]
    for kind in run.clock.kinds():
        lines += [kind_table(run.clock, kind, run.peaks.get(kind)), ""]
    lines += ["The whole run:", "", run_table(run.clock, run.wall_s)]
    return "\n".join(lines)


def header(engine: Engine, model_dir: str, args: argparse.Namespace) -> str:
    kernel = engine.linear_kernel.kernel if engine.linear_kernel is not None else "plain"
    return (f"Step profile: {os.path.basename(model_dir)}, {cpu_name()}, {os.cpu_count()} CPUs, torch "
            f"{torch.__version__}, {torch.get_num_threads()} threads; concurrency {args.concurrency}, "
            f"token budget {args.token_budget}; linear kernel {kernel} (prefill packs: "
            f"{engine.prefill_linear_kernel or kernel}), weight codes on {engine.coded_linears} linears, "
            f"LM head screen {'on' if engine.lm_head_screened else 'off'}, forward {engine.direct_forward}.")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="step-profile-") as scratch:
        model_dir = _model_dir(args, scratch)
        engine = build_engine(EngineConfig(model_dir=model_dir, model_key=os.path.basename(model_dir)))
        engine.wait_for_screen()
        runner = EngineRunner(engine, args.token_budget)
        vocab = engine.info.vocab_size
        runner.end_to_end_tokens_per_s(make_prompts(min(4, args.concurrency), 64, vocab, seed=-1), 4)  # warm-up
        clock = StepClock()
        reference = ReferenceGemms(instrument(engine, clock))
        clock.after_step = reference.sample
        fresh = [w1_prompts(model_dir, args.concurrency, seed, args.quick, vocab) for seed in (1, 2)]
        as_served = profile_pass(runner, clock, reference, fresh[0], args.new_tokens,
                                 "As served (few-row steps' layers in one C call)")
        c_layers = use_c_layers(engine, None)
        split = profile_pass(runner, clock, reference, fresh[1], args.new_tokens,
                             "Decode-only steps on the Python path")
        use_c_layers(engine, c_layers)
        print(header(engine, model_dir, args), "\n")
        print(render_pass(as_served), "\n")
        print(render_pass(split))
        if args.served:
            del engine, runner
            gc.collect()
            from benchmarks.step_profile.served import served_steps
            steps = served_steps(Path(model_dir), args.concurrency, args.new_tokens, args.quick)
            print()
            print(steps.table(outside_forward_ms(as_served.clock)))


def outside_forward_ms(clock: StepClock) -> float:
    """Per step, the engine's time outside `forward_ms`: planning, commit, its own Python."""
    seconds = sum(clock.seconds.get((kind, category), 0.0) for kind in clock.kinds()
                  for category in ("planning", "commit", "engine Python"))
    return seconds / max(sum(clock.steps.values()), 1) * 1000


if __name__ == "__main__":
    main()
