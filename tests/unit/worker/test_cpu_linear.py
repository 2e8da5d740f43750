"""PackedLinear computes what nn.Linear computes, for every row count."""

from __future__ import annotations

import pytest
import torch

from services.worker.engine.cpu_linear import MAX_PACKED_ROWS, PackedLinear, mkl_packing_available, pack_linears

pytestmark = pytest.mark.skipif(not mkl_packing_available(), reason="needs MKL packed sgemm")


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_linear_for_any_row_count(bias: bool) -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 72, bias=bias)
    packed = PackedLinear(linear)
    for rows in (1, 2, 5, MAX_PACKED_ROWS, MAX_PACKED_ROWS + 1, 64):
        x = torch.randn(1, rows, 48)
        with torch.inference_mode():
            torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)


def test_pack_linears_replaces_nested_float32_linears_and_shares_weights() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Sequential(torch.nn.Linear(8, 4)),
                                torch.nn.Linear(4, 4).to(torch.bfloat16))
    first_weight = model[0].weight
    assert pack_linears(model) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[1][0], PackedLinear)
    assert isinstance(model[2], torch.nn.Linear)
    assert model[0].weight is first_weight
