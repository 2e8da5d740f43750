"""Decode graphs and fused prefill attention on CUDA, in-process, side by side.

    python -m benchmarks.cuda_decode_bench                        # CUDA, bfloat16
    python -m benchmarks.cuda_decode_bench --device cpu --quick   # checks the script

The model has the default model's shape (Gemma 3 270M: 18 layers, 262k vocabulary,
sliding windows of 512) with random weights, so no checkpoint is needed. For each
decode batch it runs the same prompts through an engine with USE_CUDA_GRAPHS off
and one with it on, and reports decode tokens/s for both and how many greedy
tokens agree. Then prefill tokens/s with ATTENTION_BACKEND=sdpa and, when the
flash-attn package imports, flash_attn. On CPU the graphs replay by calling the
forward again (the tests' stand-in), so only the script is checked there, not a
speed. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import copy
import time
from dataclasses import dataclass

import torch

from benchmarks.machine import cpu_name
from services.worker.engine.engine import Engine
from services.worker.engine.config import EngineConfig
from common.step import NewSequence, StepBatch, WorkItem
from services.worker.engine.cuda.decode_graphs import EagerCapture
from services.worker.engine.cuda.varlen_attention import import_flash_attn
from services.worker.wiring import build_engine


@dataclass(frozen=True)
class Sizes:
    layers: int
    vocab: int
    prompt_len: int
    batches: tuple[int, ...]
    steps: int
    prefill_prompts: int


FULL = Sizes(layers=18, vocab=262_144, prompt_len=256, batches=(1, 8, 32, 64), steps=64, prefill_prompts=16)
QUICK = Sizes(layers=2, vocab=4096, prompt_len=40, batches=(1, 3), steps=4, prefill_prompts=2)


def gemma3_270m_shaped(sizes: Sizes) -> torch.nn.Module:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    layer_types = ["full_attention" if (index + 1) % 6 == 0 else "sliding_attention" for index in range(sizes.layers)]
    config = Gemma3TextConfig(vocab_size=sizes.vocab, hidden_size=640, intermediate_size=2048,
                              num_hidden_layers=sizes.layers, num_attention_heads=4, num_key_value_heads=1,
                              head_dim=256, query_pre_attn_scalar=256, sliding_window=512, layer_types=layer_types,
                              max_position_embeddings=32_768, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    torch.manual_seed(0)
    return Gemma3ForCausalLM(config).eval()


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [[2] + row for row in torch.randint(10, vocab, (count, length - 1), generator=generator).tolist()]


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def make_engine(model: torch.nn.Module, args: argparse.Namespace, graphs: bool, backend: str = "sdpa",
                num_blocks: int = 4096) -> Engine:
    config = EngineConfig(model_dir="", device=args.device, dtype=args.dtype, num_blocks=num_blocks, block_size=16,
                          use_cuda_graphs=graphs, attention_backend=backend, enable_prefix_caching=False)
    capture = EagerCapture() if graphs and args.device != "cuda" else None
    return build_engine(config, model=copy.deepcopy(model), graph_capture=capture)


def decode_run(engine: Engine, batch: list[list[int]], steps: int, device: str) -> tuple[float, list[list[int]]]:
    """Decode tokens/s over `steps` timed steps after three warm-ups (captures happen there)."""
    ids = [f"s{index}" for index in range(len(batch))]
    engine.step(StepBatch(new_sequences=[NewSequence(seq_id, prompt) for seq_id, prompt in zip(ids, batch)],
                          work=[WorkItem(seq_id, len(prompt)) for seq_id, prompt in zip(ids, batch)]))
    work = StepBatch(work=[WorkItem(seq_id, 1) for seq_id in ids])
    for _ in range(3):
        engine.step(work)
    synchronize(device)
    tokens: list[list[int]] = []
    started = time.perf_counter()
    for _ in range(steps):
        tokens.append([result.token_id for result in engine.step(work).results])
    synchronize(device)
    seconds = time.perf_counter() - started
    engine.step(StepBatch(free_seq_ids=ids))
    return len(batch) * steps / seconds, tokens


def prefill_run(engine: Engine, batch: list[list[int]], device: str) -> float:
    ids = [f"p{index}" for index in range(len(batch))]
    synchronize(device)
    started = time.perf_counter()
    engine.step(StepBatch(new_sequences=[NewSequence(seq_id, prompt) for seq_id, prompt in zip(ids, batch)],
                          work=[WorkItem(seq_id, len(prompt)) for seq_id, prompt in zip(ids, batch)]))
    synchronize(device)
    seconds = time.perf_counter() - started
    engine.step(StepBatch(free_seq_ids=ids))
    return sum(len(prompt) for prompt in batch) / seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--dtype", default="", help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--quick", action="store_true", help="small sizes: checks the script, not the speed")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("CUDA is not available here; use --device cpu --quick to check the script")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    sizes = QUICK if args.quick else FULL
    model = gemma3_270m_shaped(sizes)
    name = torch.cuda.get_device_name() if args.device == "cuda" else cpu_name()

    lines = [f"CUDA decode benchmark ({'quick' if args.quick else 'full'}): {name}, torch {torch.__version__}, "
             f"{args.dtype}, Gemma 3 270M-shaped random model ({sizes.layers} layers), "
             f"{sizes.prompt_len}-token prompts, {sizes.steps} timed decode steps.", "",
             "| measure | without | with | ratio | greedy tokens agreeing |", "|---|---:|---:|---:|---:|"]
    eager = make_engine(model, args, graphs=False)
    graphed = make_engine(model, args, graphs=True)
    for size in sizes.batches:
        batch = prompts(size, sizes.prompt_len, sizes.vocab, seed=size)
        eager_rate, eager_tokens = decode_run(eager, batch, sizes.steps, args.device)
        graph_rate, graph_tokens = decode_run(graphed, batch, sizes.steps, args.device)
        agreeing = sum(a == b for row_a, row_b in zip(eager_tokens, graph_tokens) for a, b in zip(row_a, row_b))
        lines.append(f"| decode tokens/s, batch {size}, decode graphs | {eager_rate:,.1f} | {graph_rate:,.1f} | "
                     f"{graph_rate / eager_rate:.2f}× | {agreeing} / {size * sizes.steps} |")
    graphs = graphed.graphs
    if graphs is not None:
        lines.append(f"| graphs captured / replayed steps | | {graphs.captured} / {graphs.replays} | | "
                     f"{'on' if graphs.enabled else 'off: ' + graphs.failure} |")
    del eager, graphed

    batch = prompts(sizes.prefill_prompts, sizes.prompt_len, sizes.vocab, seed=99)
    sdpa = make_engine(model, args, graphs=False, backend="sdpa")
    prefill_run(sdpa, prompts(2, sizes.prompt_len, sizes.vocab, seed=98), args.device)
    sdpa_rate = prefill_run(sdpa, batch, args.device)
    del sdpa
    if args.device == "cuda" and args.dtype in ("bfloat16", "float16") and import_flash_attn() is not None:
        flash = make_engine(model, args, graphs=False, backend="flash_attn")
        prefill_run(flash, prompts(2, sizes.prompt_len, sizes.vocab, seed=98), args.device)
        rate = prefill_run(flash, batch, args.device)
        flash_rate, ratio = f"{rate:,.1f}", f"{rate / sdpa_rate:.2f}×"
    else:
        flash_rate, ratio = "no flash-attn", "—"
    lines.append(f"| prefill tokens/s, {len(batch)} prompts in one step, flash-attn varlen | {sdpa_rate:,.1f} | "
                 f"{flash_rate} | {ratio} | |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
