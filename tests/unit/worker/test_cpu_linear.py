"""PackedLinear computes what nn.Linear computes, for every row count, kernel and
packed dtype; the float32 kernel is the faster one on this CPU, or the one asked for."""

from __future__ import annotations

import pytest
import torch

from services.worker.engine.cpu.linear import cpu_linear
from services.worker.engine.cpu.linear.cpu_linear import (
    ALL_ROWS, MAX_PACKED_ROWS, KernelPlan, PackedLinear, kernel_available, kernel_plan, pack_linears,
    packing_available, resolve_kernel_plan,
)
from services.worker.engine.cpu.kernels.native_build import default_cache_dir
from services.worker.engine.cpu.kernels.native_ops import load_skinny_linear

# bfloat16 rounds each product's inputs, and the packed and plain kernels sum in different orders.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _kernels() -> list[object]:
    return [pytest.param(kernel, dtype, marks=pytest.mark.skipif(
                not kernel_available(kernel, dtype), reason=f"no {kernel} kernel for {dtype} on this CPU"))
            for kernel, dtype in (("mkl", torch.float32), ("onednn", torch.float32), ("onednn", torch.bfloat16))]


@pytest.mark.parametrize("kernel,dtype", _kernels())
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_linear_for_any_row_count(kernel: str, dtype: torch.dtype, bias: bool) -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 72, bias=bias).to(dtype)
    packed = PackedLinear(linear, kernel_plan(kernel, dtype).layer_max_rows, kernel)
    for rows in (1, 2, 5, 8, MAX_PACKED_ROWS, MAX_PACKED_ROWS + 1, 64, 300):
        x = torch.randn(1, rows, 48, dtype=dtype)
        with torch.inference_mode():
            got, expected = packed(x), linear(x)
        assert got.dtype == dtype and got.shape == expected.shape
        torch.testing.assert_close(got.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_kernel_plans_keep_each_kernel_where_it_pays() -> None:
    if kernel_available("mkl", torch.float32):
        assert kernel_plan("mkl", torch.float32) == KernelPlan("mkl", 32, 8)
    if kernel_available("onednn", torch.float32):
        assert kernel_plan("onednn", torch.float32) == KernelPlan("onednn", ALL_ROWS, ALL_ROWS)
    if kernel_available("onednn", torch.bfloat16):
        assert kernel_plan("onednn", torch.bfloat16) == KernelPlan("onednn", 32, 32)
    with pytest.raises(ValueError, match="no packed mkl kernel for torch.bfloat16"):
        kernel_plan("mkl", torch.bfloat16)


@pytest.mark.skipif(not (kernel_available("mkl", torch.float32) and kernel_available("onednn", torch.float32)),
                    reason="needs both float32 kernels")
@pytest.mark.parametrize("faster", ["mkl", "onednn"])
def test_auto_takes_the_kernel_that_times_faster(faster: str) -> None:
    timings = {"mkl": 2.0, "onednn": 1.0} if faster == "onednn" else {"mkl": 1.0, "onednn": 2.0}
    plan = resolve_kernel_plan("auto", torch.float32, timer=timings.__getitem__)
    assert plan is not None and plan.kernel == faster


def test_auto_measures_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    if not (kernel_available("mkl", torch.float32) and kernel_available("onednn", torch.float32)):
        pytest.skip("needs both float32 kernels")
    calls: list[str] = []

    def fake_time(kernel: str, linears: list[torch.nn.Linear], repeats: int = 3) -> float:
        calls.append(kernel)
        return 1.0 if kernel == "onednn" else 2.0

    monkeypatch.setattr(cpu_linear, "_chosen_float32_kernel", None)
    monkeypatch.setattr(cpu_linear, "_time_kernel", fake_time)
    monkeypatch.setattr(cpu_linear, "_calibration_linears", lambda: [])
    assert resolve_kernel_plan("auto", torch.float32).kernel == "onednn"
    assert resolve_kernel_plan("auto", torch.float32).kernel == "onednn"
    assert sorted(calls) == ["mkl", "onednn"]


def test_calibration_times_real_kernels() -> None:
    linears = cpu_linear._calibration_linears()
    assert [(linear.out_features, linear.in_features) for linear in linears] == list(cpu_linear.CALIBRATION_SHAPES)
    for kernel in ("mkl", "onednn"):
        if kernel_available(kernel, torch.float32):
            assert 0.0 < cpu_linear._time_kernel(kernel, linears, repeats=1) < 60.0


def test_the_prefill_kernel_is_measured_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    if not (kernel_available("mkl", torch.float32) and kernel_available("onednn", torch.float32)):
        pytest.skip("needs both float32 kernels")
    calls: list[str] = []

    def fake_time(kernel: str, repeats: int = 3) -> float:
        calls.append(kernel)
        return 1.0 if kernel == "mkl" else 2.0

    monkeypatch.setattr(cpu_linear, "_prefill_seconds", None)
    monkeypatch.setattr(cpu_linear, "_time_prefill_kernel", fake_time)
    assert cpu_linear.choose_prefill_kernel() == "mkl"
    assert cpu_linear.choose_prefill_kernel() == "mkl"
    assert cpu_linear.choose_prefill_kernel(prefer="onednn", tolerance=2.5) == "onednn"   # the same measurement
    assert calls == ["mkl", "onednn"] * cpu_linear.PREFILL_CALIBRATION_ROUNDS      # alternating, once
    assert cpu_linear.choose_prefill_kernel(lambda kernel: {"mkl": 3.0, "onednn": 1.0}[kernel]) == "onednn"
    for kernel in ("mkl", "onednn"):
        assert 0.0 < cpu_linear._time_prefill_kernel(kernel, repeats=1) < 60.0


@pytest.mark.parametrize(("mkl", "onednn", "tolerance", "expected"),
                         [(1.0, 1.1, 1.15, "onednn"), (1.0, 1.15, 1.15, "onednn"), (1.0, 1.2, 1.15, "mkl"),
                          (1.0, 1.1, 1.0, "mkl"), (1.2, 1.0, 1.0, "onednn"), (1.2, 1.0, 1.15, "onednn")])
def test_a_preferred_prefill_kernel_is_taken_within_its_tolerance(mkl: float, onednn: float, tolerance: float,
                                                                  expected: str) -> None:
    if not (kernel_available("mkl", torch.float32) and kernel_available("onednn", torch.float32)):
        pytest.skip("needs both float32 kernels")
    seconds = {"mkl": mkl, "onednn": onednn}
    assert cpu_linear.choose_prefill_kernel(seconds.__getitem__, prefer="onednn", tolerance=tolerance) == expected


@pytest.mark.parametrize("kernel", [k for k in ("mkl", "onednn") if kernel_available(k, torch.float32)])
def test_a_pack_repacked_for_prefill_serves_every_row_count(kernel: str) -> None:
    generator = torch.Generator().manual_seed(8)
    linear = torch.nn.Linear(64, 96)
    packed = PackedLinear(linear, 8, "onednn" if kernel == "mkl" else "mkl"
                          if kernel_available("mkl", torch.float32) else "onednn")
    packed.repack_for_prefill(kernel)
    assert packed.kernel == kernel and packed.max_packed_rows == ALL_ROWS
    for rows in (1, 33, 300):
        x = torch.randn(rows, 64, generator=generator)
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)


def test_explicit_and_unknown_choices() -> None:
    assert resolve_kernel_plan("onednn", torch.float32) == kernel_plan("onednn", torch.float32)
    assert resolve_kernel_plan("auto", torch.float16) is None        # no packed kernel: plain linears
    with pytest.raises(ValueError, match="unknown CPU linear kernel 'blas'"):
        resolve_kernel_plan("blas", torch.float32)


def test_pack_linears_replaces_nested_linears_it_has_a_kernel_for_and_shares_weights() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Sequential(torch.nn.Linear(8, 4)),
                                torch.nn.Linear(4, 4).to(torch.bfloat16), torch.nn.Linear(4, 4).to(torch.float16))
    first_weight = model[0].weight
    expected = 2 * packing_available(torch.float32) + packing_available(torch.bfloat16)
    assert pack_linears(model) == expected
    assert isinstance(model[0], PackedLinear) == packing_available(torch.float32)
    assert isinstance(model[1][0], PackedLinear) == packing_available(torch.float32)
    assert isinstance(model[2], PackedLinear) == packing_available(torch.bfloat16)
    assert isinstance(model[3], torch.nn.Linear)      # float16: no packed kernel
    assert model[0].weight is first_weight


def test_pack_linears_follows_the_given_plans() -> None:
    if not kernel_available("onednn", torch.float32):
        pytest.skip("needs the oneDNN float32 kernel")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4).to(torch.bfloat16))
    plan = kernel_plan("onednn", torch.float32)
    assert pack_linears(model, {torch.float32: plan}) == 1
    assert isinstance(model[0], PackedLinear) and model[0].kernel == "onednn"
    assert model[0].max_packed_rows == ALL_ROWS
    assert isinstance(model[1], torch.nn.Linear)      # no plan for bfloat16


def test_packed_linear_refuses_a_dtype_without_a_kernel() -> None:
    with pytest.raises(ValueError, match="no packed"):
        PackedLinear(torch.nn.Linear(4, 4).to(torch.float16))


# ---- the C kernel for few rows ---------------------------------------------------------------

@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 11])
@pytest.mark.parametrize("in_features,out_features", [(64, 96), (37, 13), (640, 6), (24, 3)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_skinny_kernel_matches_linear(rows: int, in_features: int, out_features: int, bias: bool) -> None:
    kernel = load_skinny_linear(default_cache_dir())
    assert kernel is not None, "the C kernel did not build (is there a C compiler?)"
    generator = torch.Generator().manual_seed(rows * in_features + out_features)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.normal_(generator=generator)
        if bias:
            linear.bias.normal_(generator=generator)
    x = torch.randn(rows, in_features, generator=generator)
    torch.testing.assert_close(kernel(x, linear.weight, linear.bias), linear(x), rtol=1e-5, atol=1e-5)


def test_packed_linear_routes_few_rows_to_the_c_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = load_skinny_linear(default_cache_dir())
    assert kernel is not None
    linear = torch.nn.Linear(32, 48)
    packed = PackedLinear(linear, 64, "onednn")
    assert packed.use_native(kernel, 4)
    calls: list[int] = []
    counting = lambda rows, weight, bias: calls.append(rows.shape[0]) or kernel(rows, weight, bias)  # noqa: E731
    packed.native = counting
    for shape in [(1, 32), (2, 2, 32), (4, 32), (5, 32), (3, 7, 32)]:
        x = torch.randn(*shape)
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
    assert calls == [1, 4, 4]          # 5 and 21 rows take the packed kernel
    bf16 = PackedLinear(torch.nn.Linear(32, 48).to(torch.bfloat16), 64, "onednn") if kernel_available(
        "onednn", torch.bfloat16) else None
    assert bf16 is None or not bf16.use_native(kernel, 4)
