"""Weight codes at their native width (weight_codes.py `narrow`, native/coded_linear.c): codes
that fit in 4, 5 or 6 bits are packed narrow only when unpacking gives every code back, the
coded linear over narrow codes gives the 8-bit codes' outputs bit for bit, and an engine
with narrow codes gives the same logits and tokens as with 8-bit codes."""

from __future__ import annotations

import copy

import pytest
import torch

from services.worker.engine.engine import Engine
from services.worker.engine.config import EngineConfig
from services.worker.engine.cpu import speedups
from services.worker.engine.cpu.linear.narrow_calibration import WidthTimings, time_widths
from services.worker.engine.cpu.kernels.native_build import default_cache_dir
from services.worker.engine.cpu.linear.weight_codes import (PANEL, CodedWeight, NativeCodedLinear, load_coded_linear,
                                                            narrow_stride)
from services.worker.wiring import build_engine
from tests.fixtures.tiny_model import build_model
from tests.unit.worker.engine_helpers import CONFIGS, Driver, assert_greedy_matches, prompt_of
from tests.unit.worker.test_weight_codes import coded_weight, snap_to_codes


@pytest.fixture(scope="module")
def kernel() -> NativeCodedLinear:
    coded = load_coded_linear(default_cache_dir())
    assert coded is not None, "the coded linear did not build (is there a C compiler?)"
    return coded


@pytest.mark.parametrize("group,levels,bits", [(32, 16, 4), (32, 2, 4), (32, 32, 5), (16, 64, 6), (32, 17, 5)])
def test_codes_take_the_fewest_bits_that_hold_them(kernel: NativeCodedLinear, group: int, levels: int,
                                                   bits: int) -> None:
    weight = coded_weight(3 * PANEL + 5, 128, group, levels)
    wide = kernel.find(weight)
    assert wide is not None and wide.bits == 8
    narrow = kernel.narrow(wide)
    assert narrow.bits == bits
    assert narrow.codes.shape == (4, 128, narrow_stride(bits))
    assert narrow.nbytes < wide.nbytes
    assert torch.equal(kernel.widen(narrow.codes, bits), wide.codes)
    assert torch.equal(kernel.expand(narrow), weight)
    ids = torch.tensor([0, 15, 16, 31, 32, 47, 3 * PANEL + 4])
    assert torch.equal(narrow.rows(ids), weight[ids])


def test_codes_past_six_bits_stay_bytes(kernel: NativeCodedLinear) -> None:
    wide = kernel.find(coded_weight(PANEL, 64, 32, 256))
    assert wide is not None and int(wide.codes.max()) > 63
    assert kernel.narrow(wide) is wide


@pytest.mark.parametrize("levels", [16, 64])
def test_a_near_grid_is_not_taken(kernel: NativeCodedLinear, levels: int) -> None:
    """One value a float32 step off the grid: no codes at all, so nothing to narrow."""
    weight = coded_weight(PANEL, 64, 32, levels)
    weight[5, 7] = torch.nextafter(weight[5, 7], torch.tensor(1.0))
    assert kernel.find(weight) is None


@pytest.mark.parametrize("levels", [16, 32, 64])
def test_the_narrow_packing_holds_each_bit_where_the_kernel_reads_it(kernel: NativeCodedLinear,
                                                                      levels: int) -> None:
    wide = kernel.find(coded_weight(PANEL, 32, 32, levels, seed=3))
    narrow = kernel.narrow(wide)
    codes, packed = wide.codes[0, 0].to(torch.int64), narrow.codes[0, 0].to(torch.int64)
    assert torch.equal(packed[:16] & 15, codes[:16] & 15)
    assert torch.equal(packed[:16] >> 4, codes[16:] & 15)
    for high in range(narrow.bits - 4):
        word = int.from_bytes(bytes(packed[16 + 4 * high: 20 + 4 * high].tolist()), "little")
        assert [(word >> i) & 1 for i in range(PANEL)] == ((codes >> (4 + high)) & 1).tolist()


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 17, 32])
@pytest.mark.parametrize("group,levels", [(32, 16), (32, 32), (16, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_narrow_codes_give_the_8_bit_outputs_bit_for_bit(kernel: NativeCodedLinear, rows: int, group: int,
                                                         levels: int, with_bias: bool) -> None:
    weight = coded_weight(3 * PANEL + 5, 96, group, levels, seed=rows)
    wide = kernel.find(weight)
    narrow = kernel.narrow(wide)
    assert narrow.bits < 8
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=generator)
    bias = torch.randn(weight.shape[0], generator=generator) if with_bias else None
    ours = kernel(x, narrow, bias)
    assert torch.equal(ours, kernel(x, wide, bias))
    torch.testing.assert_close(ours, torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def _snap_mixed(model: torch.nn.Module) -> None:
    """Layers on 4-, 6- and 8-bit grids, as the default model's Q4_K, Q6_K and Q8_0 blocks."""
    snap_to_codes(model, levels=256)
    for index, layer in enumerate(model.model.layers):
        snap_to_codes(layer.self_attn, levels=16)
        snap_to_codes(layer.mlp, levels=64 if index % 2 else 32)


def _engine(model: torch.nn.Module, **config) -> Engine:
    return build_engine(EngineConfig(model_dir="", num_blocks=128, block_size=4, model_key="narrow", **config),
                        model=copy.deepcopy(model))


def test_an_engine_on_narrow_codes_gives_the_8_bit_logits_and_generates_tokens() -> None:
    reference = build_model(CONFIGS["gemma3"]())
    _snap_mixed(reference)
    narrow, wide = _engine(reference, cpu_weight_codes="narrow"), _engine(reference, cpu_weight_codes="8bit")
    assert narrow.coded_linears == wide.coded_linears > 0
    widths = {linear.coded.bits for linear in _coded_linears(narrow)}
    assert widths >= {4, 5, 6} and {linear.coded.bits for linear in _coded_linears(wide)} == {8}
    prompts = {"a": prompt_of(7, 1), "b": prompt_of(30, 2), "c": prompt_of(3, 3)}
    got_narrow = Driver(narrow).run(prompts, 12, chunk={"b": 9})
    assert got_narrow == Driver(wide).run(prompts, 12, chunk={"b": 9})
    assert_greedy_matches(reference, prompts, got_narrow, 12)
    hidden = torch.randn(2, reference.config.hidden_size)
    for ours, theirs in zip(_coded_linears(narrow), _coded_linears(wide)):
        if ours.coded.in_features == hidden.shape[1]:
            assert torch.equal(ours(hidden), theirs(hidden))


def _coded_linears(engine: Engine) -> list:
    return [module for module in engine.model.modules() if getattr(module, "coded", None) is not None]


@pytest.mark.parametrize("faster", [True, False])
def test_auto_keeps_narrow_codes_where_the_calibration_finds_them_faster(monkeypatch: pytest.MonkeyPatch,
                                                                          faster: bool) -> None:
    calls = []

    def timed(kernel, wide, narrow):
        calls.append((wide, narrow))
        return WidthTimings((1, 32), (2.0, 5.0), (1.0 if faster else 3.0, 5.0))
    monkeypatch.setattr(speedups, "time_widths", timed)
    reference = build_model(CONFIGS["gemma3"]())
    _snap_mixed(reference)
    engine = _engine(reference)
    assert len(calls) == 1
    wide, narrow = calls[0]
    assert {codes.bits for codes in wide} == {8} and {codes.bits for codes in narrow} >= {4, 5, 6}
    widths = {linear.coded.bits for linear in _coded_linears(engine)}
    assert (widths >= {4, 5, 6}) if faster else widths == {8}


def test_auto_times_nothing_where_no_codes_fit_in_fewer_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(speedups, "time_widths", lambda *args: pytest.fail("timed 8-bit codes against themselves"))
    reference = build_model(CONFIGS["gemma3"]())
    snap_to_codes(reference, levels=256)    # codes over the whole byte
    engine = _engine(reference)
    assert {linear.coded.bits for linear in _coded_linears(engine)} == {8}


@pytest.mark.parametrize(("narrow", "keeps"), [
    ((1.0, 5.0), True),                     # faster at one row, even at 32
    ((1.0, 5.09), True),                    # within the tolerance at 32 rows
    ((1.0, 5.2), False),                    # faster at one row, 4 % slower at 32
    ((2.0, 4.0), False),                    # not faster at one row
    ((2.5, 4.0), False),
])
def test_narrow_codes_are_kept_when_faster_at_one_row_and_not_slower_at_the_most_rows(
        narrow: tuple[float, float], keeps: bool) -> None:
    timings = WidthTimings((1, 32), (2.0, 5.0), narrow)
    assert timings.keeps_narrow is keeps
    assert timings.speedups == (2.0 / narrow[0], 5.0 / narrow[1])
    assert timings.describe().startswith("1 row ") and " 32 rows " in timings.describe()


def _random_codes(largest: int, seed: int, out_features: int = 64, in_features: int = 64) -> CodedWeight:
    """8-bit codes of a random matrix whose largest code is `largest`."""
    generator = torch.Generator().manual_seed(seed)
    panels = -(-out_features // PANEL)
    codes = torch.randint(0, largest + 1, (panels, in_features, PANEL), generator=generator, dtype=torch.uint8)
    codes[0, 0, 0] = largest
    scales = torch.rand(panels, in_features // 32, PANEL, generator=generator)
    return CodedWeight(codes, scales, -scales, 32, out_features, in_features)


def test_the_calibration_times_both_widths_at_each_row_count(kernel: NativeCodedLinear,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    wide = [_random_codes(largest, seed) for seed, largest in enumerate((15, 31, 63, 255))]
    narrow = [kernel.narrow(codes) for codes in wide]
    assert narrow[-1] is wide[-1]           # a byte's codes stay as they are: not timed
    seen = []
    timed = kernel.__call__
    monkeypatch.setattr(NativeCodedLinear, "__call__", lambda self, rows, coded, bias: seen.append(
        (rows.shape[0], coded.bits)) or timed(rows, coded, bias))
    timings = time_widths(kernel, wide, narrow, repeats=2, rows=(1, 5))
    assert timings.rows == (1, 5) and len(timings.wide) == len(timings.narrow) == 2
    assert all(seconds > 0 for seconds in (*timings.wide, *timings.narrow))
    assert {(rows, bits) for rows, bits in seen} == {(rows, bits) for rows in (1, 5) for bits in (4, 5, 6, 8)}
    assert sum(1 for rows, bits in seen if bits == 8) == 2 * 3 * 3   # 3 matrices, warm-up + 2 passes, 2 row counts


def test_the_calibration_refuses_nothing_to_time(kernel: NativeCodedLinear) -> None:
    wide = [_random_codes(255, 4)]
    with pytest.raises(ValueError, match="narrower"):
        time_widths(kernel, wide, wide)
