"""RMSNorm modules are swapped for torch's fused rms_norm only where the output is the same."""

from __future__ import annotations

import pytest
import torch
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from services.worker.engine.cpu.linear.fused_norms import FusedRMSNorm, fuse_rms_norms, fused_equivalent
from services.worker.engine.cpu.kernels.native_build import default_cache_dir
from services.worker.engine.cpu.kernels.native_ops import load_elementwise
from tests.unit.worker.engine_helpers import make_engine


def with_random_weight(norm: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        norm.weight.normal_(generator=torch.Generator().manual_seed(3))
    return norm


@pytest.mark.parametrize("norm_class", [Gemma3RMSNorm, LlamaRMSNorm])
@pytest.mark.parametrize("shape", [(1, 64), (7, 64), (2, 5, 4, 64)])
def test_the_fused_norm_gives_the_same_bits(norm_class: type, shape: tuple[int, ...]) -> None:
    norm = with_random_weight(norm_class(64, eps=1e-6))
    fused = fused_equivalent(norm)
    assert isinstance(fused, FusedRMSNorm)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 30
    assert torch.equal(fused(x), norm(x))


class OffsetRMSNorm(LlamaRMSNorm):
    """Computes something neither convention does: it must keep its own forward."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden_states) + 0.5


def test_a_norm_computing_something_else_is_left_alone() -> None:
    model = torch.nn.Sequential(with_random_weight(OffsetRMSNorm(32)), with_random_weight(LlamaRMSNorm(32)))
    assert fused_equivalent(model[0]) is None
    assert fuse_rms_norms(model) == 1
    assert isinstance(model[0], OffsetRMSNorm) and isinstance(model[1], FusedRMSNorm)


def test_bfloat16_norms_are_swapped_only_when_bitwise_equal() -> None:
    for norm_class in (Gemma3RMSNorm, LlamaRMSNorm):
        norm = with_random_weight(norm_class(64)).to(torch.bfloat16)
        fused = fused_equivalent(norm)
        if fused is not None:
            x = (torch.randn(9, 64) * 10).to(torch.bfloat16)
            assert torch.equal(fused(x), norm(x))


@pytest.mark.parametrize("kind", ["gemma3", "llama"])
def test_the_engine_fuses_every_norm_of_these_models(kind: str) -> None:
    engine = make_engine(kind)
    remaining = [name for name, module in engine.model.named_modules() if type(module).__name__.endswith("RMSNorm")
                 and not isinstance(module, FusedRMSNorm)]
    assert engine.fused_norms > 0 and remaining == []


@pytest.mark.parametrize("norm_class", [Gemma3RMSNorm, LlamaRMSNorm])
def test_with_the_c_ops_the_norm_agrees_to_float32_rounding(norm_class: type) -> None:
    native = load_elementwise(default_cache_dir())
    assert native is not None
    norm = with_random_weight(norm_class(72, eps=1e-6))           # 72: a tail past the vector loop
    fused = fused_equivalent(norm, native)
    assert isinstance(fused, FusedRMSNorm) and fused.native is native
    for shape in [(1, 72), (9, 72), (3, 300, 72)]:                # the last runs on both threads
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(2)) * 30
        torch.testing.assert_close(fused(x), norm(x), rtol=1e-5, atol=1e-6)


def test_the_c_norm_is_not_used_where_it_disagrees(monkeypatch: pytest.MonkeyPatch) -> None:
    native = load_elementwise(default_cache_dir())
    assert native is not None
    monkeypatch.setattr(native, "rms_norm", lambda x, scale, eps: torch.zeros_like(x))
    fused = fused_equivalent(with_random_weight(LlamaRMSNorm(16)), native)
    assert isinstance(fused, FusedRMSNorm) and fused.native is None
