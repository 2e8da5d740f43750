"""The LM head screen from 8-bit codes with int8 activations (codes_screen_int8.py, the C
kernel fairserve_codes_screen_quads in native/codes_screen_quads.c): the kernel against a
float64 reference within its rounding bound on every tile and padding shape, the block
rounding, greedy and top-k over screened rows against the full float32 logits, the check at
build, and how the activations are chosen (by setting, or timed)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import torch

from services.worker.engine.config import EngineConfig
from services.worker.engine.cpu.screen import codes_screen_int8
from services.worker.engine.cpu.screen.codes_screen_int8 import (INT8_GRID, check_rows, faster_activations,
                                                          int8_available, quantize_blocks)
from services.worker.engine.cpu.screen.int8_matmul import PANEL, QUADS_TILE, NativeInt8Matmul
from services.worker.engine.cpu.screen.lm_head_screen import LMHeadScreen, load_native_matmul
from services.worker.engine.cpu.kernels.native_build import default_cache_dir
from services.worker.engine.cpu.linear.weight_codes import CodedWeight, NativeCodedLinear
from tests.unit.worker.test_lm_head_codes_screen import (DUPLICATES, VOCAB, coder, expanded, head, loaded,  # noqa: F401
                                                         narrow_codes, native, random_codes)
from tests.unit.worker.test_lm_head_screen import assert_draws_match, hidden_states

U = 2.0 ** -24


@pytest.fixture(scope="module", autouse=True)
def _int8_kernel(native: NativeInt8Matmul) -> None:  # noqa: F811
    if not native.has_codes_quads:
        pytest.skip("the int8 codes kernel needs AVX-512 VNNI and VBMI")


@pytest.fixture(scope="module")
def screen(head: tuple[torch.Tensor, CodedWeight], native: NativeInt8Matmul) -> LMHeadScreen:  # noqa: F811
    built = LMHeadScreen.from_codes(head[1], None, native, "int8")
    assert built is not None, "the int8 codes kernel failed its check against float64"
    assert built.kernel == "codes" and built.activations == "int8" and built.weight is None
    return built


def within_kernel_bound(coded: CodedWeight, x: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> bool:
    """|out - q(x) @ w.T| <= (2B + 4) u (1 + 1e-3) sum_i alpha_i |q(x)_i| entrywise, q(x) the
    int8 rows times their block scales (codes_screen_bound.codes_error_norms)."""
    weights, alpha = expanded(coded)
    rows = len(x)
    scaled = (x.double().view(rows, -1, coded.group) * scales.double()[..., None]).view(rows, -1)
    blocks = coded.in_features // coded.group
    allowed = (2 * blocks + 4) * U * 1.001 * (scaled.abs() @ alpha.T)
    return bool(((out.double() - scaled @ weights.T).abs() <= allowed).all())


# ---- the kernel ---------------------------------------------------------------------------

@pytest.mark.parametrize("rows", [1, 2, 3, 5, QUADS_TILE, QUADS_TILE + 1, 2 * QUADS_TILE + 3, 30])
@pytest.mark.parametrize("vocab,in_features,group", [(301, 64, 32), (64, 640, 32), (33, 48, 16), (70, 32, 16),
                                                     (40, 24, 4)])
def test_the_int8_kernel_is_within_its_rounding_bound(native: NativeInt8Matmul, rows: int, vocab: int,  # noqa: F811
                                                      in_features: int, group: int) -> None:
    coded = random_codes(vocab, in_features, group, seed=rows + vocab)
    x, scales = check_rows(max(rows, 3), in_features, group, torch.Generator().manual_seed(rows))
    x, scales = x[:rows], scales[:rows]
    maxima = torch.empty(rows, -(-vocab // PANEL))
    out = native.codes_screen_quads(coded, x, scales, maxima)
    assert out.shape == (rows, vocab)
    assert within_kernel_bound(coded, x, scales, out)
    padded = torch.nn.functional.pad(out, (0, maxima.shape[1] * PANEL - vocab), value=float("-inf"))
    assert torch.equal(maxima, padded.view(rows, -1, PANEL).amax(dim=-1))


def test_the_int8_kernel_writes_nothing_past_the_vocabulary(native: NativeInt8Matmul) -> None:  # noqa: F811
    coded = random_codes(40, 32, 32, seed=3)
    x, scales = check_rows(3, 32, 32, torch.Generator().manual_seed(3))
    out = native.codes_screen_quads(CodedWeight(coded.codes, coded.scales, coded.offsets, 32, 33, 32), x, scales)
    assert torch.equal(out, native.codes_screen_quads(coded, x, scales)[:, :33])


def test_the_int8_kernel_refuses_what_it_does_not_take(native: NativeInt8Matmul,  # noqa: F811
                                                       coder: NativeCodedLinear) -> None:  # noqa: F811
    coded = random_codes(64, 64, 32, seed=1)
    with pytest.raises(ValueError, match="32 entries"):
        native.codes_screen_quads(coded, torch.zeros(2, 32, dtype=torch.int8), torch.ones(2, 2))
    with pytest.raises(ValueError, match="int8"):
        native.codes_screen_quads(coded, torch.zeros(2, 64, dtype=torch.int16), torch.ones(2, 2))
    with pytest.raises(ValueError, match="scales"):
        native.codes_screen_quads(coded, torch.zeros(2, 64, dtype=torch.int8), torch.ones(2))
    with pytest.raises(ValueError, match="group 6"):
        native.codes_screen_quads(random_codes(40, 36, 6, seed=1), torch.zeros(2, 36, dtype=torch.int8),
                                  torch.ones(2, 6))
    with pytest.raises(ValueError, match="4-bit"):
        native.codes_screen_quads(narrow_codes(coder, 64, 64), torch.zeros(2, 64, dtype=torch.int8),
                                  torch.ones(2, 2))


def test_block_rounding_stays_within_half_a_step_of_each_block() -> None:
    x = hidden_states(5, seed=2, massive=80.0)
    x[4, 32:64] = 0.0                                   # an all-zero block
    xq, scales, residual = quantize_blocks(x, 32)
    assert xq.dtype == torch.int8 and int(xq.abs().max()) <= INT8_GRID and scales.shape == (5, 2)
    q = (xq.float().view(5, -1, 32) * scales[..., None]).view(5, -1)
    torch.testing.assert_close(q + residual, x, rtol=0, atol=1e-5)
    steps = scales.repeat_interleave(32, dim=1)
    assert bool((residual.abs() <= 0.5001 * steps + 1e-30).all())
    # The massive dimensions (the first 3) set only their own block's step.
    assert float(scales[:, 1].max()) < 0.1 * float(scales[:, 0].min())


# ---- the screen ---------------------------------------------------------------------------

def test_every_approximate_logit_is_within_its_bound(screen: LMHeadScreen,
                                                     head: tuple[torch.Tensor, CodedWeight]) -> None:  # noqa: F811
    weight = head[0]
    for massive in (1.0, 50.0, 500.0):
        x = hidden_states(16, seed=int(massive), massive=massive)
        approx, bound = screen.approximate_with_bound(x)
        exact = x.double() @ weight.double().T
        assert ((exact - approx.double()).abs() <= bound.double()).all()
        assert float(bound.median()) < 0.1 * float(exact.std())       # not vacuous


@pytest.mark.parametrize("seed", range(4))
def test_greedy_picks_the_argmax_of_the_full_logits(screen: LMHeadScreen,
                                                    head: tuple[torch.Tensor, CodedWeight], seed: int) -> None:  # noqa: F811
    weight = head[0]
    x = hidden_states(2 * QUADS_TILE + 1, seed=seed)
    x[0] = weight[0] * 40                       # ties and near ties: row 0's copies
    x[1] = weight[DUPLICATES + 7] * 40
    out = screen.logits(x, [1] * len(x), [[]] * len(x))
    assert out is not None
    full = x @ weight.T
    assert torch.equal(out.argmax(dim=1), full.argmax(dim=1))
    finite = torch.isfinite(out)
    torch.testing.assert_close(out[finite], full[finite], rtol=1e-5, atol=1e-4)
    best = full[0] == full[0].max()
    assert int(best.sum()) > 1 and bool(finite[0][best].all()), "every tie got its exact logit"
    assert int(finite.sum(dim=1).max()) < VOCAB // 10, "the screen kept much of the vocabulary"


def test_top_k_rows_get_the_exact_k_best(screen: LMHeadScreen, head: tuple[torch.Tensor, CodedWeight]) -> None:  # noqa: F811
    weight = head[0]
    x = hidden_states(9, seed=7, massive=80.0)
    counts = [1, 5, 64, 64, 20, 2, 40, 64, 3]
    out = screen.logits(x, counts, [[]] * len(x))
    assert out is not None
    full = x @ weight.T
    for row, count in enumerate(counts):
        expected, got = full[row].topk(count), out[row].topk(count)
        assert set(got.indices.tolist()) == set(expected.indices.tolist())
        torch.testing.assert_close(got.values, expected.values, rtol=1e-5, atol=1e-4)


def test_draws_over_screened_rows_equal_draws_over_full_rows(screen: LMHeadScreen,
                                                             head: tuple[torch.Tensor, CodedWeight]) -> None:  # noqa: F811
    assert_draws_match(screen, head[0], trials=3)


def test_the_check_rejects_an_int8_kernel_off_its_bound(head: tuple[torch.Tensor, CodedWeight],  # noqa: F811
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = load_native_matmul(default_cache_dir())       # an instance of its own to break
    assert kernel is not None

    def off(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def kernel_off(*args, **kwargs) -> torch.Tensor:
            out = original(*args, **kwargs)
            if out.shape[0] > QUADS_TILE + 1:      # the checks' passes of many rows (not the 1-row ones)
                out[QUADS_TILE + 1, 100] += float(out.abs().max()) * 1e-3     # one output, in the second tile
            return out
        return kernel_off

    monkeypatch.setattr(kernel, "codes_screen_quads", off(kernel.codes_screen_quads))
    # The int16 kernel, checked on its own, screens instead (no int8 copy of the head).
    fallback = LMHeadScreen.from_codes(head[1], None, kernel, "int8")
    assert fallback is not None and fallback.activations == "int16" and fallback.kernel == "codes"
    monkeypatch.setattr(kernel, "codes_screen", off(kernel.codes_screen))
    assert LMHeadScreen.from_codes(head[1], None, kernel, "int8") is None


# ---- choosing the activations --------------------------------------------------------------

def test_auto_keeps_the_kernel_that_ran_faster(head: tuple[torch.Tensor, CodedWeight],  # noqa: F811
                                               native: NativeInt8Matmul,  # noqa: F811
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter(range(10**6))
    slow = {"int16": 1, "int8": 5}                # seconds each call takes on the fake clock

    def fake_clock() -> float:
        return float(next(clock))

    calls: list[str] = []
    monkeypatch.setattr(codes_screen_int8.time, "perf_counter", fake_clock)
    original_int16, original_int8 = native.codes_screen, codes_screen_int8.approximate

    def int16(*args, **kwargs) -> torch.Tensor:
        calls.append("int16")
        for _ in range(slow["int16"] - 1):
            next(clock)
        return original_int16(*args, **kwargs)

    def int8(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append("int8")
        for _ in range(slow["int8"] - 1):
            next(clock)
        return original_int8(*args, **kwargs)

    monkeypatch.setattr(native, "codes_screen", int16)
    monkeypatch.setattr(codes_screen_int8, "approximate", int8)
    assert faster_activations(native, head[1]) == "int16"
    assert calls == ["int16", "int8"] * codes_screen_int8.PICK_ROUNDS
    slow.update(int16=7)
    assert faster_activations(native, head[1]) == "int8"


def test_int8_falls_back_to_int16_where_its_kernel_does_not_run(head: tuple[torch.Tensor, CodedWeight],  # noqa: F811
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    kernel = load_native_matmul(default_cache_dir())
    assert kernel is not None
    monkeypatch.setattr(kernel, "has_codes_quads", False)
    assert not int8_available(kernel, head[1])
    assert faster_activations(kernel, head[1]) == "int16"
    with caplog.at_level(logging.WARNING):
        screen = LMHeadScreen.from_codes(head[1], None, kernel, "int8")
    assert screen is not None and screen.activations == "int16"
    assert "no int8 kernel" in caplog.text
    with pytest.raises(ValueError, match="int4"):
        LMHeadScreen.from_codes(head[1], None, kernel, "int4")


def test_the_loader_takes_the_activations_setting(head: tuple[torch.Tensor, CodedWeight]) -> None:  # noqa: F811
    weight, coded = head
    for activations in ("int8", "int16"):
        screen = loaded(weight, coded, activations=activations).screen
        assert screen is not None and screen.kernel == "codes" and screen.activations == activations
        x = hidden_states(3, seed=4)
        assert torch.equal(screen.logits(x, [1] * 3, [[]] * 3).argmax(dim=1), (x @ weight.T).argmax(dim=1))
    assert loaded(weight, coded, activations="auto").screen.activations in ("int8", "int16")
    with pytest.raises(ValueError, match="LM_HEAD_SCREEN_ACTIVATIONS"):
        loaded(weight, coded, activations="int4")
    assert EngineConfig(model_dir="").lm_head_screen_activations == "auto"
