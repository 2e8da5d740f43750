"""CPU_COMPUTE=bfloat16 against float32, in one run: speed and quality.

Two engines on the same model, float32 (the default) and CPU_COMPUTE=bfloat16:

* speed, in alternating rounds: prefill tokens/s (--prefill-prompts prompts of
  --prompt-len tokens, --token-budget tokens a step) and decode tokens/s at each
  --batches size (one decode per sequence a step, --decode-steps steps);
* greedy agreement: --prompts-count prompts of plain text, --new-tokens greedy tokens
  each (EOS banned so every sequence runs its length), batched as a server would: the
  fraction of generated tokens equal at the same position, the fraction of sequences
  equal in full, and the mean length of the common prefix;
* perplexity of --ppl-tokens tokens of the Python standard library's documentation
  (the text make bench-longkv scores), prefilled in chunks of 512 with prompt logprobs.

    python -m benchmarks.bf16_bench            # default model (a few minutes)
    python -m benchmarks.bf16_bench --quick    # tiny random model: checks the script
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.engine_bench import EngineRunner, make_prompts
from benchmarks.longkv_bench import long_text, score
from benchmarks.machine import cpu_name
from common.model_store import default_cache_dir, default_model_dir, is_prepared
from common.step import KvPolicy, NewSequence, StepBatch, WorkItem
from common.types import SamplingParams
from services.worker.engine.engine import Engine
from services.worker.engine.config import EngineConfig
from services.worker.engine.cpu.linear.cpu_linear import PackedLinear
from services.worker.wiring import build_engine

MODES = ("float32", "bfloat16")
PROMPTS = (
    "The history of the Roman Empire", "Photosynthesis is the process by which",
    "Here is a recipe for a simple tomato soup:", "The main differences between TCP and UDP are",
    "Once upon a time, in a small village by the sea,", "To compute the factorial of a number in Python,",
    "The three laws of thermodynamics state that", "A good night's sleep matters because",
    "Dear hiring manager, I am writing to apply for", "The French Revolution began in 1789 when",
    "def binary_search(items, target):", "The capital cities of the Nordic countries are",
    "Climate change affects ocean currents by", "Ten tips for learning a new language:",
    "The plot of Shakespeare's Hamlet is", "In linear algebra, an eigenvector is",
    "The best way to brew coffee at home is", "SELECT name, COUNT(*) FROM orders",
    "Mount Everest was first climbed in", "A haiku about autumn leaves:",
)


@dataclass(frozen=True)
class Agreement:
    tokens: float          # generated tokens equal at the same position
    sequences: float       # sequences equal in full
    mean_prefix: float     # tokens before the first difference, on average


def agreement(reference: list[list[int]], other: list[list[int]]) -> Agreement:
    """How far `other`'s greedy sequences follow `reference`'s (same prompts, same order)."""
    same = total = 0
    prefixes, whole = [], 0
    for ref, got in zip(reference, other, strict=True):
        same += sum(a == b for a, b in zip(ref, got))
        total += max(len(ref), len(got))
        prefix = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
        prefixes.append(prefix)
        whole += ref == got
    return Agreement(same / total, whole / len(reference), statistics.fmean(prefixes))


def greedy(engine: Engine, prompts: list[list[int]], new_tokens: int, tag: str) -> list[list[int]]:
    """Each prompt's `new_tokens` greedy tokens, all sequences in one batch (EOS banned)."""
    params = SamplingParams(min_tokens=new_tokens)
    ids = [f"{tag}{i}" for i in range(len(prompts))]
    outputs: dict[str, list[int]] = {seq_id: [] for seq_id in ids}
    new = [NewSequence(seq_id, tuple(prompt), (), params) for seq_id, prompt in zip(ids, prompts)]
    while any(len(tokens) < new_tokens for tokens in outputs.values()):
        work = [WorkItem(seq_id, 4096) for seq_id in ids if len(outputs[seq_id]) < new_tokens]
        for result in engine.step(StepBatch(new_sequences=new, work=work)).results:
            if result.error:
                raise SystemExit(f"the engine failed {result.seq_id}: {result.error}")
            if result.sampled:
                outputs[result.seq_id].extend(result.token_ids)
        new = []
    engine.step(StepBatch(free_seq_ids=ids))
    return [outputs[seq_id][:new_tokens] for seq_id in ids]


def layer_weight_bytes(engine: Engine) -> int:
    """Bytes the decoder layers' linears hold: float32 weights, packs (float32 and bfloat16), codes."""
    total = 0
    for linear in engine.prepared.base.modules():
        if isinstance(linear, PackedLinear):
            tensors = (linear.weight, linear.packed, linear.bf16_packed)
            total += sum(t.numel() * t.element_size() for t in tensors if t is not None)
            total += linear.coded.nbytes if linear.coded is not None else 0
    return total


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny random model, small sizes")
    parser.add_argument("--rounds", type=int, default=2, help="alternating speed rounds (medians reported)")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--prefill-prompts", type=int, default=8)
    parser.add_argument("--token-budget", type=int, default=512)
    parser.add_argument("--batches", default="1,8,16,32", help="decode batch sizes")
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--prompts-count", type=int, default=len(PROMPTS))
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--ppl-tokens", type=int, default=4096)
    parser.add_argument("--out", default=".cache/bench-bf16", help="where results.json goes")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompt_len, args.prefill_prompts, args.token_budget, args.batches = 48, 2, 64, "1,4"
        args.decode_steps, args.prompts_count, args.new_tokens, args.ppl_tokens = 4, 4, 8, 300
        args.rounds = 1
    return args


def _engines(args: argparse.Namespace) -> tuple[dict[str, Engine], object, str]:
    """The two engines, the tokenizer (text -> ids) and the model's name."""
    config = dict(num_blocks=-(-args.ppl_tokens // 16) + 64 * 4, block_size=16, enable_prefix_caching=False,
                  max_model_len=max(args.ppl_tokens, args.prompt_len + args.new_tokens) + 128)
    if args.quick:
        from tests.fixtures.tiny_model import build_model, gemma3_config

        model = build_model(gemma3_config())
        engines = {mode: build_engine(EngineConfig(model_dir="", model_key="tiny", cpu_compute=mode, **config),
                                      model=copy.deepcopy(model)) for mode in MODES}
        return engines, (lambda text: [2] + [10 + ord(c) % 300 for c in text]), "tiny random model"
    path = default_model_dir(default_cache_dir())
    if not is_prepared(path):
        raise SystemExit("default model not prepared: run `make prepare-model` first")
    from transformers import AutoTokenizer

    engines = {mode: build_engine(EngineConfig(model_dir=str(path), model_key=path.name, cpu_compute=mode, **config))
               for mode in MODES}
    hf = AutoTokenizer.from_pretrained(path)
    return engines, (lambda text: hf(text)["input_ids"]), path.name


def _speed(args: argparse.Namespace, engines: dict[str, Engine]) -> dict[str, dict[str, float]]:
    """Median tokens/s per mode: prefill, and decode at each batch size."""
    batches = [int(b) for b in args.batches.split(",")]
    vocab = engines["float32"].model_config.vocab_size
    samples: dict[str, dict[str, list[float]]] = {mode: {} for mode in MODES}
    for engine in engines.values():   # warm-up: first calls allocate and pick kernels
        EngineRunner(engine, args.token_budget).decode_tokens_per_s(make_prompts(2, 32, vocab, seed=99), 2)
    for round_index in range(args.rounds):
        for mode in MODES if round_index % 2 == 0 else reversed(MODES):
            runner = EngineRunner(engines[mode], args.token_budget)   # its sequences are freed as it goes
            prompts = make_prompts(args.prefill_prompts, args.prompt_len, vocab, seed=round_index)
            samples[mode].setdefault("prefill", []).append(runner.prefill_tokens_per_s(prompts))
            for batch in batches:
                prompts = make_prompts(batch, 64, vocab, seed=100 + round_index)
                samples[mode].setdefault(f"decode@{batch}", []).append(
                    runner.decode_tokens_per_s(prompts, args.decode_steps))
    return {mode: {key: statistics.median(values) for key, values in by_key.items()}
            for mode, by_key in samples.items()}


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("services.worker.engine.cpu.linear.bf16_compute").setLevel(logging.INFO)
    engines, tokenizer, model_name = _engines(args)
    for engine in engines.values():
        engine.wait_for_screen()    # `auto` builds the LM head screen in the background: measure with it
    speed = _speed(args, engines)
    prompts = [tokenizer(text) for text in (PROMPTS * (1 + args.prompts_count // len(PROMPTS)))[:args.prompts_count]]
    generated = {mode: greedy(engine, prompts, args.new_tokens, mode[0]) for mode, engine in engines.items()}
    agreed = agreement(generated["float32"], generated["bfloat16"])
    text = long_text(tokenizer, args.ppl_tokens)
    perplexity = {mode: score(engine, text, KvPolicy(), 512, f"ppl-{mode}").perplexity
                  for mode, engine in engines.items()}
    _report(args, model_name, engines, speed, agreed, perplexity, len(text))


def _report(args: argparse.Namespace, model_name: str, engines: dict[str, Engine], speed: dict,
            agreed: Agreement, perplexity: dict[str, float], text_tokens: int) -> None:
    done = engines["bfloat16"].prepared.speedups.bfloat16
    print(f"CPU_COMPUTE float32 vs bfloat16: {model_name}, {cpu_name()}, {os.cpu_count()} CPUs, torch "
          f"{torch.__version__}; bfloat16 from {done.min_rows} rows on ({done.linears} layer linears), "
          f"median of {args.rounds} alternating rounds.")
    print()
    keys = list(speed["float32"])
    labels = {key: (f"prefill tok/s ({args.prefill_prompts} x {args.prompt_len})" if key == "prefill"
                    else f"decode tok/s, batch {key.split('@')[1]}") for key in keys}
    print("| | float32 | bfloat16 | bfloat16 / float32 |")
    print("|---|---:|---:|---:|")
    for key in keys:
        f32, b16 = speed["float32"][key], speed["bfloat16"][key]
        print(f"| {labels[key]} | {f32:.0f} | {b16:.0f} | {b16 / f32:.2f}x |")
    held = {mode: layer_weight_bytes(engine) / 2**20 for mode, engine in engines.items()}
    print(f"| layer linears' weights held (MiB) | {held['float32']:.0f} | {held['bfloat16']:.0f} | "
          f"{held['bfloat16'] / held['float32']:.2f}x |")
    print(f"| perplexity, {text_tokens} tokens of Python docs | {perplexity['float32']:.3f} | "
          f"{perplexity['bfloat16']:.3f} | {perplexity['bfloat16'] / perplexity['float32'] - 1:+.2%} |")
    print()
    print(f"Greedy agreement, {args.prompts_count} prompts x {args.new_tokens} tokens: {agreed.tokens:.1%} of tokens "
          f"equal at their position, {agreed.sequences:.0%} of sequences equal in full, "
          f"first difference after {agreed.mean_prefix:.1f} tokens on average.")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({
        "model": model_name, "min_rows": done.min_rows, "speed": speed, "perplexity": perplexity, "held_mib": held,
        "agreement": agreed.__dict__, "prompts": args.prompts_count, "new_tokens": args.new_tokens,
        "text_tokens": text_tokens}, indent=2))


if __name__ == "__main__":
    main()
