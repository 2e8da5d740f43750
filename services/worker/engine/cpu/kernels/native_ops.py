"""ctypes bindings of `native/elementwise.c`: a fused RMSNorm, a fused gated activation
(GELU-tanh or SiLU of the gate times the up projection) and the rotary embedding of a
step's query and key heads, CPU float32, one pass each."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from services.worker.engine.cpu.kernels.native_build import load_binding

ACTIVATIONS = {"gelu_tanh": 0, "silu": 1}


class NativeElementwise:
    def __init__(self, library: ctypes.CDLL) -> None:
        self._rms_norm = library.fairserve_rms_norm
        self._rms_norm.restype = None
        self._rms_norm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_int64]
        self._act_mul = library.fairserve_act_mul
        self._act_mul.restype = None
        self._act_mul.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
                                  + [ctypes.c_int64] * 4)
        self._rope = library.fairserve_rope
        self._rope.restype = None
        self._rope.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
                               + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3)

    # The C functions themselves, for native_layers.py to call from C.
    @property
    def rms_norm_function(self) -> ctypes._CFuncPtr:
        return self._rms_norm

    @property
    def act_mul_function(self) -> ctypes._CFuncPtr:
        return self._act_mul

    @property
    def rope_function(self) -> ctypes._CFuncPtr:
        return self._rope

    @staticmethod
    def accepts(*tensors: torch.Tensor) -> bool:
        return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)

    def rms_norm(self, x: torch.Tensor, scale: torch.Tensor | None, eps: float) -> torch.Tensor:
        """(x * rsqrt(mean(x^2, -1) + eps)) * scale over the last dimension; float32 CPU."""
        x = x.contiguous()
        dim = x.shape[-1]
        out = torch.empty_like(x)
        self._rms_norm(x.data_ptr(), scale.data_ptr() if scale is not None else None, out.data_ptr(),
                       x.numel() // dim if dim else 0, dim, eps, torch.get_num_threads())
        return out

    def act_mul(self, gate: torch.Tensor, up: torch.Tensor, activation: str,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """activation(gate) * up, both [..., dim] with unit stride in the last dimension; into
        `out` where given (contiguous float32 of their shape; `gate` itself may be it: each
        element is read before its own is written)."""
        if gate.shape != up.shape:
            raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
        if out is not None and (out.shape != gate.shape or out.dtype != torch.float32 or not out.is_contiguous()):
            raise ValueError(f"out {tuple(out.shape)} {out.dtype} is not a contiguous float32 {tuple(gate.shape)}")
        dim = gate.shape[-1]
        gate2, up2 = gate.reshape(-1, dim), up.reshape(-1, dim)
        if gate2.stride(-1) != 1 or up2.stride(-1) != 1:
            gate2, up2 = gate2.contiguous(), up2.contiguous()
        out = torch.empty(gate.shape, dtype=torch.float32) if out is None else out
        self._act_mul(gate2.data_ptr(), gate2.stride(0), up2.data_ptr(), up2.stride(0), out.data_ptr(),
                      gate2.shape[0], dim, ACTIVATIONS[activation], torch.get_num_threads())
        return out

    def rope(self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """query [T, H, d] and key [T, KVH, d] (contiguous float32) rotated in place by
        cos and sin [T, d]: x * cos + rotate_half(x) * sin, as transformers' RoPE."""
        rows, dim = cos.shape[-2], cos.shape[-1]
        cos, sin = cos.reshape(rows, dim).contiguous(), sin.reshape(rows, dim).contiguous()
        if (query.shape[0] != rows or key.shape[0] != rows or query.shape[-1] != dim or key.shape[-1] != dim
                or dim % 2 or not (query.is_contiguous() and key.is_contiguous())):
            raise ValueError(f"rope: query {tuple(query.shape)}, key {tuple(key.shape)}, cos {tuple(cos.shape)}")
        self._rope(query.data_ptr(), query.shape[1], key.data_ptr(), key.shape[1], cos.data_ptr(), sin.data_ptr(),
                   rows, dim, torch.get_num_threads())


def load_elementwise(cache_dir: Path) -> NativeElementwise | None:
    return load_binding(NativeElementwise, "elementwise", cache_dir, "torch's ops serve")


class NativeSkinnyLinear:
    """ctypes binding of fairserve_skinny_linear (native/skinny_linear.c): x @ weight.T (+ bias)
    for a few rows, streaming the float32 weight once."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._function = library.fairserve_skinny_linear
        self._function.restype = None
        self._function.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4

    def __call__(self, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """rows [M, in] and weight [out, in], float32 CPU, contiguous -> [M, out]."""
        out = torch.empty(rows.shape[0], weight.shape[0])
        self._function(rows.data_ptr(), weight.data_ptr(), bias.data_ptr() if bias is not None else None,
                       out.data_ptr(), rows.shape[0], rows.shape[1], weight.shape[0], torch.get_num_threads())
        return out


def load_skinny_linear(cache_dir: Path) -> NativeSkinnyLinear | None:
    return load_binding(NativeSkinnyLinear, "skinny_linear", cache_dir, "packed BLAS kernels serve")
