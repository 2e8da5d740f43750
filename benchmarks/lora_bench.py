"""Multi-LoRA serving in-process: W1-shaped batches (C fresh ~274-token prompts, 64 greedy new
tokens each, the scheduler's loop: every decode each step, then prefill chunks under a 2048-token
budget) with every sequence on one of N random r=8 adapters (q_proj, v_proj), N = 1, 4, 16,
against batches of the same shape on the base model, on one engine (LoRA on, MAX_LORAS=16: all resident
after the first round). Rounds alternate the configurations, in an order that rotates, each run
on prompts of its own; medians of the rounds.

    python -m benchmarks.lora_bench                  # default model, concurrency 8 and 32
    python -m benchmarks.lora_bench --quick          # tiny model: checks the script
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.machine import cpu_name
from benchmarks.step_profile.__main__ import w1_prompts
from common.model_store import default_cache_dir, default_model_dir, is_prepared
from services.worker.engine.engine import Engine
from services.worker.engine.config import EngineConfig
from common.step import NewSequence, StepBatch, WorkItem
from services.worker.engine.lora.registry import LoraConfig
from services.worker.wiring import build_engine

RANK = 8
TARGETS = ("self_attn.q_proj", "self_attn.v_proj")


def write_adapters(root: Path, shapes: dict[str, tuple[int, int]], count: int) -> list[str]:
    """`count` random PEFT adapters (r=8 on q_proj and v_proj) under `root`; their names."""
    from safetensors.torch import save_file

    names = []
    for index in range(count):
        generator = torch.Generator().manual_seed(index)
        tensors = {}
        for module, (in_features, out_features) in shapes.items():
            if module.endswith(TARGETS):
                tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(RANK, in_features,
                                                                                  generator=generator) / in_features ** 0.5
                tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(out_features, RANK,
                                                                                  generator=generator) / RANK
        directory = root / f"a{index}"
        directory.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(directory / "adapter_model.safetensors"))
        (directory / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": RANK, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}))
        names.append(directory.name)
    return names


def serve(engine: Engine, prompts: list[list[int]], adapters: list[str], new_tokens: int, budget: int,
          tag: str) -> float:
    """Output tokens per second of one W1 batch; sequence i on adapters[i % len] (none: the base)."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    remaining = {s: len(p) for s, p in zip(ids, prompts)}
    produced = dict.fromkeys(ids, 0)
    new = [NewSequence(s, tuple(p), lora_name=adapters[i % len(adapters)] if adapters else "",
                       lora_path=adapters[i % len(adapters)] if adapters else "")
           for i, (s, p) in enumerate(zip(ids, prompts))]
    started = time.perf_counter()
    while any(count < new_tokens for count in produced.values()):
        left, work = budget, []
        for s in ids:
            if remaining[s] == 0 and produced[s] < new_tokens:
                work.append(WorkItem(s, 1))
                left -= 1
        for s in ids:
            if left > 0 and remaining[s] > 0:
                chunk = min(left, remaining[s])
                work.append(WorkItem(s, chunk))
                left -= chunk
        out = engine.step(StepBatch(new_sequences=new, work=work))
        new = []
        for result in out.results:
            if result.error:
                raise RuntimeError(f"step failed: {result}")
            remaining[result.seq_id] = max(0, len(prompts[ids.index(result.seq_id)]) - result.num_computed_tokens)
            produced[result.seq_id] += len(result.token_ids)
    seconds = time.perf_counter() - started
    engine.step(StepBatch(free_seq_ids=ids))
    return sum(min(count, new_tokens) for count in produced.values()) / seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--concurrency", default="8,32")
    parser.add_argument("--adapters", default="1,4,16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        if args.quick:
            from tests.fixtures.tiny_model import save_tiny_model
            model_dir = str(save_tiny_model(Path(scratch) / "tiny"))
        else:
            model_dir = str(default_model_dir(default_cache_dir()))
            if not is_prepared(Path(model_dir)):
                raise SystemExit("default model not prepared: run `make prepare-model` first")
        root = Path(scratch) / "loras"
        root.mkdir()
        counts = [int(n) for n in args.adapters.split(",")]
        engine = build_engine(EngineConfig(model_dir=model_dir, model_key="lora-bench", lora=LoraConfig(
            root=str(root), max_loras=max(counts), max_rank=RANK)))
        engine.wait_for_screen(120)
        names = write_adapters(root, engine.prepared.lora_shapes, max(counts))
        print(f"# {cpu_name()}, {torch.get_num_threads()} threads, {engine.direct_forward}, "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
        configs = [("base only", [])] + [(f"{n} adapter{'s' if n > 1 else ''}", names[:n]) for n in counts]
        vocab = int(engine.model_config.vocab_size)
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            rates: dict[str, list[float]] = {label: [] for label, _ in configs}
            serve(engine, w1_prompts(model_dir, concurrency, 999, args.quick, vocab), names, 4, 2048, "warm")
            for round_index in range(args.rounds):
                # Fresh prompts for every run (the same prompts again would find an earlier run's
                # blocks cached under the same adapter: 4 adapters reuse 1 adapter's a0 blocks, 16
                # reuse 4's), and the configurations' order rotates from round to round.
                order = configs[round_index % len(configs):] + configs[:round_index % len(configs)]
                for index, (label, adapters) in enumerate(order):
                    prompts = w1_prompts(model_dir, concurrency, round_index * len(configs) + index,
                                         args.quick, vocab)
                    rates[label].append(serve(engine, prompts, adapters, args.new_tokens, 2048,
                                              f"c{concurrency}-{round_index}-{label}"))
            base = statistics.median(rates["base only"])
            print(f"\n| concurrency {concurrency} | output tok/s (median) | vs base | rounds |\n|---|---:|---:|---|")
            for label, values in rates.items():
                median = statistics.median(values)
                print(f"| {label} | {median:.1f} | {median / base:.2f}x | "
                      f"{' / '.join(f'{v:.1f}' for v in values)} |")


if __name__ == "__main__":
    main()
