"""The LM head screen's one-row pass from a 4-bit plane of the head's codes (LM_HEAD_SCREEN_PLANE).

A batch-1 decode step, and the last step of a prompt whose prefix is cached, screens one hidden
state against the whole head: on Gemma 3's Q8_0 head, 168 MB of 8-bit codes and 16 MB of half
scales and zeros, a pass bound by memory (2-4 ms on a 2-core AMD EPYC Zen 5, as much as the rest
of a cached prompt's last step). The plane keeps each code's high nibble, half a byte a weight
(84 MB more on that head), and a one-row step reads

  1. the plane and the scales (5/8 of the bytes): an upper value for every token, at least what
     the full codes kernel gives it less that kernel's rounding (native/codes_screen_plane.c);
  2. the k best tokens by those values, their exact logits, and so a threshold: the k-th best
     exact logit is at least their least;
  3. the codes of only the panels (32 tokens each) whose largest upper value reaches the
     threshold less the screen's widest bound: every other token's exact logit is below the
     threshold, so none of them can be among the k best; those panels' values are the full
     kernel's, bit for bit (`fairserve_codes_screen_half_panels`);
  4. the screen's own pick over those panels (native/screen_pick.c), as without the plane.

So the logits a greedy or top-k draw reads are the same exact ones; what changes is the bytes
read: the plane, the scales and a few hundred panels instead of every code. Off by default: it
costs the plane's memory (a worker with a 64-block pool at ~0.7 GB gains 84 MB), which a
deployment that wants batch-1 latency more than memory may spend. Built for heads kept as 8-bit
codes in the half form (scale * (code - zero): a Q8_0 head) on CPUs with AVX-512BW or AVX2; elsewhere
it is not built (logged) and the screen reads the codes.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import torch

from services.worker.engine.cpu.screen.int8_matmul import PANEL, BoundNorms, NativeInt8Matmul, Quantized
from services.worker.engine.cpu.linear.weight_codes import CodedWeight

BUILD_PANELS = 1024         # panels the plane is built from at a time (~20 MB of codes)

log = logging.getLogger(__name__)


def build_plane(coded: CodedWeight) -> torch.Tensor:
    """The plane of `coded`'s 8-bit codes [panels, in, PANEL]: [panels, in / 2, 32] uint8, byte w of
    input pair j holding the high nibble of row w // 2 at input 2 j + w % 2 (low nibble) and that
    of row 16 + w // 2 (high nibble), the layout native/codes_screen_plane.c reads."""
    panels, inputs, rows = coded.codes.shape
    if coded.bits != 8 or rows != PANEL or inputs % 2:
        raise ValueError(f"a codes plane needs 8-bit codes in panels of {PANEL} rows and an even input count")
    plane = torch.empty(panels, inputs // 2, 32, dtype=torch.uint8)
    for start in range(0, panels, BUILD_PANELS):
        high = coded.codes[start:start + BUILD_PANELS] >> 4                  # [n, in, 32]
        pairs = high.view(-1, inputs // 2, 2, PANEL).transpose(2, 3)         # [n, in / 2, 32 rows, 2 inputs]
        first = pairs[:, :, :16].reshape(-1, inputs // 2, 32)
        second = pairs[:, :, 16:].reshape(-1, inputs // 2, 32)
        plane[start:start + BUILD_PANELS] = first | (second << 4)
    return plane


@dataclass(frozen=True)
class ScreenedRow:
    """A one-row pass's approximate logits and panel maxima, ready for the screen's pick."""
    approx: torch.Tensor
    maxima: torch.Tensor
    panels_read: int


class CodesPlane:
    """The plane of one head's codes and the two C calls that read it."""

    def __init__(self, library: ctypes.CDLL, coded: CodedWeight) -> None:
        self._upper = library.fairserve_codes_plane_screen
        self._upper.restype = ctypes.c_int
        self._upper.argtypes = ([ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_float]
                                + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3)
        self._pass = library.fairserve_codes_plane_pass
        self._pass.restype = ctypes.c_int64
        self._pass.argtypes = ([ctypes.c_void_p] * 4 + [ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64]
                               + [ctypes.c_double] + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3)
        self._panels = library.fairserve_codes_screen_half_panels
        self._panels.restype = ctypes.c_int
        self._panels.argtypes = ([ctypes.c_void_p] * 3 + [ctypes.c_int64] + [ctypes.c_void_p] * 4
                                 + [ctypes.c_int64] * 3 + [ctypes.c_void_p] + [ctypes.c_int64] * 2)
        self.coded = coded
        self.plane = build_plane(coded)

    @classmethod
    def create(cls, native: NativeInt8Matmul, coded: CodedWeight) -> CodesPlane | None:
        """The plane of `coded`, or None (logged) where the kernel does not serve it: codes not
        8-bit in the half form, a group not a multiple of 4, or a CPU without AVX2."""
        fast = native.library.fairserve_codes_plane_fast
        fast.restype = ctypes.c_int
        if coded.bits != 8 or not coded.half or coded.group % 4 or coded.in_features % 2:
            log.warning("LM head screen plane not built: it needs 8-bit codes with half scales and zeros "
                        "(a Q8_0 head); the screen reads the codes")
            return None
        if not fast():
            log.warning("LM head screen plane not built: its kernel needs AVX2 (or AVX-512BW); the screen reads the codes")
            return None
        return cls(native.library, coded)

    @property
    def nbytes(self) -> int:
        return self.plane.numel()

    def upper(self, q: torch.Tensor, x_scale: float, out: torch.Tensor, maxima: torch.Tensor) -> None:
        """Upper values [V] of one int16 row q [in] (times x_scale) into `out`, each panel's
        largest into `maxima` [ceil(V / PANEL)] (native/codes_screen_plane.c)."""
        coded = self.coded
        assert coded.zeros is not None
        status = self._upper(self.plane.data_ptr(), coded.scales.data_ptr(), coded.zeros.data_ptr(), coded.group,
                             q.data_ptr(), x_scale, out.data_ptr(), maxima.data_ptr(), coded.out_features,
                             coded.in_features, torch.get_num_threads())
        if status:
            raise ValueError(f"codes plane: shapes it does not take ({coded.out_features} x {coded.in_features}, "
                             f"group {coded.group})")

    def full_panels(self, quantized: Quantized, panels: torch.Tensor, out: torch.Tensor,
                    maxima: torch.Tensor) -> None:
        """The full codes kernel's values [1, V] and maxima [1, P] of the listed panels alone."""
        coded = self.coded
        assert coded.zeros is not None
        panels = panels.to(torch.long).contiguous()
        status = self._panels(coded.codes.data_ptr(), coded.scales.data_ptr(), coded.zeros.data_ptr(), coded.group,
                              quantized.q.data_ptr(), quantized.scale.data_ptr(), out.data_ptr(), maxima.data_ptr(),
                              coded.out_features, coded.in_features, 1, panels.data_ptr(), panels.numel(),
                              torch.get_num_threads())
        if status:
            raise ValueError("codes plane: panels out of range or shapes the codes kernel does not take")

    def screen_row(self, x: torch.Tensor, quantized: Quantized, count: int, norms: BoundNorms,
                   approx: torch.Tensor) -> ScreenedRow:
        """Steps 1-3 for one row x [1, in] float32 (its rounding `quantized`) whose draw reads its
        `count` best logits, in one C call: approx [1, V] holds the full kernel's values on every
        panel that can hold one of them, and maxima [1, P] are those panels' maxima, -inf
        elsewhere, so the screen's pick reads those panels alone."""
        coded = self.coded
        assert coded.zeros is not None
        maxima = torch.empty(1, -(-coded.out_features // PANEL))
        x = x.float().contiguous()
        widest = (float(quantized.norms[0]) * (norms.max_error + norms.slack)
                  + float(quantized.activation_error[0]) * norms.max_quant)
        read = self._pass(self.plane.data_ptr(), coded.codes.data_ptr(), coded.scales.data_ptr(),
                          coded.zeros.data_ptr(), coded.group, quantized.q.data_ptr(), quantized.scale.data_ptr(),
                          x.data_ptr(), count, widest, approx.data_ptr(), maxima.data_ptr(), coded.out_features,
                          coded.in_features, torch.get_num_threads())
        if read == -3:
            raise MemoryError("codes plane: no memory for its panel list")
        if read < 0:
            raise ValueError(f"codes plane: {count} best tokens of {coded.out_features} x {coded.in_features} "
                             f"codes, group {coded.group}")
        return ScreenedRow(approx, maxima, read)
