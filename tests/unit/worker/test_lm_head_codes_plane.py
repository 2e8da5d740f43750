"""The LM head screen's one-row pass from a 4-bit plane of the head's codes (codes_plane.py,
native/codes_screen_plane.c; LM_HEAD_SCREEN_PLANE): the plane holds each code's high nibble where
the kernel reads it; the kernel's upper values are never below what the full codes kernel gives
(float64 reference, extreme rows), and not vacuous; the full kernel over listed panels gives the
whole pass's bits there and writes nothing else; a screen reading the plane draws exactly what it
draws without it (ties, near ties, top-k, softcap, non-finite rows); the loader builds the plane
only when asked; the setting."""

from __future__ import annotations

import platform
import shutil
from pathlib import Path

import pytest
import torch

from services.worker.engine.config import EngineConfig
from common.settings.env import SettingsError
from services.worker.engine.cpu.kernels.native_build import default_cache_dir
from services.worker.engine.cpu.linear.weight_codes import CodedWeight, NativeCodedLinear
from services.worker.engine.cpu.screen.codes_plane import CodesPlane, build_plane
from services.worker.engine.cpu.screen.int8_matmul import PANEL, NativeInt8Matmul
from services.worker.engine.cpu.screen.lm_head_screen import LMHeadScreen
from services.worker.engine.cpu.screen.screen_loader import ScreenLoader
from services.worker.settings import WorkerSettings
# The codes screen's tests' kernels (`coder`, `native`) serve these as fixtures too.
from tests.unit.worker.test_lm_head_codes_screen import DUPLICATES, PATHS, _build, _cpu_flags, coder, native, q8_head
from tests.unit.worker.test_lm_head_screen import hidden_states

__all__ = ["coder", "native"]      # used as fixtures


@pytest.fixture(scope="module")
def half_head(coder: NativeCodedLinear) -> tuple[torch.Tensor, CodedWeight]:
    weight, coded = q8_head(coder)
    half = coded.half_form()
    assert half is not None and half.half
    return weight, half


def random_half_codes(vocab: int, in_features: int, group: int, seed: int, low: int | None = None) -> CodedWeight:
    """Codes, half scales (either sign, a wide range) and byte zeros at random, padded past V;
    with `low`, every code's low nibble that and every scale positive, so that against a row of
    one sign the plane's error is as large as its bound."""
    generator = torch.Generator().manual_seed(seed)
    panels = -(-vocab // PANEL)
    codes = torch.randint(0, 256, (panels, in_features, PANEL), generator=generator, dtype=torch.uint8)
    if low is not None:
        codes = (codes & 0xF0) | low
    scales = (torch.randn(panels, in_features // group, PANEL, generator=generator)
              * 2.0 ** torch.randint(-12, 4, (panels, in_features // group, PANEL), generator=generator)).half()
    zeros = torch.randint(0, 256, (panels, in_features // group, PANEL), generator=generator, dtype=torch.uint8)
    if low is not None:
        scales = scales.abs()
    pad = slice(vocab - (panels - 1) * PANEL, PANEL)
    codes[-1, :, pad], scales[-1, :, pad], zeros[-1, :, pad] = 0, 0.0, 0
    return CodedWeight(codes, scales, None, group, vocab, in_features, 8, zeros)


def int16_rows(count: int, in_features: int, seed: int) -> list[torch.Tensor]:
    """Rows as the screen rounds them (|q| <= 16383), the extremes among them."""
    generator = torch.Generator().manual_seed(seed)
    rows = [torch.randint(-16383, 16384, (in_features,), generator=generator, dtype=torch.int16)
            for _ in range(count)]
    return [torch.full((in_features,), 16383, dtype=torch.int16),
            torch.full((in_features,), -16383, dtype=torch.int16), *rows]


def full_and_room(coded: CodedWeight, q: torch.Tensor, x_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """In float64, per token: the full kernel's value x_scale sum_b s (U - zero X) and the plane's
    error term x_scale sum_b |s| 7.5 A."""
    ids = torch.arange(coded.out_features)
    panel, lane = ids // PANEL, ids % PANEL
    blocks = coded.in_features // coded.group
    codes = coded.codes[panel, :, lane].double().view(-1, blocks, coded.group)
    scales, zeros = coded.scales[panel, :, lane].double(), coded.zeros[panel, :, lane].double()
    x = q.double().view(blocks, coded.group)
    full = (scales * ((codes * x).sum(-1) - zeros * x.sum(-1))).sum(-1) * x_scale
    room = (scales.abs() * 7.5 * x.abs().sum(-1)).sum(-1) * x_scale
    return full, room


# ---- the plane and its kernel ----------------------------------------------------------------

def test_the_plane_holds_each_high_nibble_where_the_kernel_reads_it() -> None:
    coded = random_half_codes(70, 48, 16, seed=1)
    plane = build_plane(coded)
    assert plane.shape == (3, 24, 32) and plane.dtype == torch.uint8
    for p in range(3):
        for i in range(48):
            for row in range(PANEL):
                byte = int(plane[p, i // 2, 2 * (row % 16) + i % 2])
                nibble = byte & 15 if row < 16 else byte >> 4
                assert nibble == int(coded.codes[p, i, row]) >> 4


@pytest.mark.parametrize("low", [None, 0, 15], ids=["random", "low nibbles 0", "low nibbles 15"])
@pytest.mark.parametrize("vocab,in_features,group", [(301, 64, 32), (64, 640, 32), (33, 48, 16), (4093, 96, 32)])
def test_upper_values_are_never_below_the_full_kernels_and_not_vacuous(native: NativeInt8Matmul,
                                                                       vocab: int, in_features: int,
                                                                       group: int, low: int | None) -> None:
    coded = random_half_codes(vocab, in_features, group, seed=vocab, low=low)
    plane = CodesPlane(native.library, coded)
    panels = -(-vocab // PANEL)
    for q in int16_rows(4, in_features, seed=in_features):
        x_scale = 0.37
        upper = torch.full((panels * PANEL,), 12345.0)
        maxima = torch.empty(panels)
        plane.upper(q, x_scale, upper, maxima)
        full, room = full_and_room(coded, q, x_scale)
        assert (upper[:vocab].double() >= full).all()
        # At most twice the plane's error bound, with its room for rounding (~4 % of it at most).
        assert (upper[:vocab].double() - full <= 2.05 * room + 1e-9 * room.max()).all()
        assert (upper[vocab:] == 12345.0).all(), "nothing past the vocabulary"
        assert torch.equal(maxima, torch.stack([upper[p * PANEL:min((p + 1) * PANEL, vocab)].max()
                                                for p in range(panels)]))


@pytest.mark.skipif(platform.machine() != "x86_64" or not (shutil.which("cc") or shutil.which("gcc")),
                    reason="the other paths are built for x86-64")
def test_every_path_bounds_from_above(tmp_path: Path) -> None:
    """AVX-512 without VNNI, AVX2 and the scalar path (plain C) keep the same bound."""
    coded = random_half_codes(301, 96, 32, seed=8, low=15)
    for number, march in enumerate(m for m, needs in PATHS.items() if needs <= _cpu_flags()):
        kernel = _build([march], tmp_path / f"plane_{number}.so")
        assert bool(kernel.library.fairserve_codes_plane_fast()) == (march != "-march=x86-64")
        plane = CodesPlane(kernel.library, coded)
        for q in int16_rows(2, 96, seed=number):
            upper, maxima = torch.empty(10 * PANEL), torch.empty(10)
            plane.upper(q, 1.5, upper, maxima)
            full, room = full_and_room(coded, q, 1.5)
            assert (upper[:301].double() >= full).all(), march
            assert (upper[:301].double() - full <= 2.05 * room + 1e-9 * room.max()).all(), march


def test_the_full_kernel_over_listed_panels_gives_the_whole_pass_there_and_nothing_else(
        native: NativeInt8Matmul, half_head: tuple[torch.Tensor, CodedWeight]) -> None:
    coded = half_head[1]
    plane = CodesPlane(native.library, coded)
    x = hidden_states(1, seed=3)
    quantized = native.screen_quantize(x, 16383)
    assert quantized is not None
    panels = -(-coded.out_features // PANEL)
    whole_maxima = torch.empty(1, panels)
    whole = native.codes_screen(coded, quantized.q, quantized.scale, whole_maxima)
    listed = torch.tensor([0, 7, panels - 1, 100])
    out = torch.full((1, coded.out_features), 7.0)
    maxima = torch.full((1, panels), 7.0)
    plane.full_panels(quantized, listed, out, maxima)
    for p in range(panels):
        tokens = slice(p * PANEL, min((p + 1) * PANEL, coded.out_features))
        if p in listed.tolist():
            assert torch.equal(out[0, tokens], whole[0, tokens]) and maxima[0, p] == whole_maxima[0, p]
        else:
            assert (out[0, tokens] == 7.0).all() and maxima[0, p] == 7.0
    with pytest.raises(ValueError, match="out of range"):
        plane.full_panels(quantized, torch.tensor([panels]), out, maxima)


def test_the_plane_is_not_built_for_codes_its_kernel_does_not_read(native: NativeInt8Matmul,
                                                                  half_head: tuple[torch.Tensor, CodedWeight],
                                                                  coder: NativeCodedLinear) -> None:
    float_form = q8_head(coder)[1]
    assert not float_form.half and CodesPlane.create(native, float_form) is None
    odd_group = random_half_codes(40, 36, 6, seed=2)
    assert CodesPlane.create(native, odd_group) is None


# ---- the screen with the plane ----------------------------------------------------------------

def screens(native: NativeInt8Matmul, coded: CodedWeight,
            softcap: float | None = None) -> tuple[LMHeadScreen, LMHeadScreen]:
    plain = LMHeadScreen.from_codes(coded, softcap, native, "int16")
    with_plane = LMHeadScreen.from_codes(coded, softcap, native, "int16")
    assert plain is not None and with_plane is not None
    with_plane.use_plane(CodesPlane(native.library, coded))
    return plain, with_plane


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("count", [1, 5, 64])
def test_a_screen_reading_the_plane_gives_the_same_best_logits(native: NativeInt8Matmul,
                                                               half_head: tuple[torch.Tensor, CodedWeight],
                                                               seed: int, count: int) -> None:
    weight, coded = half_head
    plain, with_plane = screens(native, coded)
    x = hidden_states(1, seed=seed, massive=[1.0, 50.0, 500.0][seed % 3])
    if seed == 0:
        x[0] = weight[0] * 40                      # row 0's copies tie for the best
    if seed == 1:
        x[0] = weight[DUPLICATES + 7] * 40         # near ties
    expected = plain.logits(x, [count], [[]])
    assert expected is not None
    expected = expected.clone()
    got = with_plane.logits(x, [count], [[]])
    assert got is not None
    full = x @ weight.T
    best = full[0].topk(count)
    assert set(got[0].topk(count).indices.tolist()) == set(best.indices.tolist())
    torch.testing.assert_close(got[0, best.indices], best.values, rtol=1e-5, atol=1e-4)
    assert torch.equal(got[0, best.indices], expected[0, best.indices]), "the same exact logits, bit for bit"
    if seed == 0:
        ties = full[0] == full[0].max()
        assert int(ties.sum()) > 1 and bool(torch.isfinite(got[0][ties]).all()), "every tie got its exact logit"


def test_wider_steps_and_softcapped_heads_and_non_finite_rows(native: NativeInt8Matmul,
                                                              half_head: tuple[torch.Tensor, CodedWeight]) -> None:
    weight, coded = half_head
    plain, with_plane = screens(native, coded, softcap=30.0)
    x = hidden_states(3, seed=9) / 20
    wide = with_plane.logits(x, [1, 2, 3], [[]] * 3)          # rows > 1: the codes, as without the plane
    assert wide is not None
    expected = plain.logits(x, [1, 2, 3], [[]] * 3)
    assert expected is not None and torch.equal(wide, expected)
    one = with_plane.logits(x[:1], [1], [[]])
    assert one is not None
    assert int(one.argmax()) == int((torch.tanh((x[:1] @ weight.T) / 30.0) * 30.0).argmax())
    bad = x[:1].clone()
    bad[0, 5] = float("inf")
    assert with_plane.logits(bad, [1], [[]]) is None, "a non-finite row takes the full head"


def test_use_plane_refuses_a_plane_of_other_codes(native: NativeInt8Matmul,
                                                  half_head: tuple[torch.Tensor, CodedWeight]) -> None:
    screen = LMHeadScreen.from_codes(half_head[1], None, native, "int16")
    assert screen is not None
    with pytest.raises(ValueError, match="same codes"):
        screen.use_plane(CodesPlane(native.library, random_half_codes(64, 64, 32, seed=4)))


# ---- the loader and the setting -------------------------------------------------------------

@pytest.mark.parametrize("asked", [True, False])
def test_the_loader_builds_the_plane_only_when_asked(half_head: tuple[torch.Tensor, CodedWeight],
                                                     native: NativeInt8Matmul, asked: bool) -> None:
    weight, coded = half_head
    config = EngineConfig(model_dir="", lm_head_screen="on", lm_head_screen_activations="int16",
                          lm_head_screen_plane=asked)
    loader = ScreenLoader(config, None, default_cache_dir(), True)
    head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    head.weight = None
    loader.start(head, torch.device("cpu"), torch.float32, weight, coded)
    assert loader.wait(timeout=0) and loader.screen is not None
    fast = bool(native.library.fairserve_codes_plane_fast())
    assert (loader.screen._plane is not None) == (asked and fast)
    x = hidden_states(1, seed=2)
    assert int(loader.screen.logits(x, [1], [[]]).argmax()) == int((x @ weight.T).argmax())


def test_the_setting_is_off_by_default_and_named_when_wrong() -> None:
    assert WorkerSettings.from_env({}).engine.lm_head_screen_plane is False
    assert WorkerSettings.from_env({"LM_HEAD_SCREEN_PLANE": "true"}).engine.lm_head_screen_plane is True
    with pytest.raises(SettingsError, match="LM_HEAD_SCREEN_PLANE"):
        WorkerSettings.from_env({"LM_HEAD_SCREEN_PLANE": "sometimes"})
