"""Codes kept in the half form (weight_codes.py: half-float scales and byte zeros instead of
float scales and offsets, the LM head's 42 MB -> 15 MB on the default model): which codes have
it, every kernel that reads it (the coded linear at every row path, the row expansion, the
exact rows, gather_dot, the screen's int16 and int8 kernels, the screen's pick) giving the
float form's outputs bit for bit, the blocked expansion refusing it, and a screen and a tied
embedding served from a head kept so giving the same logits and rows."""

from __future__ import annotations

import pytest
import torch

from services.worker.engine.cpu.linear.cpu_linear import PackedLinear
from services.worker.engine.cpu.screen.coded_head import CodedEmbedding, serve_tied_weight_from_codes
from services.worker.engine.cpu.screen.int8_matmul import NativeInt8Matmul
from services.worker.engine.cpu.screen.codes_screen_int8 import check_rows
from services.worker.engine.cpu.screen.lm_head_screen import LMHeadScreen
from services.worker.engine.cpu.linear.weight_codes import CodedWeight, NativeCodedLinear
from tests.unit.worker.test_codes_screen_half import half_codes
from tests.unit.worker.test_lm_head_codes_screen import coder, native, q8_head, random_codes  # noqa: F401 (fixtures)

VOCAB, HIDDEN = 1001, 128


@pytest.fixture(scope="module")
def forms() -> tuple[CodedWeight, CodedWeight]:
    coded = half_codes(VOCAB, HIDDEN, 32, seed=3)
    half = coded.half_form()
    assert half is not None
    return coded, half


def test_the_half_form_holds_the_same_weights_in_fewer_bytes(forms: tuple[CodedWeight, CodedWeight]) -> None:
    coded, half = forms
    assert half.half and half.offsets is None and half.scales.dtype == torch.float16 and half.zeros is not None
    assert half.codes is coded.codes
    assert half.nbytes < coded.nbytes - coded.scales.numel() * 4
    ids = torch.arange(VOCAB)
    assert torch.equal(half.rows(ids), coded.rows(ids))
    back = half.float_form()
    assert torch.equal(back.scales, coded.scales) and torch.equal(back.offsets, coded.offsets)
    part, half_part = coded.panel_rows(64, 700), half.panel_rows(64, 700)
    assert half_part.half and torch.equal(half_part.rows(torch.arange(636)), part.rows(torch.arange(636)))
    assert half.half_form() is half


def test_codes_off_the_half_grid_have_no_half_form(forms: tuple[CodedWeight, CodedWeight],
                                                   coder: NativeCodedLinear) -> None:
    coded, _ = forms
    finer = coded.scales.clone()
    finer.view(-1)[7] = 1.0 + 2.0 ** -20                      # not a half float
    assert CodedWeight(coded.codes, finer, coded.offsets, 32, VOCAB, HIDDEN).half_form() is None
    off = coded.offsets.clone()
    off.view(-1)[9] += coded.scales.view(-1)[9] / 2           # not -zero * scale
    assert CodedWeight(coded.codes, coded.scales, off, 32, VOCAB, HIDDEN).half_form() is None
    assert random_codes(96, 64, 32, seed=1).half_form() is None     # offsets of random weights
    narrow = coder.narrow(CodedWeight(coded.codes // 16, coded.scales, coded.offsets, 32, VOCAB, HIDDEN))
    assert narrow.bits == 4 and narrow.half_form() is None        # the half form is of 8-bit codes


@pytest.mark.parametrize("rows", [1, 3, 12, 13, 40, 70])
def test_the_coded_linear_gives_the_float_forms_bits(forms: tuple[CodedWeight, CodedWeight],
                                                     coder: NativeCodedLinear, rows: int) -> None:
    coded, half = forms
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(VOCAB, generator=torch.Generator().manual_seed(1))
    assert torch.equal(coder(x, half, None), coder(x, coded, None))
    assert torch.equal(coder(x, half, bias), coder(x, coded, bias))


def test_the_expansions_give_the_float_forms_values(forms: tuple[CodedWeight, CodedWeight],
                                                   coder: NativeCodedLinear) -> None:
    coded, half = forms
    assert torch.equal(coder.expand(half), coder.expand(coded))
    assert torch.equal(coder.expand(half), coded.rows(torch.arange(VOCAB)))
    with pytest.raises(ValueError, match="half form"):
        coder.expand_blocked(half, torch.empty(VOCAB * HIDDEN).data_ptr(), 32)


def test_the_screen_kernels_and_gather_dot_give_the_float_forms_bits(forms: tuple[CodedWeight, CodedWeight],
                                                                     native: NativeInt8Matmul) -> None:
    coded, half = forms
    generator = torch.Generator().manual_seed(5)
    panels = -(-VOCAB // 32)
    for rows in (3, 5, 11):
        x = torch.randint(-16383, 16384, (rows, HIDDEN), generator=generator, dtype=torch.int16)
        x_scale = torch.rand(rows, generator=generator) + 0.5
        maxima = torch.empty(rows, panels), torch.empty(rows, panels)
        assert torch.equal(native.codes_screen(half, x, x_scale, maxima[0]),
                           native.codes_screen(coded, x, x_scale, maxima[1]))
        assert torch.equal(*maxima)
        if native.has_codes_quads:
            xq, scales = check_rows(rows, HIDDEN, 32, generator)
            assert torch.equal(native.codes_screen_quads(half, xq, scales, maxima[0]),
                               native.codes_screen_quads(coded, xq, scales, maxima[1]))
            assert torch.equal(*maxima)
    x = torch.randn(4, HIDDEN, generator=generator)
    rows, ids = torch.randint(0, 4, (300,), generator=generator), torch.randint(0, VOCAB, (300,), generator=generator)
    assert torch.equal(native.codes_gather_dot(half, x, rows, ids), native.codes_gather_dot(coded, x, rows, ids))


def test_a_screen_of_a_head_in_the_half_form_gives_the_same_logits(native: NativeInt8Matmul,
                                                                   coder: NativeCodedLinear) -> None:
    weight, coded = q8_head(coder, vocab=3001, hidden=128)
    half = coded.half_form()
    assert half is not None
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(6, 128, generator=generator)
    x[:, 3] *= 50
    counts, adjusted = [1, 1, 64, 3, 1, 2], [[], [5], [], [], [7, 9], []]
    for activations in ("int16", "int8"):
        screens = [LMHeadScreen.from_codes(form, None, native, activations) for form in (coded, half)]
        assert all(screen is not None for screen in screens)
        assert screens[1]._coded.half
        ours, theirs = (screen.logits(x, counts, adjusted) for screen in screens)
        assert ours is not None and torch.equal(ours, theirs)
        greedy = [screen.logits(x[:1], [1], [[]]) for screen in screens]     # the one-call pick
        assert torch.equal(*greedy)
    assert torch.equal(screens[1].logits(x, counts, adjusted).argmax(dim=1)[[0, 2, 3, 5]],
                       (x @ weight.T).argmax(dim=1)[[0, 2, 3, 5]])


def test_a_tied_head_is_kept_in_the_half_form(coder: NativeCodedLinear) -> None:
    weight, coded = q8_head(coder, vocab=3001, hidden=128)
    model = torch.nn.Module()
    embedding = torch.nn.Embedding(3001, 128)
    embedding.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    head = PackedLinear.__new__(PackedLinear)
    torch.nn.Module.__init__(head)
    head.weight, head.bias, head.packed, head.coded = embedding.weight, None, None, coded
    head.in_features, head.out_features = 128, 3001
    head.coded_kernel, head.coded_max_rows, head.deferred_rows_hint = coder, 32, None
    head.native, head.native_max_rows, head.wide = None, 0, None
    original = torch.nn.Linear(128, 3001, bias=False)
    original.weight = embedding.weight
    model.get_input_embeddings = lambda: embedding
    model.get_output_embeddings = lambda: original
    taken = {}
    model.set_input_embeddings = lambda module: taken.setdefault("embedding", module)
    assert serve_tied_weight_from_codes(model, head) is not None
    assert head.coded.half and isinstance(taken["embedding"], CodedEmbedding)
    assert taken["embedding"].coded is head.coded
    ids = torch.tensor([[0, 5, 3000, 17]])
    assert torch.equal(taken["embedding"](ids), torch.nn.functional.embedding(ids, weight))
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(2))
    assert torch.equal(head(x), coder(x, coded, None))
