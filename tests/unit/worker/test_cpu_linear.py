"""PackedLinear computes what nn.Linear computes, for every row count and packed dtype."""

from __future__ import annotations

import pytest
import torch

from services.worker.engine.cpu_linear import MAX_PACKED_ROWS, PackedLinear, pack_linears, packing_available

# bfloat16 rounds each product's inputs, and the packed and plain kernels sum in different orders.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _dtypes() -> list[object]:
    return [pytest.param(dtype, marks=pytest.mark.skipif(not packing_available(dtype),
                                                         reason=f"no packed kernel for {dtype} on this CPU"))
            for dtype in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("dtype", _dtypes())
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_linear_for_any_row_count(dtype: torch.dtype, bias: bool) -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 72, bias=bias).to(dtype)
    packed = PackedLinear(linear)
    for rows in (1, 2, 5, 8, MAX_PACKED_ROWS, MAX_PACKED_ROWS + 1, 64):
        x = torch.randn(1, rows, 48, dtype=dtype)
        with torch.inference_mode():
            got, expected = packed(x), linear(x)
        assert got.dtype == dtype and got.shape == expected.shape
        torch.testing.assert_close(got.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


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


def test_packed_linear_refuses_a_dtype_without_a_kernel() -> None:
    with pytest.raises(ValueError, match="no packed kernel"):
        PackedLinear(torch.nn.Linear(4, 4).to(torch.float16))
