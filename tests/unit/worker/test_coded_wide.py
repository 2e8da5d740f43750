"""CPU_PREFILL_WEIGHTS=codes: coded linears keep no float32 copy, and their wide steps expand
the codes into a shared scratch (coded_wide.py) with the packs' results."""

from __future__ import annotations

import pytest
import torch

from services.worker.engine.cpu.coded_wide import WideFromCodes
from services.worker.engine.cpu.cpu_linear import PackedLinear, kernel_available
from services.worker.engine.cpu.native_build import default_cache_dir
from services.worker.engine.cpu.weight_codes import MAX_ROWS, NativeCodedLinear, load_coded_linear
from tests.fixtures.tiny_model import build_model
from tests.unit.worker.engine_helpers import CONFIGS, Driver, assert_greedy_matches, prompt_of
from tests.unit.worker.test_weight_codes import _engine, coded_weight, snap_to_codes

ONEDNN = kernel_available("onednn", torch.float32)


@pytest.fixture(scope="module")
def kernel() -> NativeCodedLinear:
    coded = load_coded_linear(default_cache_dir())
    assert coded is not None, "the coded linear did not build (is there a C compiler?)"
    return coded


@pytest.mark.parametrize("out_features,in_features,group,levels", [
    (96, 128, 32, 16), (100, 64, 16, 64), (64, 96, 32, 256), (33, 32, 32, 32)])
def test_expanding_gives_the_weight_back_bit_for_bit(kernel: NativeCodedLinear, out_features: int,
                                                     in_features: int, group: int, levels: int) -> None:
    weight = coded_weight(out_features, in_features, group, levels, seed=out_features)
    coded = kernel.find(weight)
    assert coded is not None
    for form in (coded, kernel.narrow(coded)):
        scratch = torch.full((out_features * in_features + 7,), float("nan"))
        assert torch.equal(kernel.expand_into(form, scratch), weight)


def _coded_linear(kernel: NativeCodedLinear, out_features: int, seed: int, bias: bool) -> tuple[torch.nn.Linear,
                                                                                              PackedLinear]:
    linear = torch.nn.Linear(128, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(coded_weight(out_features, 128, seed=seed))
    packed = PackedLinear(linear, kernel="onednn" if ONEDNN else None)
    assert packed.use_codes(kernel, MAX_ROWS)
    return linear, packed


@pytest.mark.parametrize("bias", [False, True])
def test_linears_sharing_a_scratch_each_give_their_own_results(kernel: NativeCodedLinear, bias: bool) -> None:
    pairs = [_coded_linear(kernel, out_features, seed, bias) for seed, out_features in enumerate((96, 160, 64))]
    xs = [torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)) for rows in (1, MAX_ROWS + 1, 300)]
    if ONEDNN:
        for _, packed in pairs:
            packed.repack_for_prefill("onednn")
    before = [[packed(x) for x in xs] for _, packed in pairs]
    wide = WideFromCodes(kernel, onednn=ONEDNN)
    for _, packed in pairs:
        assert packed.serve_wide_rows_from_codes(wide)
        assert packed.weight is None and packed.packed is None
    for _ in range(2):                       # alternating linears rewrite the one scratch
        for (linear, packed), expected in zip(pairs, before):
            for x, was in zip(xs, expected):
                got = packed(x)
                if ONEDNN:
                    assert torch.equal(got, was)          # oneDNN on the plain weight: the pack's bits
                torch.testing.assert_close(got, linear(x), rtol=1e-5, atol=1e-5)
    assert wide._scratch.numel() == 160 * 128


def test_a_linear_without_codes_keeps_its_copies(kernel: NativeCodedLinear) -> None:
    plain = PackedLinear(torch.nn.Linear(128, 96))
    assert not plain.serve_wide_rows_from_codes(WideFromCodes(kernel, onednn=ONEDNN))
    assert plain.weight is not None and plain.packed is not None


@pytest.mark.parametrize("kind", ["gemma3", "llama"])
def test_an_engine_keeps_only_codes_and_generates_the_same_tokens(kind: str) -> None:
    reference = build_model(CONFIGS[kind]())
    assert snap_to_codes(reference) > 0
    lean, packs = _engine(reference, cpu_prefill_weights="codes"), _engine(reference)
    layers = [m for m in lean.model.modules() if isinstance(m, PackedLinear) and m is not lean.prepared.lm_head]
    assert layers and all(m.coded is not None and m.weight is None and m.packed is None for m in layers)
    assert lean.prepared.speedups.dropped_bytes > packs.prepared.speedups.dropped_bytes
    wide = layers[0].wide
    calls = []
    wide.__class__ = type("Counted", (WideFromCodes,), {
        "__call__": lambda self, rows, *rest: calls.append(rows.shape[0]) or WideFromCodes.__call__(self, rows, *rest)})
    prompts = {"a": prompt_of(40, 1), "b": prompt_of(70, 2), "c": prompt_of(3, 3)}   # chunks past MAX_ROWS
    got = Driver(lean).run(prompts, 10, chunk={"b": 36})
    assert calls and min(calls) > MAX_ROWS                # the wide steps ran from the codes
    assert got == Driver(packs).run(prompts, 10, chunk={"b": 36})
    assert_greedy_matches(reference, prompts, got, 10)


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="CPU_PREFILL_WEIGHTS"):
        _engine(build_model(CONFIGS["gemma3"]()), cpu_prefill_weights="sometimes")
