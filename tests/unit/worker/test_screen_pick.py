"""The LM head screen's C path around its kernel (native/screen_pick.c): rows rounded for the
int16 kernel as torch rounds them, with norms that bound theirs; the pick keeps every token
that can be among a row's k best, with the exact logits' bits; screened rows without adjusted
tokens take it and others keep the torch path; and its refusals (non-finite rows, past its
capacity, counts out of range)."""

from __future__ import annotations

import pytest
import torch

from services.worker.engine.cpu.screen.int8_matmul import PANEL, PickScratch, NativeInt8Matmul
from services.worker.engine.cpu.screen.lm_head_screen import INT16_GRID, LMHeadScreen
from services.worker.engine.cpu.linear.weight_codes import CodedWeight, NativeCodedLinear
from tests.unit.worker.test_lm_head_codes_screen import (DUPLICATES, coder, head, native,  # noqa: F401 (fixtures)
                                                          q8_head, screen)
from tests.unit.worker.test_lm_head_screen import hidden_states


def exact_logits(native: NativeInt8Matmul, coded: CodedWeight, x: torch.Tensor) -> torch.Tensor:
    """[rows, V] exact float32 logits of every token, as the screen computes a candidate's."""
    rows, vocab = x.shape[0], coded.out_features
    pairs_rows = torch.arange(rows).repeat_interleave(vocab)
    ids = torch.arange(vocab).repeat(rows)
    return native.codes_gather_dot(coded, x, pairs_rows, ids).view(rows, vocab)


# ---- rounding ---------------------------------------------------------------------------------

@pytest.mark.parametrize("massive", [1.0, 50.0, 1e4])
def test_rows_are_rounded_as_torch_rounds_them_with_norms_that_bound_theirs(native: NativeInt8Matmul,
                                                                            massive: float) -> None:
    x = hidden_states(5, seed=2, massive=massive)
    x[4] = 0.0                                           # an all-zero row: the scale's floor
    quantized = native.screen_quantize(x, INT16_GRID)
    assert quantized is not None
    scale = (x.abs().amax(dim=1) / INT16_GRID).clamp_min(1e-30)
    rounded = (x / scale[:, None]).round().clamp(-INT16_GRID, INT16_GRID)
    assert torch.equal(quantized.scale, scale)
    assert torch.equal(quantized.q, rounded.to(torch.int16))
    residual = (x.double() - rounded.double() * scale.double()[:, None]).norm(dim=1)
    norms = x.double().norm(dim=1)
    assert (quantized.norms.double() >= norms).all() and (quantized.norms.double() <= norms * (1 + 1e-5)).all()
    assert (quantized.activation_error.double() >= residual).all()
    assert (quantized.activation_error.double() <= residual * 1.001 + norms * 2.0 ** -21 + 1e-29).all()


def test_a_row_that_is_not_finite_is_refused(native: NativeInt8Matmul) -> None:
    for bad in (float("nan"), float("inf"), float("-inf")):
        x = hidden_states(3, seed=4)
        x[2, 7] = bad
        assert native.screen_quantize(x, INT16_GRID) is None


# ---- the pick ---------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(3))
def test_every_token_that_can_be_among_the_k_best_gets_its_exact_logit(
        screen: LMHeadScreen, head: tuple[torch.Tensor, CodedWeight], native: NativeInt8Matmul, seed: int) -> None:
    coded = head[1]
    counts = [1, 1, 64, 3, 1, 17, 2]
    x = hidden_states(len(counts), seed=seed)
    x[0] = head[0][0] * 40                     # row 0's copies and near copies: ties at the top
    out = screen.logits(x, counts, [[]] * len(counts))
    assert out is not None
    exact = exact_logits(native, coded, x)
    finite = torch.isfinite(out)
    assert torch.equal(out[finite], exact[finite]), "the exact logits' bits"
    assert (out[~finite] == float("-inf")).all()
    for row, count in enumerate(counts):
        kth = exact[row].topk(count).values[-1]
        assert bool(finite[row][exact[row] >= kth].all()), f"row {row}: a token of the {count} best left out"
    assert int(finite[0].sum()) > DUPLICATES, "every tie of row 0 kept"
    assert int(finite.sum(dim=1).max()) < coded.out_features // 20, "the bound kept much of the vocabulary"


def test_the_pick_keeps_the_tokens_the_bound_keeps_and_no_others(screen: LMHeadScreen,
                                                                  native: NativeInt8Matmul) -> None:
    """Finite: each row's k best approximate tokens, and every token whose approximate logit
    plus its bound (the torch path's, approximate_with_bound) reaches the least exact logit of
    those k."""
    counts = [1, 5, 64, 1, 3]
    x = hidden_states(len(counts), seed=9, massive=80.0)
    x[0], x[1] = screen._coded.rows(torch.tensor([0, DUPLICATES + 7])) * 40     # near ties within the bound
    picked = screen.logits(x, counts, [[]] * len(counts))
    assert picked is not None
    approx, bound = screen.approximate_with_bound(x)
    exact = exact_logits(native, screen._coded, x)
    for row, count in enumerate(counts):
        best = approx[row].topk(count).indices
        threshold = exact[row, best].min()
        expected = approx[row].double() + bound[row].double() >= threshold.double()
        expected[best] = True
        assert torch.equal(torch.isfinite(picked[row]), expected), f"row {row}"
    assert int(torch.isfinite(picked[0]).sum()) > DUPLICATES + 1, "near ties kept by their bound alone"


def test_rows_without_adjusted_tokens_take_the_pick_and_others_the_torch_path(
        screen: LMHeadScreen, monkeypatch: pytest.MonkeyPatch) -> None:
    x = hidden_states(2, seed=5)
    taken = []
    monkeypatch.setattr(screen, "_approximate", lambda *args: taken.append("torch") or pytest.fail("torch path"))
    assert screen.logits(x, [1, 3], [[], []]) is not None
    monkeypatch.undo()
    original = screen._picked
    monkeypatch.setattr(screen, "_picked", lambda *args: taken.append("pick") or original(*args))
    assert screen.logits(x, [1, 3], [[], [5, 9]]) is not None     # a penalized row: the torch path for all
    assert screen.logits(x, [1, 3], [[], []]) is not None
    assert taken == ["pick"]


def test_a_softcapped_model_gets_capped_values(head: tuple[torch.Tensor, CodedWeight],
                                               native: NativeInt8Matmul) -> None:
    capped = LMHeadScreen.from_codes(head[1], 30.0, native)
    assert capped is not None
    x = hidden_states(3, seed=6)
    out = capped.logits(x, [1, 4, 1], [[]] * 3)
    assert out is not None
    finite = torch.isfinite(out)
    expected = torch.tanh(exact_logits(native, head[1], x) / 30.0) * 30.0
    assert torch.equal(out[finite], expected[finite])


def test_past_its_capacity_the_pick_hands_the_step_to_the_full_head(
        screen: LMHeadScreen, head: tuple[torch.Tensor, CodedWeight], native: NativeInt8Matmul) -> None:
    x = head[0][0:1] * 40                       # ties: more than two exact logits to keep
    quantized = native.screen_quantize(x, INT16_GRID)
    maxima = torch.empty(1, -(-head[1].out_features // PANEL))
    approx = native.codes_screen(head[1], quantized.q, quantized.scale, maxima)
    args = (approx, maxima, [1], x, quantized, screen._bound_norms, head[1])
    assert native.screen_pick(*args, PickScratch(2)) is None
    picked = native.screen_pick(*args, PickScratch(4096))
    assert picked is not None and len(picked.ids) > DUPLICATES
    with pytest.raises(ValueError, match="counts"):
        native.screen_pick(approx, maxima, [0], x, quantized, screen._bound_norms, head[1], PickScratch(64))
    with pytest.raises(ValueError, match="counts"):
        native.screen_pick(approx, maxima, [1, 1], x, quantized, screen._bound_norms, head[1], PickScratch(64))


def test_a_vocabulary_of_few_panels_keeps_the_torch_path_for_wide_top_k(coder: NativeCodedLinear,
                                                                       native: NativeInt8Matmul) -> None:
    _, coded = q8_head(coder, vocab=300, hidden=64, seed=3)     # 10 panels
    small = LMHeadScreen.from_codes(coded, None, native)
    assert small is not None
    assert small._picks_natively([1, 9], [[], []]) and not small._picks_natively([1, 20], [[], []])
    x = hidden_states(2, seed=8)
    out = small.logits(x, [1, 20], [[], []])
    assert out is not None
    exact = exact_logits(native, coded, x)
    kth = exact[1].topk(20).values[-1]
    assert bool(torch.isfinite(out[1][exact[1] >= kth]).all())
    assert torch.equal(out[1].topk(20).values, exact[1].topk(20).values)


def test_the_logits_rows_are_reused_and_rewritten_whole(screen: LMHeadScreen, native: NativeInt8Matmul) -> None:
    """A pick writes its rows over the previous one's: nothing of it is left, and a step of
    more rows gets rows of its own."""
    wide = hidden_states(6, seed=11)
    first = screen.logits(wide, [64] * 6, [[]] * 6)
    narrow = hidden_states(2, seed=12)
    second = screen.logits(narrow, [1, 1], [[]] * 2)
    assert first is not None and second is not None
    assert second.data_ptr() == first.data_ptr(), "the same rows, reused"
    exact = exact_logits(native, screen._coded, narrow)
    kept = torch.isfinite(second)
    assert int(kept.sum()) < 64, "none of the first step's 64-best rows left"
    assert torch.equal(second[kept], exact[kept])
    more = screen.logits(hidden_states(9, seed=13), [1] * 9, [[]] * 9)
    assert more is not None and more.shape[0] == 9
