"""Model RMSNorm modules replaced by torch's fused `rms_norm` where it computes the same.

transformers' RMSNorm classes spell the norm out in Python (cast, pow, mean,
add, rsqrt, mul, the weight, cast back): about ten small ops, ~70 us each time
on CPU, and a Gemma 3 decode step runs 109 of them (four per layer, the q/k
norms, the final one). `torch.nn.functional.rms_norm` does the same in one call
(~30 us). Each norm is replaced only if a probe shows the fused form giving
bitwise the same output for one of the two weight conventions (`w * x_hat`,
Llama; `(1 + w) * x_hat`, Gemma), in the model's own dtype and device, so
models whose norms compute anything else keep theirs untouched.

With the engine's C ops (`native_ops.py`, CPU float32) the fused norm runs as one
pass over memory instead (~10 us against ~25 us at decode sizes, ~60 against
~125 us on a 512-token chunk); it is used only if it agrees with torch's fused
norm on the probe to within float32 rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.worker.engine.cpu.linear.module_swap import swap_modules
from services.worker.engine.cpu.kernels.native_ops import NativeElementwise

PROBE_ROWS = 64
NATIVE_TOLERANCE = 1e-5     # relative to the largest output of the probe


class FusedRMSNorm(torch.nn.Module):
    def __init__(self, weight: torch.Tensor | None, eps: float, native: NativeElementwise | None = None) -> None:
        super().__init__()
        self.register_buffer("scale", weight, persistent=False)   # None: no learned scale
        self.eps = eps
        self.native = native

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # `native` is only set for float32 CPU norms (see fused_equivalent), so the scale qualifies too.
        if self.native is not None and self.native.accepts(x):
            return self.native.rms_norm(x, self.scale, self.eps)
        out = F.rms_norm(x.float(), (x.shape[-1],), self.scale, self.eps)
        return out if out.dtype == x.dtype else out.to(x.dtype)


def fused_equivalent(norm: torch.nn.Module, native: NativeElementwise | None = None) -> FusedRMSNorm | None:
    """A FusedRMSNorm that gives `norm`'s output bitwise on a probe (torch's fused op), or None;
    with `native` where that agrees on the probe to within float32 rounding."""
    eps = getattr(norm, "eps", getattr(norm, "variance_epsilon", None))
    weight = getattr(norm, "weight", None)
    if not isinstance(eps, float) or (weight is not None and weight.dim() != 1):
        return None
    width = weight.shape[0] if weight is not None else getattr(norm, "dim", None)
    if not isinstance(width, int) or width < 1:
        return None
    candidates: list[torch.Tensor | None] = [None]
    if weight is not None:
        scale = weight.detach().float()
        candidates = [scale, 1.0 + scale]
    dtype, device = (weight.dtype, weight.device) if weight is not None else (torch.float32, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    probe = (torch.randn(PROBE_ROWS, width, generator=generator) * torch.logspace(-2, 2, PROBE_ROWS)[:, None])
    probe = probe.to(device=device, dtype=dtype)
    with torch.no_grad():
        expected = norm(probe)
        for candidate in candidates:
            fused = FusedRMSNorm(candidate, eps)
            if expected.shape == probe.shape and torch.equal(fused(probe), expected):
                if native is not None and native.accepts(probe):
                    with_native = FusedRMSNorm(candidate, eps, native)
                    error = (with_native(probe) - expected).abs() / expected.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
                    if bool((error <= NATIVE_TOLERANCE).all()):
                        return with_native
                return fused
    return None


def fuse_rms_norms(module: torch.nn.Module, native: NativeElementwise | None = None) -> int:
    """Replaces every *RMSNorm under `module` that has a bitwise-equal fused form;
    returns how many."""
    # A norm without an equivalent keeps its forward (and has no norms inside to swap).
    return swap_modules(module, lambda child: fused_equivalent(child, native)
                        if type(child).__name__.endswith("RMSNorm") else None)
