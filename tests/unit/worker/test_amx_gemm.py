"""The AMX GEMM of wide steps (amx_gemm.py, native/amx_coded_gemm.c): its outputs against the
float64 product within a float32 GEMM's rounding bound, for every code width and block size
the codes take; the bound itself catching a GEMM that rounds its activations to bfloat16;
CPU_PREFILL_GEMM's choice per shape (decide_amx, with fakes); the wide steps' routing
(coded_wide.py); and an engine whose prefill runs on it generating the reference's tokens.

The kernel's own tests run on a CPU with AMX-BF16 only (an Intel Xeon of the Sapphire Rapids
generation or later) and are skipped elsewhere, saying so; the choice and routing tests run
everywhere."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable

import pytest
import torch

from services.worker.engine.cpu.kernels.native_build import default_cache_dir
from services.worker.engine.cpu import timing
from services.worker.engine.cpu.linear.amx_gemm import (AmxVerdict, NativeAmxGemm, decide_amx, float32_bound,
                                                        load_amx_gemm, settle,
                                                        within_float32_bound)
from services.worker.engine.cpu.linear.coded_wide import WideFromCodes
from services.worker.engine.cpu.linear.weight_codes import CodedWeight, NativeCodedLinear
from tests.fixtures.tiny_model import build_model, gemma3_config
from tests.unit.worker.engine_helpers import Driver, assert_greedy_matches, prompt_of
from tests.unit.worker.test_coded_wide import _no_grad, kernel  # noqa: F401 (fixtures)
from tests.unit.worker.test_weight_codes import _engine, coded_weight, snap_to_codes


@pytest.fixture(scope="module")
def amx() -> NativeAmxGemm:
    gemm = load_amx_gemm(default_cache_dir())
    if gemm is None:
        pytest.skip("this CPU has no AMX-BF16 (or the kernel does not grant its tiles): the AMX GEMM does not run")
    return gemm


def _coded(kernel: NativeCodedLinear, out_features: int, in_features: int, group: int, levels: int,
           narrow: bool, seed: int = 0) -> tuple[torch.Tensor, CodedWeight]:
    weight = coded_weight(out_features, in_features, group, levels, seed=seed)
    coded = kernel.find(weight)
    assert coded is not None and coded.group == group
    return weight, kernel.narrow(coded) if narrow else coded


def _hidden_rows(rows: int, in_features: int, seed: int) -> torch.Tensor:
    """Rows like Gemma's hidden states: a few columns 50x the rest, a zero row, tiny values."""
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(seed))
    x[:, ::17] *= 50
    x[0] = 0
    if rows > 1:
        x[1] *= 1e-30
    return x


@pytest.mark.parametrize("out_features,in_features,group,levels,narrow", [
    (96, 128, 32, 16, True), (64, 96, 16, 64, True), (100, 64, 32, 256, False), (33, 32, 32, 32, True),
    (64, 2560, 32, 16, True)])
@pytest.mark.parametrize("rows", [1, 7, 33, 300])
def test_outputs_are_within_a_float32_gemms_bound(kernel: NativeCodedLinear, amx: NativeAmxGemm, out_features: int,
                                                  in_features: int, group: int, levels: int, narrow: bool,
                                                  rows: int) -> None:
    weight, coded = _coded(kernel, out_features, in_features, group, levels, narrow, seed=rows)
    x = _hidden_rows(rows, in_features, seed=out_features)
    got = amx(x, coded)
    assert got.shape == (rows, out_features)
    error = (got.double() - x.double() @ weight.double().T).abs()
    assert bool((error <= float32_bound(x, coded)).all())
    assert torch.equal(got[0], torch.zeros(out_features))          # a zero row: exactly zero
    # as close as oneDNN's own float32 GEMM, within a few of its roundings
    library = (torch.nn.functional.linear(x, weight).double() - x.double() @ weight.double().T).abs()
    assert error.max() <= 4 * library.max() + 1e-30


def test_the_bound_catches_activations_rounded_to_bfloat16(kernel: NativeCodedLinear) -> None:
    weight, coded = _coded(kernel, 64, 256, 32, 16, narrow=True)

    class Bfloat16Gemm:                      # what AMX gives without the split into pieces
        def __call__(self, rows: torch.Tensor, coded: CodedWeight) -> torch.Tensor:
            return rows.bfloat16().float() @ weight.T

    class ExactGemm:
        def __call__(self, rows: torch.Tensor, coded: CodedWeight) -> torch.Tensor:
            return (rows.double() @ weight.double().T).float()

    assert not within_float32_bound(Bfloat16Gemm(), coded)          # type: ignore[arg-type]
    assert within_float32_bound(ExactGemm(), coded)                 # type: ignore[arg-type]


class _FakeAmx:
    """Stands in for the kernel: exact products (or the activations rounded to bfloat16), and
    `on_call` run at each call (a tick of a fake clock)."""

    def __init__(self, weight: torch.Tensor, takes: bool = True, exact: bool = True,
                 on_call: Callable[[], object] = lambda: None) -> None:
        self.weight, self._takes, self.exact, self.on_call, self.calls = weight, takes, exact, on_call, 0

    def takes(self, coded: CodedWeight) -> bool:
        return self._takes

    def __call__(self, rows: torch.Tensor, coded: CodedWeight) -> torch.Tensor:
        self.calls += 1
        self.on_call()
        x = rows if self.exact else rows.bfloat16().float()
        return (x.double() @ self.weight.double().T).float()


@pytest.mark.parametrize("mode,amx_faster,serves", [
    ("auto", True, True), ("auto", False, False), ("amx", False, True), ("native", True, False),
    ("library", True, False)])
def test_each_mode_takes_the_amx_gemm_where_it_says(kernel: NativeCodedLinear, monkeypatch: pytest.MonkeyPatch,
                                                    mode: str, amx_faster: bool, serves: bool) -> None:
    weight, coded = _coded(kernel, 64, 128, 32, 16, narrow=True)
    clock = itertools.count()
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock))
    fake = _FakeAmx(weight, on_call=(lambda: None) if amx_faster else (lambda: next(clock)))

    def library(rows: torch.Tensor) -> torch.Tensor:
        if amx_faster:
            next(clock)                       # a tick more a call than the AMX GEMM's
        return rows @ weight.T

    verdict = decide_amx(mode, fake, coded, library)            # type: ignore[arg-type]
    assert verdict.serves is serves
    assert verdict.describe().startswith("AMX (") is serves


@pytest.mark.parametrize("mode,times,serves", [
    ("auto", {(8, 4): (1.0, 2.0), (4, 4): (3.0, 2.0)}, True),      # slower on one shape, faster in all
    ("auto", {(8, 4): (1.0, 2.0), (4, 4): (3.0, 1.0)}, False),     # the one shape's 3 linears outweigh
    ("amx", {(8, 4): (1.0, 2.0), (4, 4): (3.0, 1.0)}, None)])     # as decided, shape by shape
def test_auto_settles_one_answer_for_all_shapes(mode: str, times: dict[tuple[int, int], tuple[float, float]],
                                                serves: bool | None) -> None:
    verdicts = {shape: AmxVerdict(amx_s < library_s, True, amx_s, library_s)
                for shape, (amx_s, library_s) in times.items()}
    settled = settle(mode, verdicts, Counter({(8, 4): 1, (4, 4): 3}) if serves is False else Counter({(8, 4): 3,
                                                                                                    (4, 4): 1}))
    if serves is None:
        assert settled == verdicts
    else:
        assert all(verdict.serves is serves for verdict in settled.values())
    outside = {**verdicts, (2, 4): AmxVerdict(False, False)}
    assert not any(verdict.serves for verdict in settle("auto", outside, Counter(dict.fromkeys(outside, 1))).values())


def test_a_gemm_outside_the_bound_or_a_weight_it_does_not_take_never_serves(kernel: NativeCodedLinear) -> None:
    weight, coded = _coded(kernel, 64, 128, 32, 16, narrow=True)
    for fake in (_FakeAmx(weight, exact=False), _FakeAmx(weight, takes=False)):
        verdict = decide_amx("amx", fake, coded, lambda rows: rows @ weight.T)     # type: ignore[arg-type]
        assert not verdict.serves and not verdict.within_bound


def test_wide_steps_go_to_the_amx_gemm_where_it_serves_and_without_a_bias(kernel: NativeCodedLinear) -> None:
    weight, coded = _coded(kernel, 64, 128, 32, 16, narrow=True)
    fake = _FakeAmx(weight)
    wide = WideFromCodes(kernel, onednn=False, gemm_mode="amx", amx=fake)         # type: ignore[arg-type]
    assert not wide.prepare_gemm(coded)                           # the native GEMM: not under `amx`
    assert wide.settle_amx() and wide.amx_shapes() == 1 and wide.native_shapes() == 0
    x = torch.randn(40, 128)
    calls = fake.calls
    torch.testing.assert_close(wide(x, coded, None), x @ weight.T, rtol=1e-5, atol=1e-5)
    assert fake.calls == calls + 1
    bias = torch.randn(64)
    torch.testing.assert_close(wide(x, coded, bias), x @ weight.T + bias, rtol=1e-5, atol=1e-5)
    assert fake.calls == calls + 1                                 # a bias: the library's product


@pytest.mark.parametrize("mode", ["amx", "auto"])
def test_an_engine_whose_prefill_runs_on_amx_generates_the_references_tokens(amx: NativeAmxGemm, mode: str) -> None:
    reference = build_model(gemma3_config(num_key_value_heads=4))
    assert snap_to_codes(reference) > 0
    engine = _engine(reference, cpu_prefill_weights="codes", cpu_prefill_gemm=mode)
    if mode == "amx":
        assert engine.prepared.speedups.amx_prefill_shapes > 0
    library = _engine(reference, cpu_prefill_weights="codes", cpu_prefill_gemm="library")
    assert library.prepared.speedups.amx_prefill_shapes == 0
    prompts = {"a": prompt_of(40, 1), "b": prompt_of(70, 2), "c": prompt_of(3, 3)}
    got = Driver(engine).run(prompts, 10, chunk={"b": 36})
    assert got == Driver(library).run(prompts, 10, chunk={"b": 36})
    assert_greedy_matches(reference, prompts, got, 10)


def test_a_rows_outputs_do_not_depend_on_the_rows_beside_it(kernel: NativeCodedLinear, amx: NativeAmxGemm) -> None:
    """Another tenant's rows in the same step change nothing of a row's bits: alone, in a few
    rows (the threads share out the panels) or among hundreds (the threads split the rows)."""
    _, coded = _coded(kernel, 96, 640, 32, 16, narrow=True)
    x = _hidden_rows(300, 640, seed=7)
    alone = torch.cat([amx(x[i:i + 1], coded) for i in (5, 150, 299)])
    for batch in (x[:40], x):
        got = amx(batch.contiguous(), coded)
        rows = [i for i in (5, 150, 299) if i < len(batch)]
        assert torch.equal(got[rows], alone[:len(rows)])
