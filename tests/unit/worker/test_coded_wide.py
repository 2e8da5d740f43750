"""CPU_PREFILL_WEIGHTS: coded linears keep no float32 copy, and their wide steps expand the codes
into a shared scratch (coded_wide.py), in oneDNN's own pack layout where it is known
(onednn_layout.py), with the packs' results bit for bit."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import torch

from services.worker.engine.cpu.linear import cpu_linear

from services.worker.engine.cpu.linear import onednn_layout
from services.worker.engine.cpu.linear.coded_wide import WideFromCodes
from services.worker.engine.cpu.linear.cpu_linear import PackedLinear, kernel_available
from services.worker.engine.cpu.kernels.native_build import default_cache_dir
from services.worker.engine.cpu.linear.prefill_gemm import PANEL, NativePrefillGemm, decide, load_prefill_gemm
from services.worker.engine.cpu.linear.weight_codes import MAX_ROWS, NativeCodedLinear, load_coded_linear
from tests.fixtures.tiny_model import build_model, gemma3_config
from tests.unit.worker.engine_helpers import CONFIGS, Driver, assert_greedy_matches, prompt_of
from tests.unit.worker.test_weight_codes import _engine, coded_weight, snap_to_codes

ONEDNN = kernel_available("onednn", torch.float32)


@pytest.fixture(autouse=True)
def _no_grad() -> Iterator[None]:
    """As the engine runs its steps: with autograd on, oneDNN's linear takes a bias that
    requires grad through another path, whose last bits differ from the pack's on some CPUs
    (a 2-core AMD EPYC Zen 3, AVX2)."""
    with torch.no_grad():
        yield


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
    lean, packs = _engine(reference, cpu_prefill_weights="codes"), _engine(reference, cpu_prefill_weights="packs")
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


def test_the_learned_pack_layout_is_onednns_own() -> None:
    if not (ONEDNN and onednn_layout.pack_bytes_readable()):
        pytest.skip("oneDNN's packs are not readable here")
    pack = onednn_layout.learn(128, 96, 512)
    if pack is None:
        pytest.skip("oneDNN's float32 pack is not a plain blocked permutation on this CPU")
    weight = torch.randn(128, 96, generator=torch.Generator().manual_seed(3))
    blocked = weight.view(128 // pack.block, pack.block, 96).transpose(1, 2).contiguous()
    assert onednn_layout.pack_of(weight, 512) == blocked.numpy().tobytes()
    assert onednn_layout.learn(100, 64, 512) is None or 100 % onednn_layout.learn(100, 64, 512).block == 0


@pytest.mark.parametrize("bias", [False, True])
def test_wide_steps_multiply_a_pack_written_from_the_codes(kernel: NativeCodedLinear, bias: bool) -> None:
    if not ONEDNN:
        pytest.skip("no oneDNN")
    pairs = [_coded_linear(kernel, out_features, seed, bias) for seed, out_features in enumerate((128, 192, 100))]
    xs = [torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)) for rows in (MAX_ROWS + 1, 300)]
    for _, packed in pairs:
        packed.repack_for_prefill("onednn")
    before = [[packed(x) for x in xs] for _, packed in pairs]
    wide = WideFromCodes(kernel, onednn=True)
    learned = [wide.prepare(packed.coded) for _, packed in pairs]
    assert learned[2] is (onednn_layout.learn(100, 128, 512) is not None)    # 100 rows: no 64-row blocks
    if onednn_layout.pack_bytes_readable() and onednn_layout.learn(128, 128, 512) is not None:
        assert learned[:2] == [True, True] and wide.blocked_shapes() == sum(learned)
    for _, packed in pairs:
        assert packed.serve_wide_rows_from_codes(wide)
    for _ in range(2):                       # linears of one shape share their pack
        for (_, packed), expected in zip(pairs, before):
            for x, was in zip(xs, expected):
                assert torch.equal(packed(x), was)


def test_auto_takes_the_codes_where_a_written_pack_stands_in_for_every_layer() -> None:
    # 64-wide K/V projections: every layer's shape is a whole number of oneDNN's 64-row blocks.
    reference = build_model(gemma3_config(num_key_value_heads=4))
    assert snap_to_codes(reference) > 0
    auto, packs = _engine(reference), _engine(reference, cpu_prefill_weights="packs")
    layers = [m for m in auto.model.modules() if isinstance(m, PackedLinear) and m is not auto.prepared.lm_head]
    wide = layers[0].wide
    if auto.prepared.speedups.prefill_weights == "codes":
        assert wide is not None and wide.blocked_shapes() > 0
        assert all(m.wide is wide and m.packed is None and m.weight is None for m in layers)
    else:      # oneDNN's pack layout is another one on this CPU, or MKL packs prefill here
        assert all(m.wide is None and m.packed is not None for m in layers)
    assert packs.prepared.speedups.prefill_weights == "packs"
    prompts = {"a": prompt_of(40, 1), "b": prompt_of(70, 2)}
    assert Driver(auto).run(prompts, 8) == Driver(packs).run(prompts, 8)


def test_auto_keeps_the_packs_when_a_layer_shape_has_no_written_pack() -> None:
    reference = build_model(CONFIGS["gemma3"]())          # 16-wide K/V projections
    assert snap_to_codes(reference) > 0
    engine = _engine(reference, cpu_prefill_gemm="library")   # the AMX GEMM would take them all (test_amx_gemm.py)
    assert engine.prepared.speedups.prefill_weights == "packs"
    layers = [m for m in engine.model.modules() if isinstance(m, PackedLinear) and m is not engine.prepared.lm_head]
    assert layers and all(m.wide is None for m in layers)


@pytest.mark.skipif(not (ONEDNN and kernel_available("mkl", torch.float32)), reason="needs both float32 kernels")
@pytest.mark.parametrize(("onednn_seconds", "prefill_weights"), [(1.1, "auto"), (1.5, "auto"), (1.1, "packs")])
def test_auto_takes_onednn_and_the_codes_unless_mkl_is_much_faster(monkeypatch: pytest.MonkeyPatch,
                                                                   onednn_seconds: float,
                                                                   prefill_weights: str) -> None:
    """Under `auto` a calibration that puts MKL ahead by less than PREFILL_CODES_TOLERANCE still
    gives the layers oneDNN's pack, written from the codes; further ahead, or under `packs`,
    the layers keep MKL's packs and their float32 weights."""
    monkeypatch.setattr(cpu_linear, "_prefill_seconds", {"mkl": 1.0, "onednn": onednn_seconds})
    reference = build_model(gemma3_config(num_key_value_heads=4))
    assert snap_to_codes(reference) > 0
    engine = _engine(reference, cpu_prefill_weights=prefill_weights, cpu_prefill_gemm="library")   # no AMX GEMM
    layers = [m for m in engine.model.modules() if isinstance(m, PackedLinear) and m is not engine.prepared.lm_head]
    within = prefill_weights == "auto" and onednn_seconds <= cpu_linear.PREFILL_CODES_TOLERANCE
    assert engine.prefill_linear_kernel == ("onednn" if within else "mkl")
    if not within:
        assert engine.prepared.speedups.prefill_weights == "packs"
        assert all(m.kernel == "mkl" and m.packed is not None and m.weight is not None for m in layers)
    elif engine.prepared.speedups.prefill_weights == "codes":
        assert all(m.packed is None and m.weight is None for m in layers)
    else:      # oneDNN's pack layout is another one on this CPU: its own packs serve
        assert all(m.kernel == "onednn" and m.packed is not None for m in layers)
    prompts = {"a": prompt_of(40, 1), "b": prompt_of(70, 2)}
    assert Driver(engine).run(prompts, 8) == Driver(_engine(reference, cpu_prefill_weights="packs")).run(prompts, 8)


@pytest.fixture(scope="module")
def gemm() -> NativePrefillGemm:
    gemm = load_prefill_gemm(default_cache_dir())
    if gemm is None:
        pytest.skip("the native prefill GEMM needs AVX2 and FMA")
    return gemm


def _panels(weight: torch.Tensor) -> torch.Tensor:
    out_features, in_features = weight.shape
    return weight.view(out_features // PANEL, PANEL, in_features).transpose(1, 2).contiguous().view(-1)


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 300])
@pytest.mark.parametrize("out_features,in_features", [(16, 8), (48, 40), (32, 1100)])   # 1100: two k blocks
def test_the_native_gemm_multiplies_a_weight_in_panels(gemm: NativePrefillGemm, rows: int, out_features: int,
                                                       in_features: int) -> None:
    generator = torch.Generator().manual_seed(rows * out_features + in_features)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    got = gemm(x, _panels(weight), out_features)
    assert got.shape == (rows, out_features)
    torch.testing.assert_close(got.double(), x.double() @ weight.double().T, rtol=1e-5, atol=1e-4)
    assert torch.equal(got, gemm(x, _panels(weight), out_features))       # the same bits on every call


def test_the_native_gemm_refuses_what_it_does_not_take(gemm: NativePrefillGemm) -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        gemm(torch.randn(4, 8), torch.zeros(24 * 8), 24)
    with pytest.raises(ValueError, match="panels of"):
        gemm(torch.randn(4, 8), torch.zeros(16), 16)
    with pytest.raises(ValueError, match="contiguous float32"):
        gemm(torch.randn(8, 4).T, torch.zeros(16 * 8), 16)


def _slow(product: Callable[[torch.Tensor], torch.Tensor], seconds: float) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: time.sleep(seconds) or product(x)


def test_auto_takes_the_native_gemm_only_with_the_same_bits_and_faster() -> None:
    weight = torch.randn(32, 24, generator=torch.Generator().manual_seed(5))
    exact = lambda x: x @ weight.T          # noqa: E731
    other = lambda x: x @ weight.T + 1e-3   # noqa: E731
    faster = decide("auto", exact, _slow(exact, 0.002), 24)
    assert faster.serves and faster.same_bits and faster.native_s < faster.library_s
    assert not decide("auto", _slow(exact, 0.002), exact, 24).serves          # the same bits, slower
    different = decide("auto", other, _slow(exact, 0.002), 24)
    assert not different.serves and not different.same_bits
    assert decide("native", other, exact, 24).serves                           # taken regardless
    assert not decide("library", exact, _slow(exact, 0.002), 24).serves
    assert "native (the same bits" in faster.describe() and "library (other bits" in different.describe()
    with pytest.raises(ValueError, match="CPU_PREFILL_GEMM"):
        decide("sometimes", exact, exact, 24)


@pytest.mark.parametrize("mode", ["auto", "native", "library"])
def test_wide_steps_through_the_native_gemm(kernel: NativeCodedLinear, gemm: NativePrefillGemm, mode: str) -> None:
    pairs = [_coded_linear(kernel, out_features, seed, False) for seed, out_features in enumerate((128, 96, 100))]
    xs = [torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)) for rows in (MAX_ROWS + 1, 300)]
    library = WideFromCodes(kernel, onednn=ONEDNN)
    wide = WideFromCodes(kernel, onednn=ONEDNN, gemm=gemm, gemm_mode=mode)
    for _, packed in pairs:
        library.prepare(packed.coded)
        assert wide.prepare_gemm(packed.coded) == (packed.out_features % 16 == 0 and mode == "native") \
            or mode == "auto"
    verdicts = [wide._native.get((packed.out_features, packed.in_features)) for _, packed in pairs]
    assert verdicts[2] is None                          # 100 outputs: not whole panels of 16
    serves = [verdict.serves for verdict in verdicts[:2]]
    assert serves == [True, True] if mode == "native" else (mode == "auto" or serves == [False, False])
    assert wide.native_shapes() == sum(serves)
    for (linear, packed), verdict in zip(pairs, verdicts):
        for x in xs:
            got, was = wide(x, packed.coded, None), library(x, packed.coded, None)
            torch.testing.assert_close(got, linear(x), rtol=1e-5, atol=1e-5)
            if verdict is None or not verdict.serves or verdict.same_bits:
                assert torch.equal(got, was)              # under auto: the library's bits exactly


@pytest.mark.parametrize("mode", ["native", "auto"])
def test_an_engine_with_the_native_prefill_gemm_generates_the_same_tokens(gemm: NativePrefillGemm,
                                                                          mode: str) -> None:
    reference = build_model(gemma3_config(num_key_value_heads=4))
    assert snap_to_codes(reference) > 0
    engine = _engine(reference, cpu_prefill_weights="codes", cpu_prefill_gemm=mode)
    library = _engine(reference, cpu_prefill_weights="codes", cpu_prefill_gemm="library")
    assert library.prepared.speedups.native_prefill_shapes == 0
    if mode == "native":
        assert engine.prepared.speedups.native_prefill_shapes > 0
    prompts = {"a": prompt_of(40, 1), "b": prompt_of(70, 2), "c": prompt_of(3, 3)}
    got = Driver(engine).run(prompts, 10, chunk={"b": 36})
    assert got == Driver(library).run(prompts, 10, chunk={"b": 36})
    assert_greedy_matches(reference, prompts, got, 10)


def test_an_unknown_prefill_gemm_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="CPU_PREFILL_GEMM"):
        _engine(build_model(CONFIGS["gemma3"]()), cpu_prefill_gemm="sometimes")
