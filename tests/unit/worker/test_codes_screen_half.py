"""The LM head screen's codes kernel reading half-float scales and byte zeros
(codes_screen_half.py, fairserve_codes_screen_half in native/codes_screen.c): which codes
have them, the same outputs and panel maxima as the float kernel bit for bit on every tile,
padding and vector path, the check that rejects a kernel that differs, and a screen that
reads them giving the same logits."""

from __future__ import annotations

import platform
import shutil
from pathlib import Path

import pytest
import torch

from services.worker.engine.cpu.screen import codes_screen_half
from services.worker.engine.cpu.screen.codes_screen_half import (HalfScales, checked_half_scales, half_kernel_agrees,
                                                          half_scales)
from services.worker.engine.cpu.screen.int8_matmul import CODES_TILE, PANEL, NativeInt8Matmul
from services.worker.engine.cpu.screen.lm_head_screen import INT16_GRID, LMHeadScreen
from services.worker.engine.cpu.linear.weight_codes import CodedWeight, NativeCodedLinear
from tests.unit.worker.test_lm_head_codes_screen import (PATHS, _build, _cpu_flags, coder, extreme_rows,  # noqa: F401
                                                         narrow_codes, native, q8_head)


def half_codes(vocab: int, in_features: int, group: int, seed: int) -> CodedWeight:
    """Random codes whose scales are half floats (normal, subnormal and zero among them) and
    offsets -zero * scale, zero past the vocabulary (as `find` pads them)."""
    generator = torch.Generator().manual_seed(seed)
    panels, blocks = -(-vocab // PANEL), in_features // group
    codes = torch.randint(0, 256, (panels, in_features, PANEL), generator=generator, dtype=torch.uint8)
    scales = (torch.randn(panels, blocks, PANEL, generator=generator) * 0.01).half().float()
    scales.view(-1)[:5] = torch.tensor([0.0, 2.0 ** -24, 3 * 2.0 ** -20, 2.0 ** -14, 60000.0])
    zeros = torch.randint(0, 256, (panels, blocks, PANEL), generator=generator).float()
    zeros.view(-1)[0] = 0
    pad = slice(vocab - (panels - 1) * PANEL, PANEL)
    codes[-1, :, pad], scales[-1, :, pad], zeros[-1, :, pad] = 0, 0.0, 0.0
    return CodedWeight(codes, scales, -zeros * scales, group, vocab, in_features)


# ---- which codes ----------------------------------------------------------------------------

def test_a_q8_0_head_has_half_scales(coder: NativeCodedLinear) -> None:
    _, coded = q8_head(coder)
    half = half_scales(coded)
    assert half is not None
    assert torch.equal(half.scales.float(), coded.scales)
    assert torch.equal(-half.zeros.float() * coded.scales, coded.offsets)
    assert half.scales.is_contiguous() and half.zeros.is_contiguous()


def test_codes_without_them_keep_the_float_scales(coder: NativeCodedLinear) -> None:
    coded = half_codes(70, 64, 32, seed=0)
    assert half_scales(coded) is not None

    def changed(scales: torch.Tensor | None = None, offsets: torch.Tensor | None = None) -> CodedWeight:
        return CodedWeight(coded.codes, coded.scales if scales is None else scales,
                           coded.offsets if offsets is None else offsets, coded.group, 70, 64)

    finer = coded.scales.clone()
    finer.view(-1)[7] = 1.0 + 2.0 ** -20                # not a half float
    assert half_scales(changed(scales=finer)) is None
    fractional = coded.offsets.clone()
    fractional.view(-1)[7] = coded.scales.view(-1)[7] * -2.5      # zero not an integer
    assert half_scales(changed(offsets=fractional)) is None
    positive = coded.offsets.clone()
    positive.view(-1)[7] = coded.scales.view(-1)[7] * 3           # zero -3
    assert half_scales(changed(offsets=positive)) is None
    offset_of_zero_scale = coded.offsets.clone()
    offset_of_zero_scale.view(-1)[0] = 1.0                        # scale 0 at [0]
    assert half_scales(changed(offsets=offset_of_zero_scale)) is None
    infinite = coded.scales.clone()
    infinite.view(-1)[9] = float("inf")
    assert half_scales(changed(scales=infinite)) is None
    assert half_scales(narrow_codes(coder, 64, 64)) is None


# ---- the kernel -----------------------------------------------------------------------------

@pytest.mark.parametrize("rows", [1, 2, 3, 5, CODES_TILE, CODES_TILE + 1, 2 * CODES_TILE + 3])
@pytest.mark.parametrize("vocab,in_features,group", [(301, 64, 32), (64, 640, 32), (33, 48, 16), (70, 32, 16)])
def test_the_half_kernel_gives_the_float_kernels_outputs(native: NativeInt8Matmul, rows: int, vocab: int,
                                                         in_features: int, group: int) -> None:
    coded = half_codes(vocab, in_features, group, seed=rows + vocab)
    half = half_scales(coded)
    assert half is not None
    x, x_scale = extreme_rows(rows, in_features, seed=rows)
    panels = -(-vocab // PANEL)
    maxima = torch.empty(rows, panels), torch.empty(rows, panels)
    expected = native.codes_screen(coded, x, x_scale, maxima[0])
    out = native.codes_screen(coded, x, x_scale, maxima[1], half)
    assert torch.equal(out, expected)
    assert torch.equal(maxima[1], maxima[0])


def test_the_half_kernel_refuses_scales_of_another_layout(native: NativeInt8Matmul) -> None:
    coded = half_codes(64, 64, 32, seed=1)
    half = half_scales(coded)
    x = torch.zeros(2, 64, dtype=torch.int16)
    with pytest.raises(ValueError, match="half scales"):
        native.codes_screen(coded, x, torch.ones(2), None, HalfScales(half.scales.float(), half.zeros))
    with pytest.raises(ValueError, match="half scales"):
        native.codes_screen(coded, x, torch.ones(2), None, half.panels(1))
    with pytest.raises(ValueError, match="half scales"):
        native.codes_screen(coded, x, torch.ones(2), None, HalfScales(half.scales, half.zeros.transpose(1, 2)))


@pytest.mark.skipif(platform.machine() != "x86_64" or not (shutil.which("cc") or shutil.which("gcc")),
                    reason="the other vector paths are built for x86-64")
def test_every_vector_path_gives_the_same_outputs_from_half_scales(native: NativeInt8Matmul, tmp_path: Path) -> None:
    """AVX-512 without VNNI, AVX2 with and without F16C and plain C make the float kernel's
    operations in its order."""
    coded = half_codes(301, 96, 16, seed=5)
    half = half_scales(coded)
    x, x_scale = extreme_rows(2 * CODES_TILE + 3, 96, seed=5)
    expected = native.codes_screen(coded, x, x_scale)
    flags = _cpu_flags()
    paths = {**PATHS, "-mavx2 -mfma": {"avx2", "fma"}}
    runnable = [march for march, needs in paths.items() if needs <= flags]
    assert "-march=x86-64" in runnable
    for number, march in enumerate(runnable):
        kernel = _build(march.split(), tmp_path / f"int8_matmul_{number}.so")
        assert torch.equal(kernel.codes_screen(coded, x, x_scale, None, half), expected), march


# ---- the check and the screen ------------------------------------------------------------------

def test_the_check_rejects_a_half_kernel_that_differs(native: NativeInt8Matmul, coder: NativeCodedLinear) -> None:
    _, coded = q8_head(coder, vocab=5000)
    half = half_scales(coded)
    assert half_kernel_agrees(native, coded, half, INT16_GRID)
    zeros = half.zeros.clone()
    zeros.view(-1)[PANEL * 3 + 1] ^= 1                 # one block's zero of a token the check reads
    assert not half_kernel_agrees(native, coded, HalfScales(half.scales, zeros), INT16_GRID)


def test_the_screen_keeps_half_scales_only_where_they_agree_and_are_faster(
        native: NativeInt8Matmul, coder: NativeCodedLinear, monkeypatch: pytest.MonkeyPatch) -> None:
    _, coded = q8_head(coder, vocab=5000)
    monkeypatch.setattr(codes_screen_half, "half_rows_limit", lambda *args: 2)
    kept = checked_half_scales(native, coded, INT16_GRID)
    assert kept is not None and kept.max_rows == 2
    assert kept.serves(1) and kept.serves(2) and not kept.serves(3)
    monkeypatch.setattr(codes_screen_half, "half_kernel_agrees", lambda *args: False)
    assert checked_half_scales(native, coded, INT16_GRID) is None
    monkeypatch.undo()
    monkeypatch.setattr(codes_screen_half, "half_rows_limit", lambda *args: 0)
    assert checked_half_scales(native, coded, INT16_GRID) is None


@pytest.mark.parametrize("faster_at,limit", [((1, 2, 4, 8), 8), ((1, 2), 2), ((1, 2, 8), 2), ((), 0), ((2, 4), 0)])
def test_half_scales_serve_up_to_the_rows_where_they_were_faster_at_every_count(
        native: NativeInt8Matmul, coder: NativeCodedLinear, monkeypatch: pytest.MonkeyPatch,
        faster_at: tuple[int, ...], limit: int) -> None:
    _, coded = q8_head(coder, vocab=1000)
    timed: list[int] = []

    def timing(calls, rounds):                      # (the float kernel, the half one) -> seconds
        rows = calls[0]().shape[0]
        timed.append(rows)
        return [1.0, 0.5] if rows in faster_at else [1.0, 1.5]

    monkeypatch.setattr(codes_screen_half, "best_alternating", timing)
    assert codes_screen_half.half_rows_limit(native, coded, half_scales(coded), INT16_GRID) == limit
    expected = []
    for rows in codes_screen_half.PICK_ROWS:       # timed up to the first count where it was not faster
        expected.append(rows)
        if rows not in faster_at:
            break
    assert timed == expected


def test_a_screen_reading_half_scales_gives_the_same_logits(native: NativeInt8Matmul, coder: NativeCodedLinear,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    weight, coded = q8_head(coder, vocab=3001, hidden=128)
    screens = {}
    for faster in (False, True):
        monkeypatch.setattr(codes_screen_half, "half_rows_limit", lambda *args, faster=faster: 4 if faster else 0)
        screens[faster] = LMHeadScreen.from_codes(coded, None, native)
        assert screens[faster] is not None
    assert screens[True]._half_scales is not None and screens[False]._half_scales is None
    kernels = []                                    # the scales each pass of the screen read
    original = native.codes_screen

    def spy(coded, x, x_scale, maxima=None, half=None, out=None):
        kernels.append((x.shape[0], half is not None))
        return original(coded, x, x_scale, maxima, half, out)

    monkeypatch.setattr(native, "codes_screen", spy)
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(6, 128, generator=generator)
    x[:, 3] *= 50
    counts, adjusted = [1, 1, 64, 3, 1, 2], [[], [5], [], [], [7, 9], []]
    with_half, without = screens[True].logits(x, counts, adjusted), screens[False].logits(x, counts, adjusted)
    assert with_half is not None and torch.equal(with_half, without)
    assert torch.equal(with_half.argmax(dim=1)[[0, 2, 3, 5]], (x @ weight.T).argmax(dim=1)[[0, 2, 3, 5]])
    assert kernels == [(6, False), (6, False)]      # past the half scales' 4 rows: the float kernel
    kernels.clear()
    assert torch.equal(screens[True].logits(x[:3], counts[:3], adjusted[:3]),
                       screens[False].logits(x[:3], counts[:3], adjusted[:3]))
    assert kernels == [(3, True), (3, False)]
