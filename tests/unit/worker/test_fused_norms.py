"""RMSNorm modules are swapped for torch's fused rms_norm only where the output is the same."""

from __future__ import annotations

import pytest
import torch
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from services.worker.engine.fused_norms import FusedRMSNorm, fuse_rms_norms, fused_equivalent
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
