"""The engine's CPU kernels on their own, at the default model's shapes (no checkpoint needed).

    python -m benchmarks.kernel_bench            # ~1 min
    python -m benchmarks.kernel_bench --quick    # small sizes: checks the script

Times, best of several calls each, alternating the two sides of every row:
  * the 126 linear layers of Gemma 3 270M (18 layers x q, k, v, o, gate, up, down) at a few
    rows: the C few-row kernel against oneDNN's packed weights, and the same layers as exact
    8-bit weight codes (weight_codes.py) through the coded kernel against oneDNN, and the
    coded kernel on the same codes kept narrow (at the default model's widths: 5 bits for
    q, k, gate, up, 4 for o, 4 / 6 for down and 5 / 8 for v in alternate layers) against 8-bit;
  * the LM head screen's int8 kernel over a 262k x 640 head, and its kernel from a Q8_0 head's
    8-bit codes with int8 activations against int16 ones (where AVX-512 VNNI and VBMI run it;
    elsewhere the int16 one alone), and that int16 kernel reading half-float scales and byte
    zeros against float scales and offsets (codes_screen_half.py);
  * decode attention through the block tables over 18 layers' caches, against gather + SDPA;
  * prefill attention over a step's chunks (W1-like fresh chunks, one continuing its sequence,
    one long chunk) in one C call a layer, against SDPA per chunk as the engine calls it;
  * the sampler's greedy argmax against torch's;
  * one layer's 7 linears at prefill steps' rows (a W1 step's ~1,785 and 256) through the
    native prefill GEMM (prefill_gemm.py, AVX2 and FMA) against oneDNN's packed weights, with
    whether every output had the same bits (where the GEMM runs).
Prints a markdown table. Weights are random (the coded ones random codes): the kernels' speed
does not depend on them.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from benchmarks.machine import cpu_name
from services.worker.engine.cpu.screen.codes_screen_half import half_scales
from services.worker.engine.cpu.screen.codes_screen_int8 import approximate as int8_screen
from services.worker.engine.cpu.screen.int8_matmul import PANEL
from services.worker.engine.cpu.screen.lm_head_screen import load_native_matmul
from services.worker.engine.cpu.kernels.native_build import default_cache_dir
from services.worker.engine.cpu.kernels.native_decode import load_decode_kernel
from services.worker.engine.cpu.kernels.native_ops import load_skinny_linear
from services.worker.engine.cpu.kernels.native_prefill import load_native_prefill
from services.worker.engine.cpu.linear.prefill_gemm import PANEL as GEMM_PANEL
from services.worker.engine.cpu.linear.prefill_gemm import load_prefill_gemm
from services.worker.engine.cpu.timing import best_alternating
from services.worker.engine.sampling.sampler import row_argmax
from services.worker.engine.cpu.linear.weight_codes import CodedWeight, load_coded_linear


@dataclass(frozen=True)
class Shapes:
    hidden: int
    heads: int
    head_dim: int
    intermediate: int
    layers: int
    vocab: int
    context: int
    repeats: int


FULL = Shapes(hidden=640, heads=4, head_dim=256, intermediate=2048, layers=18, vocab=262144, context=300, repeats=7)
QUICK = Shapes(hidden=64, heads=4, head_dim=16, intermediate=128, layers=2, vocab=4096, context=40, repeats=2)
BLOCK_SIZE = 16


def best_of(repeats: int, *functions: Callable[[], object]) -> list[float]:
    """Best seconds of each function over `repeats` rounds, the functions alternating."""
    return best_alternating(functions, repeats)


def _layer_shapes(shapes: Shapes) -> list[tuple[int, int]]:
    h, q, kv, i = shapes.hidden, shapes.heads * shapes.head_dim, shapes.head_dim, shapes.intermediate
    return [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)] * shapes.layers


def linear_rows(shapes: Shapes, row_counts: tuple[int, ...]) -> list[tuple[str, float, float]]:
    kernel = load_skinny_linear(default_cache_dir())
    if kernel is None:
        return []
    weights = [torch.randn(out, inp) * 0.02 for out, inp in _layer_shapes(shapes)]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in weights]
    results = []
    for rows in row_counts:
        inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
        native = lambda: [kernel(inputs[w.shape[1]], w, None) for w in weights]  # noqa: E731
        onednn = lambda: [torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], p, None, "none", [], "")  # noqa: E731
                          for w, p in zip(weights, packed)]
        ours, theirs = best_of(shapes.repeats, native, onednn)
        results.append((f"{len(weights)} linears, {rows} rows: C kernel vs oneDNN packed", ours, theirs))
    return results


def _coded_weight(out_features: int, in_features: int, group: int = 32, levels: int = 32) -> torch.Tensor:
    """A weight that is exact codes, as a dequantized GGUF block (by default a 5-bit one):
    scale * (code - levels / 2)."""
    scale = torch.randint(1024, 2048, (out_features, in_features // group, 1)).float() * 2.0 ** -20
    codes = torch.randint(0, levels, (out_features, in_features // group, group)).float()
    return (scale * (codes - levels // 2)).reshape(out_features, in_features)


def coded_rows(shapes: Shapes, row_counts: tuple[int, ...]) -> list[tuple[str, float, float]]:
    kernel = load_coded_linear(default_cache_dir())
    if kernel is None:
        return []
    weights = [_coded_weight(out, inp) for out, inp in _layer_shapes(shapes)]
    coded = [kernel.find(w) for w in weights]
    if any(c is None for c in coded):
        raise RuntimeError("a benchmark weight did not fit its codes")
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in weights]
    results = []
    for rows in row_counts:
        inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
        ours = lambda: [kernel(inputs[w.shape[1]], c, None) for w, c in zip(weights, coded)]  # noqa: E731
        onednn = lambda: [torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], p, None, "none", [], "")  # noqa: E731
                          for w, p in zip(weights, packed)]
        mine, theirs = best_of(shapes.repeats, ours, onednn)
        results.append((f"{len(weights)} linears as weight codes, {rows} rows: coded kernel vs oneDNN packed",
                        mine, theirs))
    return results


# The default model's code widths (Q5_0, Q4_K, Q6_K, Q8_0 blocks) for q, k, v, o, gate, up, down,
# in even and odd layers.
MODEL_LEVELS = ((32, 32, 32, 16, 32, 32, 16), (32, 32, 256, 16, 32, 32, 64))


def narrow_rows(shapes: Shapes, row_counts: tuple[int, ...]) -> list[tuple[str, float, float]]:
    kernel = load_coded_linear(default_cache_dir())
    if kernel is None:
        return []
    levels = [level for layer in range(shapes.layers) for level in MODEL_LEVELS[layer % 2]]
    weights = [_coded_weight(out, inp, 16 if level == 64 else 32, level)
               for (out, inp), level in zip(_layer_shapes(shapes), levels)]
    wide = [kernel.find(w) for w in weights]
    if any(c is None for c in wide):
        raise RuntimeError("a benchmark weight did not fit its codes")
    narrow = [kernel.narrow(c) for c in wide]
    megabytes = sum(c.nbytes for c in narrow) / 1e6, sum(c.nbytes for c in wide) / 1e6
    results = []
    for rows in row_counts:
        inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
        ours = lambda: [kernel(inputs[w.shape[1]], c, None) for w, c in zip(weights, narrow)]  # noqa: E731
        bytes_ = lambda: [kernel(inputs[w.shape[1]], c, None) for w, c in zip(weights, wide)]  # noqa: E731
        mine, theirs = best_of(shapes.repeats, ours, bytes_)
        results.append((f"{len(weights)} linears as narrow codes ({megabytes[0]:.0f} MB) vs 8-bit codes "
                         f"({megabytes[1]:.0f} MB), {rows} rows", mine, theirs))
    return results


def screen_rows(shapes: Shapes, row_counts: tuple[int, ...]) -> list[tuple[str, float, float | None]]:
    kernel = load_native_matmul(default_cache_dir())
    if kernel is None:
        return []
    weight = kernel.pack(torch.randint(-127, 128, (shapes.vocab, shapes.hidden), dtype=torch.int8),
                         torch.rand(shapes.vocab))
    results: list[tuple[str, float, float | None]] = []
    for rows in row_counts:
        x = torch.randint(-16383, 16384, (rows, shapes.hidden), dtype=torch.int16)
        x_scale = torch.rand(rows)
        (seconds,) = best_of(shapes.repeats, lambda: kernel(weight, x, x_scale))
        results.append((f"LM head screen int8 kernel, {shapes.vocab} x {shapes.hidden}, {rows} rows", seconds, None))
    return results


def codes_screen_rows(shapes: Shapes, row_counts: tuple[int, ...]) -> list[tuple[str, float, float | None]]:
    """The screen from a Q8_0 head's codes (group 32): int8 activations with a scale per block
    (codes_screen_int8.py) against int16 ones, rounding included; where the int8 kernel does not
    run (no AVX-512 VNNI and VBMI), the int16 one alone."""
    kernel = load_native_matmul(default_cache_dir())
    if kernel is None:
        return []
    panels, group = -(-shapes.vocab // PANEL), 32
    coded = CodedWeight(torch.randint(0, 256, (panels, shapes.hidden, PANEL), dtype=torch.uint8),
                        torch.rand(panels, shapes.hidden // group, PANEL) * 1e-3,
                        torch.rand(panels, shapes.hidden // group, PANEL) * 1e-3 - 5e-4, group, shapes.vocab,
                        shapes.hidden)
    results: list[tuple[str, float, float | None]] = []
    for rows in row_counts:
        x = torch.randn(rows, shapes.hidden)
        x[:, :3] *= 50                                  # Gemma's few massive dimensions

        def int16() -> torch.Tensor:
            scale = x.abs().amax(dim=1) / 16383
            return kernel.codes_screen(coded, (x / scale[:, None]).round().to(torch.int16), scale)

        if not kernel.has_codes_quads:
            (seconds,) = best_of(shapes.repeats, int16)
            results.append((f"LM head screen from 8-bit codes, int16 activations, {shapes.vocab} x "
                            f"{shapes.hidden}, {rows} rows", seconds, None))
            continue
        mine, theirs = best_of(shapes.repeats, lambda: int8_screen(kernel, coded, x, None), int16)
        results.append((f"LM head screen from 8-bit codes, int8 vs int16 activations, {shapes.vocab} x "
                        f"{shapes.hidden}, {rows} rows", mine, theirs))
    return results


def half_screen_rows(shapes: Shapes, row_counts: tuple[int, ...]) -> list[tuple[str, float, float | None]]:
    """The int16 screen from a Q8_0-like head's codes (half-float scales, offsets -zero * scale)
    reading its half scales and byte zeros (codes_screen_half.py) against its float scales and
    offsets: the same outputs, fewer bytes."""
    kernel = load_native_matmul(default_cache_dir())
    if kernel is None:
        return []
    panels, group = -(-shapes.vocab // PANEL), 32
    scales = (torch.rand(panels, shapes.hidden // group, PANEL) * 1e-3).half().float()
    zeros = torch.randint(0, 256, scales.shape).float()
    coded = CodedWeight(torch.randint(0, 256, (panels, shapes.hidden, PANEL), dtype=torch.uint8), scales,
                        -zeros * scales, group, shapes.vocab, shapes.hidden)
    half = half_scales(coded)
    assert half is not None
    results: list[tuple[str, float, float | None]] = []
    for rows in row_counts:
        x = torch.randint(-16383, 16384, (rows, shapes.hidden), dtype=torch.int16)
        x_scale = torch.rand(rows)
        mine, theirs = best_of(shapes.repeats, lambda: kernel.codes_screen(coded, x, x_scale, None, half),
                               lambda: kernel.codes_screen(coded, x, x_scale))
        results.append((f"LM head screen from 8-bit codes, half vs float scales, {shapes.vocab} x {shapes.hidden}, "
                        f"{rows} rows", mine, theirs))
    return results


def attention_rows(shapes: Shapes, seq_counts: tuple[int, ...]) -> list[tuple[str, float, float]]:
    kernel = load_decode_kernel("auto", torch.device("cpu"), torch.float32, BLOCK_SIZE, default_cache_dir())
    if kernel is None:
        return []
    blocks_per_seq = -(-shapes.context // BLOCK_SIZE)
    pool_blocks = max(seq_counts) * blocks_per_seq + 8
    caches = [(torch.randn(pool_blocks * BLOCK_SIZE, 1, shapes.head_dim),
               torch.randn(pool_blocks * BLOCK_SIZE, 1, shapes.head_dim)) for _ in range(shapes.layers)]
    results = []
    for seqs in seq_counts:
        tables = torch.randperm(pool_blocks)[:seqs * blocks_per_seq].view(seqs, blocks_per_seq).contiguous()
        ctx = torch.full((seqs,), shapes.context, dtype=torch.int64)
        query = torch.randn(seqs, shapes.heads, shapes.head_dim)
        out = torch.empty_like(query)
        positions = torch.arange(shapes.context)
        slots = tables[:, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE   # [seqs, context]
        scale = shapes.head_dim ** -0.5

        def native() -> None:
            for k_cache, v_cache in caches:
                kernel(query, k_cache, v_cache, tables, ctx, BLOCK_SIZE, shapes.context, None, scale, out)

        def gathered() -> None:
            for k_cache, v_cache in caches:
                k = k_cache.view(k_cache.shape[0], -1).index_select(0, slots.reshape(-1))
                v = v_cache.view(v_cache.shape[0], -1).index_select(0, slots.reshape(-1))
                k = k.view(seqs, 1, shapes.context, shapes.head_dim)
                v = v.view(seqs, 1, shapes.context, shapes.head_dim)
                F.scaled_dot_product_attention(query.view(seqs, 1, shapes.heads, shapes.head_dim), k, v, scale=scale)

        ours, theirs = best_of(shapes.repeats, native, gathered)
        results.append((f"decode attention, {shapes.layers} layers, {seqs} x {shapes.context} tokens: "
                        f"C kernel vs gather + SDPA", ours, theirs))
    return results


def prefill_attention_rows(shapes: Shapes, layouts: tuple[tuple[tuple[int, int], ...], ...]
                           ) -> list[tuple[str, float, float]]:
    """Each layout: a step's chunks as (queries, keys); a chunk with more keys continues its sequence."""
    loaded = load_native_prefill("auto", torch.float32, default_cache_dir())
    if loaded is None:
        return []
    scale, results = shapes.head_dim ** -0.5, []
    for chunks in layouts:
        lens_q, lens_k = zip(*chunks)
        cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
        cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
        query = torch.randn(1, shapes.heads, sum(lens_q), shapes.head_dim)    # as a layer hands it over
        keys, values = torch.randn(sum(lens_k), 1, shapes.head_dim), torch.randn(sum(lens_k), 1, shapes.head_dim)
        masks = [None if q == k else torch.arange(k)[None, :] <= torch.arange(k - q, k)[:, None] for q, k in chunks]

        def native() -> None:
            for _ in range(shapes.layers):
                loaded.function(query[0].transpose(0, 1), keys, values, cu_q, cu_k, max(lens_q), max(lens_k),
                                softmax_scale=scale, causal=True)

        def per_chunk() -> None:
            for _ in range(shapes.layers):
                for index, mask in enumerate(masks):
                    q = query[:, :, cu_q[index]:cu_q[index + 1]]
                    k = keys[cu_k[index]:cu_k[index + 1]].permute(1, 0, 2).unsqueeze(0)
                    v = values[cu_k[index]:cu_k[index + 1]].permute(1, 0, 2).unsqueeze(0)
                    F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                                   enable_gqa=True)

        ours, theirs = best_of(max(2, shapes.repeats // 2), native, per_chunk)
        shown = ", ".join(f"{q}" if q == k else f"{q} after {k - q}" for q, k in chunks[:3])
        more = f" and {len(chunks) - 3} more" if len(chunks) > 3 else ""
        results.append((f"prefill attention, {shapes.layers} layers, chunks of {shown}{more}: "
                        f"C kernel vs SDPA per chunk", ours, theirs))
    return results


def argmax_rows(shapes: Shapes, row_counts: tuple[int, ...]) -> list[tuple[str, float, float]]:
    results = []
    for rows in row_counts:
        logits = torch.randn(rows, shapes.vocab)
        ours, theirs = best_of(shapes.repeats * 4, lambda: row_argmax(logits), lambda: logits.argmax(dim=-1))
        results.append((f"greedy argmax, {rows} x {shapes.vocab}: row_argmax vs torch", ours, theirs))
    return results


def prefill_gemm_rows(shapes: Shapes, row_counts: tuple[int, ...]) -> list[tuple[str, float, float]]:
    gemm = load_prefill_gemm(default_cache_dir())
    if gemm is None:
        return []
    weights = [torch.randn(out, inp) * 0.02 for out, inp in _layer_shapes(shapes)[:7]]
    panels = [w.view(w.shape[0] // GEMM_PANEL, GEMM_PANEL, w.shape[1]).transpose(1, 2).contiguous() for w in weights]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 512) for w in weights]
    results = []
    for rows in row_counts:
        inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
        native = lambda: [gemm(inputs[w.shape[1]], p, w.shape[0]) for w, p in zip(weights, panels)]  # noqa: E731
        onednn = lambda: [torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], p, None, "none", [], "")  # noqa: E731
                          for w, p in zip(weights, packed)]
        same = all(torch.equal(a, b) for a, b in zip(native(), onednn()))
        ours, theirs = best_of(shapes.repeats, native, onednn)
        results.append((f"7 linears of a layer, {rows} rows: native prefill GEMM vs oneDNN packed "
                        f"({'the same' if same else 'other'} bits)", ours, theirs))
    return results


def prefill_layouts(shapes: Shapes) -> tuple[tuple[tuple[int, int], ...], ...]:
    """A W1 prefill step (six fresh 277-token chunks, one continuing after 100), one 2048-token chunk."""
    if shapes is QUICK:
        return (((20, 20), (20, 20), (10, 30)), ((100, 100),))
    return ((277, 277),) * 6 + ((177, 277),), ((2048, 2048),)


def render(rows: list[tuple[str, float, float | None]], header: str) -> str:
    lines = [header, "", "| kernel | ours (ms) | reference (ms) | reference / ours |", "|---|---:|---:|---:|"]
    for name, ours, theirs in rows:
        reference = "—" if theirs is None else f"{theirs * 1000:.2f}"
        ratio = "—" if theirs is None else f"{theirs / ours:.2f}×"
        lines.append(f"| {name} | {ours * 1000:.2f} | {reference} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes: checks the script, not the speed")
    args = parser.parse_args(argv)
    shapes = QUICK if args.quick else FULL
    rows = (linear_rows(shapes, (1, 8, 16)) + coded_rows(shapes, (1, 8, 32)) + narrow_rows(shapes, (1, 8, 32))
            + screen_rows(shapes, (1, 8, 32)) + codes_screen_rows(shapes, (1, 8, 32)) + half_screen_rows(shapes, (1, 8))
            + attention_rows(shapes, (1, 8)) + prefill_attention_rows(shapes, prefill_layouts(shapes))
            + argmax_rows(shapes, (1, 8))
            + prefill_gemm_rows(shapes, (40, 100) if shapes is QUICK else (256, 1785)))
    header = (f"Kernel benchmark ({'quick' if args.quick else 'full'}): {cpu_name()}, "
              f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, random weights.")
    print(render(rows, header))


if __name__ == "__main__":
    main()
