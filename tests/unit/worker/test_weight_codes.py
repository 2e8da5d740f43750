"""Weights that are exact 8-bit codes (weight_codes.py, native/coded_linear.c): found only
where every block gives its float32 values back bit for bit, the coded linear against
torch's, and the engine's tokens with coded weights against transformers' `generate`."""

from __future__ import annotations

import copy

import pytest
import torch

from services.worker.engine.engine import Engine
from services.worker.engine.config import EngineConfig
from services.worker.engine.cpu.linear import cpu_linear
from services.worker.engine.cpu.screen.coded_head import CodedEmbedding
from services.worker.engine.cpu.linear.cpu_linear import PackedLinear, kernel_available
from services.worker.engine.cpu.kernels.native_build import default_cache_dir
from services.worker.engine.cpu.kernels.native_ops import load_skinny_linear
from services.worker.engine.cpu.linear.weight_codes import MAX_ROWS, PANEL, NativeCodedLinear, load_coded_linear
from services.worker.wiring import build_engine
from tests.fixtures.tiny_model import build_model
from tests.unit.worker.engine_helpers import CONFIGS, Driver, assert_greedy_matches, prompt_of


@pytest.fixture(scope="module")
def kernel() -> NativeCodedLinear:
    coded = load_coded_linear(default_cache_dir())
    assert coded is not None, "the coded linear did not build (is there a C compiler?)"
    return coded


def coded_weight(out_features: int, in_features: int, group: int = 32, levels: int = 16,
                 seed: int = 0) -> torch.Tensor:
    """A weight whose every block of `group` inputs is scale * code + offset exactly, as a
    dequantized GGUF block is: scales of 11 significant bits, codes below `levels`, and an
    offset on the block's grid (so both roundings of scale * code + offset are exact)."""
    generator = torch.Generator().manual_seed(seed)
    blocks = in_features // group
    mantissa = torch.randint(1024, 2048, (out_features, blocks, 1), generator=generator).float()
    scale = mantissa * 2.0 ** -18
    codes = torch.randint(0, levels, (out_features, blocks, group), generator=generator).float()
    zero = torch.randint(0, levels, (out_features, blocks, 1), generator=generator).float()
    return (scale * (codes - zero)).reshape(out_features, in_features)


def snap_to_codes(model: torch.nn.Module, levels: int = 16) -> int:
    """Every linear weight of `model` (and the embedding, tied or not) rounded onto a grid of
    `levels` per block of 32 inputs, the way a 4-bit checkpoint dequantizes; returns how many."""
    snapped = 0
    with torch.no_grad():
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if not isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) or weight is None or weight.dim() != 2:
                continue
            out_features, in_features = weight.shape
            if in_features % 32:
                continue
            blocks = weight.view(out_features, in_features // 32, 32)
            lo = blocks.amin(-1, keepdim=True)
            span = (blocks.amax(-1, keepdim=True) - lo).clamp_min(1e-8)
            # A scale of 11 significant bits and an offset on its grid keep every value exact.
            exponent = torch.floor(torch.log2(span / (levels - 1)))
            scale = torch.round(span / (levels - 1) / 2.0 ** (exponent - 10)) * 2.0 ** (exponent - 10)
            zero = torch.round(-lo / scale)
            codes = torch.clamp(torch.round(blocks / scale + zero), 0, levels - 1)
            weight.copy_((scale * (codes - zero)).view(out_features, in_features))
            snapped += 1
    return snapped


@pytest.mark.parametrize("group,levels", [(32, 16), (32, 256), (16, 64)])
def test_codes_give_the_weight_back_bit_for_bit(kernel: NativeCodedLinear, group: int, levels: int) -> None:
    weight = coded_weight(64, 96, group, levels)
    coded = kernel.find(weight)
    assert coded is not None
    assert coded.group == (16 if group == 16 else 32)
    assert torch.equal(kernel.expand(coded), weight)
    assert coded.nbytes < weight.numel() * 4 / 2


def test_blocks_of_16_with_their_own_scales_take_groups_of_16(kernel: NativeCodedLinear) -> None:
    weight = torch.cat([coded_weight(32, 16, 16, seed=seed) for seed in range(4)], dim=1)
    coded = kernel.find(weight)
    assert coded is not None and coded.group == 16
    assert torch.equal(kernel.expand(coded), weight)


def test_codes_found_in_chunks_are_those_of_one_pass(kernel: NativeCodedLinear) -> None:
    """`find` reads a large weight a chunk of rows at a time, straight into the panels: the
    same codes as in one pass, every row read once, in order, where each chunk is handed to
    `after_rows`; a chunk off the grid ends that block size's pass there."""
    weight = coded_weight(5 * PANEL + 7, 64, 32, 256, seed=5)
    whole = kernel.find(weight, chunk_rows=1 << 20)
    chunks: list[tuple[int, int]] = []
    chunked = kernel.find(weight, lambda rows: chunks.append((rows.data_ptr(), rows.shape[0])), chunk_rows=2 * PANEL)
    assert whole is not None and chunked is not None
    for name in ("codes", "scales", "offsets"):
        assert torch.equal(getattr(chunked, name), getattr(whole, name)), name
    assert [count for _, count in chunks] == [2 * PANEL, 2 * PANEL, PANEL + 7]
    assert [address for address, _ in chunks] == [weight.data_ptr() + row * 64 * 4 for row in (0, 2 * PANEL, 4 * PANEL)]
    nudged = weight.clone()
    nudged[2 * PANEL + 1, 3] = torch.nextafter(nudged[2 * PANEL + 1, 3], torch.tensor(1.0))
    chunks.clear()
    assert kernel.find(nudged, lambda rows: chunks.append((rows.data_ptr(), rows.shape[0])), chunk_rows=2 * PANEL) is None
    assert [count for _, count in chunks] == [2 * PANEL] * 4          # groups of 32, then of 16: two chunks each
    with pytest.raises(ValueError):
        kernel.find(weight, chunk_rows=PANEL + 1)


def test_weights_off_the_grid_are_left_alone(kernel: NativeCodedLinear) -> None:
    generator = torch.Generator().manual_seed(3)
    assert kernel.find(torch.randn(64, 64, generator=generator)) is None        # trained-like float32
    weight = coded_weight(64, 64)
    nudged = weight.clone()
    nudged[5, 17] = torch.nextafter(nudged[5, 17], torch.tensor(1.0))          # one value one ulp off
    assert kernel.find(nudged) is None
    with_nan = weight.clone()
    with_nan[0, 0] = float("nan")
    assert kernel.find(with_nan) is None
    too_many = weight.clone()
    too_many[0, :32] = torch.arange(32) * 2.0 ** -10
    too_many[0, 31] = 300 * 2.0 ** -10                                         # 301 levels on one grid
    assert kernel.find(too_many) is None
    assert kernel.find(coded_weight(64, 32)[:, :24].contiguous()) is None      # inputs not in blocks
    assert kernel.find(weight.double()) is None


@pytest.mark.parametrize("codes", [(0, 3, 5), (0, 4, 8, 12), (7,), (0, 255), (2, 9, 13, 200)])
def test_the_grid_is_found_whatever_the_smallest_step(kernel: NativeCodedLinear, codes: tuple) -> None:
    """The search tries the smallest step above the lowest weight first, then Euclid over the
    steps (quick remainders, then exact ones): blocks whose smallest step is several levels,
    whose steps share a factor, constant blocks and a full 8-bit span all come back exact."""
    generator = torch.Generator().manual_seed(len(codes))
    picks = torch.tensor(codes, dtype=torch.float32)[torch.randint(0, len(codes), (32, 64), generator=generator)]
    picks[:, ::32] = codes[0]                                   # every block holds both ends
    picks[:, 1::32] = codes[-1]
    scale = torch.randint(1024, 2048, (32, 2, 1), generator=generator).float() * 2.0 ** -20
    weight = (scale * (picks.view(32, 2, 32) - 3.0)).reshape(32, 64)
    coded = kernel.find(weight)
    assert coded is not None and coded.group == 32
    assert torch.equal(kernel.expand(coded), weight)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 16, 17])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("out_features", [6 * PANEL, 16, 3 * PANEL + 5])
def test_the_coded_linear_matches_torch(kernel: NativeCodedLinear, rows: int, with_bias: bool,
                                        out_features: int) -> None:
    weight = coded_weight(out_features, 640, 32, 32, seed=rows)
    coded = kernel.find(weight)
    assert coded is not None
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 640, generator=generator)
    bias = torch.randn(weight.shape[0], generator=generator) if with_bias else None
    expected = torch.nn.functional.linear(x.double(), weight.double(), bias.double() if with_bias else None)
    torch.testing.assert_close(kernel(x, coded, bias).double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [3, 5, 9, 10, 12, 13, 16, 24, 25, 30, 64])
@pytest.mark.parametrize("narrow", [False, True])
def test_many_rows_give_the_few_row_passes_outputs_bit_for_bit(kernel: NativeCodedLinear, rows: int,
                                                               narrow: bool) -> None:
    """Up to a pass's rows (12 with AVX-512) one pass; to 24 even passes (13 rows: 6 + 7); past
    that each input chunk is expanded once for all rows, and passes take part of the panel: the
    same chain of multiply-adds per output as one row at a time (every code expanded in
    registers) or 8 at a time, so the same bits."""
    weight = coded_weight(3 * PANEL + 5, 208, 16, 32, seed=rows)    # inputs not a whole number of chunks
    coded = kernel.find(weight)
    assert coded is not None
    if narrow:
        coded = kernel.narrow(coded)
        assert coded.bits < 8
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 208, generator=generator)
    bias = torch.randn(weight.shape[0], generator=generator)
    eights = torch.cat([kernel(x[start:start + 8], coded, bias) for start in range(0, rows, 8)])
    ones = torch.cat([kernel(x[row:row + 1], coded, bias) for row in range(rows)])
    assert torch.equal(kernel(x, coded, bias), eights)
    assert torch.equal(eights, ones)


def test_the_coded_linear_rejects_mismatched_rows(kernel: NativeCodedLinear) -> None:
    coded = kernel.find(coded_weight(32, 64))
    with pytest.raises(ValueError):
        kernel(torch.randn(2, 32), coded, None)


def test_a_packed_linear_takes_the_codes_for_few_rows_only(kernel: NativeCodedLinear) -> None:
    linear = torch.nn.Linear(128, 96)
    with torch.no_grad():
        linear.weight.copy_(coded_weight(96, 128))
    packed = PackedLinear(linear)
    skinny = load_skinny_linear(default_cache_dir())
    assert skinny is not None and packed.use_native(skinny, 8)
    assert packed.use_codes(kernel, MAX_ROWS)
    generator = torch.Generator().manual_seed(5)
    for rows in (1, MAX_ROWS, MAX_ROWS + 1, 40):
        x = torch.randn(rows, 128, generator=generator)
        got = packed(x)
        torch.testing.assert_close(got, linear(x), rtol=1e-5, atol=1e-5)
        if rows <= MAX_ROWS:
            assert torch.equal(got, kernel(x, packed.coded, linear.bias))
    plain = PackedLinear(torch.nn.Linear(128, 96))                         # random float32 weights
    assert not plain.use_codes(kernel, MAX_ROWS) and plain.coded is None


@pytest.mark.skipif(not kernel_available("onednn", torch.float32), reason="no oneDNN float32 packs here")
def test_a_coded_layer_drops_its_float32_weight_and_keeps_its_results(kernel: NativeCodedLinear) -> None:
    linear = torch.nn.Linear(128, 96, bias=False)
    with torch.no_grad():
        linear.weight.copy_(coded_weight(96, 128))
    packed = PackedLinear(linear, kernel="onednn")
    assert not packed.drop_float32_weight()                 # no codes yet: the weight serves
    assert packed.use_codes(kernel, MAX_ROWS)
    packed.repack_for_prefill("onednn")
    xs = [torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)) for rows in (1, 32, 33, 300)]
    before = [packed(x) for x in xs]
    assert packed.drop_float32_weight() and packed.weight is None
    assert all(torch.equal(packed(x), expected) for x, expected in zip(xs, before))


def test_a_coded_lm_head_drops_its_pack(kernel: NativeCodedLinear) -> None:
    linear = torch.nn.Linear(128, 96, bias=False)
    with torch.no_grad():
        linear.weight.copy_(coded_weight(96, 128))
    packed = PackedLinear(linear)
    assert not packed.drop_pack()                           # no codes yet: the pack serves
    assert packed.use_codes(kernel, MAX_ROWS) and packed.drop_pack()
    assert packed.packed is None
    for rows in (MAX_ROWS, MAX_ROWS + 1, 300):
        x = torch.randn(rows, 128)
        expected = kernel(x, packed.coded, None) if rows <= MAX_ROWS else linear(x)
        assert torch.equal(packed(x), expected)


def test_codes_give_rows_back_bit_for_bit(kernel: NativeCodedLinear) -> None:
    weight = coded_weight(100, 64, group=16)
    coded = kernel.find(weight)
    assert coded is not None
    ids = torch.tensor([0, 99, 31, 32, 64, 7, 7])
    assert torch.equal(coded.rows(ids), weight[ids])


def test_a_code_only_linear_multiplies_tiles_of_its_codes(kernel: NativeCodedLinear,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_linear, "CODED_TILE_ROWS", 40)               # tiles of 40, 40, 16 rows
    linear = torch.nn.Linear(128, 96)
    with torch.no_grad():
        linear.weight.copy_(coded_weight(96, 128))
    packed = PackedLinear(linear)
    assert not packed.serve_all_rows_from_codes()                     # no codes yet
    assert packed.use_codes(kernel, MAX_ROWS) and packed.drop_pack() and packed.serve_all_rows_from_codes()
    assert packed.weight is None
    for rows in (1, MAX_ROWS + 1, 100):
        x = torch.randn(rows, 128)
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-6, atol=1e-6)


def test_the_tied_embedding_and_head_run_from_codes() -> None:
    reference = build_model(CONFIGS["gemma3"]())
    snap_to_codes(reference)
    engine = _engine(reference, lm_head_screen="on")
    assert isinstance(engine.model.get_input_embeddings(), CodedEmbedding)
    assert engine.prepared.lm_head.weight is None and engine.prepared.lm_head.packed is None
    screen = engine.prepared.screen.screen
    assert screen is not None and screen.weight is None                  # exact logits from the codes
    embedding = reference.get_input_embeddings()
    ids = torch.tensor([[2, 5, 383, 0]])
    assert torch.equal(engine.model.get_input_embeddings()(ids), embedding(ids))
    prompts = {"a": prompt_of(7, 1), "b": prompt_of(30, 2), "c": prompt_of(3, 3)}
    got = Driver(engine).run(prompts, 12, chunk={"b": 9})
    assert_greedy_matches(reference, prompts, got, 12)


def _engine(model: torch.nn.Module, **config) -> Engine:
    return build_engine(EngineConfig(model_dir="", num_blocks=128, block_size=4, model_key="coded", **config),
                        model=copy.deepcopy(model))


@pytest.mark.parametrize("kind", ["gemma3", "llama", "qwen3"])
def test_the_engine_with_coded_weights_gives_generates_tokens(kind: str) -> None:
    reference = build_model(CONFIGS[kind]())
    assert snap_to_codes(reference) > 0
    engine = _engine(reference)
    layers = reference.config.num_hidden_layers
    assert engine.coded_linears >= 7 * layers + 1          # every projection and the LM head
    assert engine.prepared.speedups.dropped_bytes > 0            # copies no path reads are let go
    assert _engine(reference, cpu_weight_codes="off").coded_linears == 0
    assert _engine(reference, cpu_native_kernels="off").coded_linears == 0
    prompts = {"a": prompt_of(7, 1), "b": prompt_of(30, 2), "c": prompt_of(3, 3)}
    got = Driver(engine).run(prompts, 12, chunk={"b": 9})
    assert_greedy_matches(reference, prompts, got, 12)


def test_random_float32_weights_keep_their_kernels() -> None:
    engine = _engine(build_model(CONFIGS["gemma3"]()))
    assert engine.coded_linears == 0


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="CPU weight codes mode"):
        _engine(build_model(CONFIGS["gemma3"]()), cpu_weight_codes="sometimes")
