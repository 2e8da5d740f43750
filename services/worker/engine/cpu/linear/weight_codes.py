"""Float32 weights kept as exact 8-bit codes for few-row (decode) linears on CPU.

A checkpoint that was quantized (the default model is GGUF Q4_K_M: Q4_K, Q5_0, Q6_K and
Q8_0 blocks) and dequantized to float32 holds, in every block of 16 or 32 input entries of
a weight row, at most 256 values on one grid: `weight == scale * code + offset` exactly,
with `code` in 0..255 and one scale and offset per block. `find` checks that bit for bit
(native/coded_linear.c) and keeps such a matrix as its codes: a byte per entry and two
floats per block, about a third of the float32 bytes. The decode linear expands the codes
back into the same float32 weights in registers, so its products are the float32 linear's
and only the memory traffic, which bounds few-row linears, shrinks. A matrix with any
block off the grid (random or trained float32 weights) is left as it is.

Codes that fit in fewer bits (the default model's Q4_K blocks need 4, its Q5_0 ones 5 and its
Q6_K ones 6) are kept narrow (`narrow`): 16 bytes of nibbles per input entry of a panel and one
32-bit word per further bit, 0.5 / 0.625 / 0.75 bytes a weight instead of 1. Unpacked, they are
the same integers, so the kernel expands the same float32 weights and its outputs are the
8-bit path's bit for bit.

Prefill chunks keep the float32 weight's packed BLAS kernels by default: with hundreds of rows
a linear is bound by multiply-adds, not by reading the weight (CPU_PREFILL_WEIGHTS=codes expands
the codes for them instead, coded_wide.py).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from services.worker.engine.cpu.kernels.native_build import load_binding

GROUPS = (32, 16)        # block sizes tried, largest first (fewer scales to read)
PANEL = 32               # output rows per panel of the kernel's layout
# Rows up to which the coded kernel serves. On a 2-core Xeon the default model's 126 linears
# took 7.9 ms at 1 row, 12.5 at 8 and 22.6 at 16 (the float32 few-row kernel: 19.0, 30.0,
# 43.2), and against oneDNN's packed sgemm 21.8 / 39.5 ms at 16 rows, 43.5 / 52.8 at 32,
# 62.3 / 65.9 at 48 and 84.7 / 72.0 at 64.
MAX_ROWS = 32
NARROW_BITS = (4, 5, 6)  # narrow code widths the kernel reads (else a byte a code)
FIND_CHUNK_ROWS = 16384  # rows `find` reads at a time (40 MB of Gemma's head)
HALF_FORM_PANELS = 1024  # panels `half_form` converts at a time


@dataclass(frozen=True)
class CodedWeight:
    """A [out, in] float32 weight as codes, in the kernel's panels of PANEL output rows (the
    last one padded with zero rows): codes [ceil(out / PANEL), in, PANEL] uint8 (bits 8) or
    [ceil(out / PANEL), in, narrow_stride(bits)] (narrow codes, bits 4-6), scales and offsets
    [ceil(out / PANEL), in / group, PANEL] float32.

    The half form (`zeros` set, `half_form`): the scales as half floats and, instead of the
    offsets (None), byte zeros with offset = -zero * scale, both exact (a Q8_0 block's codes
    are that: scale * (code - zero)), 3 bytes a block instead of 8; the kernels that take it
    (native/half_scales.h) give the same outputs from either form."""
    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    group: int
    out_features: int
    in_features: int
    bits: int = 8
    zeros: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.offsets, self.zeros)
                   if t is not None)

    @property
    def half(self) -> bool:
        return self.zeros is not None

    def scale_pointers(self) -> tuple[int | None, int | None, int | None, int | None]:
        """(float scales, offsets, half scales, zeros) for the kernels that take either form:
        the form's two, None for the other two."""
        if self.zeros is not None:
            return None, None, self.scales.data_ptr(), self.zeros.data_ptr()
        assert self.offsets is not None
        return self.scales.data_ptr(), self.offsets.data_ptr(), None, None

    def float_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Scales and offsets as float32 (the half form's converted: the same values)."""
        if self.zeros is None:
            assert self.offsets is not None
            return self.scales, self.offsets
        scales = self.scales.float()
        return scales, self.zeros.float().neg_().mul_(scales)

    def float_form(self) -> "CodedWeight":
        """This weight with float32 scales and offsets (itself when it has them)."""
        if self.zeros is None:
            return self
        scales, offsets = self.float_scales()
        return CodedWeight(self.codes, scales, offsets, self.group, self.out_features, self.in_features, self.bits)

    def half_form(self) -> "CodedWeight | None":
        """This weight in the half form where every scale is a finite half float exactly and
        every offset exactly -zero * scale with zero an integer in [0, 255] (a zero scale
        taking zero 0 and a zero offset), checked; else None. 8-bit codes only."""
        if self.zeros is not None:
            return self
        if self.bits != 8 or self.offsets is None:
            return None
        half = torch.empty(self.scales.shape, dtype=torch.float16)
        zeros = torch.empty(self.scales.shape, dtype=torch.uint8)
        # A chunk of panels at a time: the checks' temporaries of the whole (Gemma's head: ~20 MB
        # each, five at once) would raise a starting worker's peak by ~100 MB.
        for start in range(0, self.scales.shape[0], HALF_FORM_PANELS):
            end = start + HALF_FORM_PANELS
            if not _half_chunk(self.scales[start:end], self.offsets[start:end], half[start:end], zeros[start:end]):
                return None
        return CodedWeight(self.codes, half, None, self.group, self.out_features, self.in_features, self.bits, zeros)

    def panel_rows(self, start: int, end: int) -> "CodedWeight":
        """Output rows [start, end) as a weight of their own (views; `start` on a panel's
        first row)."""
        first, last = start // PANEL, -(-end // PANEL)
        return CodedWeight(self.codes[first:last], self.scales[first:last],
                           None if self.offsets is None else self.offsets[first:last], self.group, end - start,
                           self.in_features, self.bits, None if self.zeros is None else self.zeros[first:last])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The float32 weight rows `ids` ([N] -> [N, in]), bit for bit: `find` checked that
        scale * code, rounded, plus offset, rounded, gives every value back."""
        ids = ids.reshape(-1).to(torch.long)
        panel, lane = ids // PANEL, ids % PANEL
        codes = self.code_rows(ids).view(ids.numel(), -1, self.group)
        scales = self.scales[panel, :, lane].float()
        offsets = (self.zeros[panel, :, lane].float().neg_().mul_(scales) if self.zeros is not None
                   else self.offsets[panel, :, lane])
        values = codes.float().mul_(scales[..., None]).add_(offsets[..., None])
        return values.view(ids.numel(), self.in_features)

    def code_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The codes of weight rows `ids` ([N] -> [N, in] uint8), narrow ones unpacked."""
        ids = ids.reshape(-1).to(torch.long)
        panel, lane = ids // PANEL, ids % PANEL
        return self.codes[panel, :, lane] if self.bits == 8 else _narrow_lanes(self.codes, self.bits, panel, lane)


def _half_chunk(scales: torch.Tensor, offsets: torch.Tensor, half: torch.Tensor, zeros: torch.Tensor) -> bool:
    """Writes `scales` as half floats into `half` and -offsets / scales as bytes into `zeros`
    where both are exact (`CodedWeight.half_form`); False where one is not."""
    if not bool(torch.isfinite(scales).all()):
        return False
    half.copy_(scales)
    if not torch.equal(half.float(), scales):
        return False
    found = torch.where(scales != 0, -offsets / torch.where(scales != 0, scales, 1), 0).round()
    if not bool(((found >= 0) & (found <= 255)).all()):
        return False
    zeros.copy_(found)
    return torch.equal(zeros.float().neg_().mul_(scales), offsets)


def narrow_stride(bits: int) -> int:
    """Bytes per input entry of a panel of narrow codes of `bits` (native/coded_linear.c)."""
    return 16 + 4 * (bits - 4)


def _narrow_lanes(codes: torch.Tensor, bits: int, panel: torch.Tensor, lane: torch.Tensor) -> torch.Tensor:
    """The codes of rows `lane` of panels `panel` ([N] each) from narrow codes: [N, in] uint8."""
    nibbles = codes[panel, :, lane % 16].to(torch.int32)
    values = (nibbles >> (4 * (lane >= 16).to(torch.int32))[:, None]) & 15
    if bits == 4:
        return values.to(torch.uint8)
    words = codes[panel, :, 16:].contiguous().view(torch.int32).view(panel.numel(), codes.shape[1], bits - 4)
    for high in range(bits - 4):
        values |= ((words[..., high] >> lane[:, None].to(torch.int32)) & 1) << (4 + high)
    return values.to(torch.uint8)


def _panels(rows_major: torch.Tensor) -> torch.Tensor:
    """[out, n] -> [ceil(out / PANEL), n, PANEL], the last panel padded with zero rows."""
    out, n = rows_major.shape
    count = -(-out // PANEL)
    padded = torch.zeros(count * PANEL, n, dtype=rows_major.dtype)
    padded[:out] = rows_major
    return padded.view(count, PANEL, n).transpose(1, 2).contiguous()


class NativeCodedLinear:
    """ctypes bindings of native/coded_linear.c."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._find = library.fairserve_codes_find
        self._find.restype = ctypes.c_int
        self._find.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 3 + [ctypes.c_int64]
        self._linear = library.fairserve_coded_linear
        self._linear.restype = ctypes.c_int
        self._linear.argtypes = ([ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 2
                                 + [ctypes.c_int64] * 4)
        self._linear_half = library.fairserve_coded_linear_half
        self._linear_half.restype = ctypes.c_int
        self._linear_half.argtypes = self._linear.argtypes
        self._narrow = library.fairserve_codes_narrow
        self._narrow.restype = ctypes.c_int
        self._narrow.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        self._widen = library.fairserve_codes_widen
        self._widen.restype = None
        self._widen.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        self._expand_rows = library.fairserve_codes_expand_rows
        self._expand_rows.restype = ctypes.c_int
        self._expand_rows.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 2 + [ctypes.c_void_p] + [ctypes.c_int64] * 3
        self._expand_blocked = library.fairserve_codes_expand_blocked
        self._expand_blocked.restype = ctypes.c_int
        self._expand_blocked.argtypes = ([ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_void_p]
                                         + [ctypes.c_int64] * 4)

    @property
    def linear_function(self) -> ctypes._CFuncPtr:
        """The C linear itself (native_layers.py calls it from C)."""
        return self._linear

    def find(self, weight: torch.Tensor, after_rows: Callable[[torch.Tensor], object] | None = None,
             chunk_rows: int = FIND_CHUNK_ROWS) -> CodedWeight | None:
        """The codes of a float32 CPU [out, in] weight, or None when it does not fit them
        exactly (or its shape does not fit the kernel's panels).

        The rows are read `chunk_rows` at a time (a multiple of PANEL), each chunk's codes
        written straight into the panels, so that finding the codes of a large matrix (Gemma's
        262k x 640 head) holds no full-size temporaries beside them; `after_rows` is called with
        each chunk of the weight once it has been read (the loader lets a checkpoint's mapped
        pages of it go there: cpu/host_memory.py)."""
        if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
            return None
        if chunk_rows < PANEL or chunk_rows % PANEL:
            raise ValueError(f"find: chunks of {chunk_rows} rows (a positive multiple of {PANEL})")
        weight = weight.detach().contiguous()
        out_features, in_features = weight.shape
        for group in GROUPS:
            if in_features % group:
                continue
            panels = -(-out_features // PANEL)
            codes = torch.zeros(panels, in_features, PANEL, dtype=torch.uint8)
            scales = torch.zeros(panels, in_features // group, PANEL)
            offsets = torch.zeros_like(scales)
            if self._find_chunks(weight, group, (codes, scales, offsets), after_rows, chunk_rows):
                return CodedWeight(codes, scales, offsets, group, out_features, in_features)
        return None

    def _find_chunks(self, weight: torch.Tensor, group: int, panels: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                     after_rows: Callable[[torch.Tensor], object] | None, chunk_rows: int) -> bool:
        """Writes the codes, scales and offsets of `weight` at `group` into `panels`, chunk by
        chunk; False at the first chunk that does not fit them (the rest is not read)."""
        out_features, in_features = weight.shape
        for start in range(0, out_features, chunk_rows):
            rows = weight[start:start + chunk_rows]
            count = rows.shape[0]
            codes = torch.empty(count, in_features, dtype=torch.uint8)
            scales = torch.empty(count, in_features // group)
            offsets = torch.empty_like(scales)
            failed = self._find(rows.data_ptr(), count, in_features, group, codes.data_ptr(), scales.data_ptr(),
                                offsets.data_ptr(), torch.get_num_threads())
            if after_rows is not None:
                after_rows(rows)
            if failed:
                return False
            first = start // PANEL
            for target, values in zip(panels, (codes, scales, offsets)):
                chunk = _panels(values)
                target[first:first + chunk.shape[0]] = chunk
        return True

    def narrow(self, coded: CodedWeight) -> CodedWeight:
        """`coded` (8-bit) with its codes in the fewest of NARROW_BITS that hold them all, or as
        it is when none does. The narrow codes are unpacked again and must give every code
        back (so, through `find`'s check, every float32 weight bit for bit)."""
        if coded.bits != 8:
            return coded
        bits = max(NARROW_BITS[0], int(coded.codes.max()).bit_length())
        if bits not in NARROW_BITS:
            return coded
        entries = coded.codes.shape[0] * coded.codes.shape[1]
        narrow = torch.empty(*coded.codes.shape[:2], narrow_stride(bits), dtype=torch.uint8)
        if self._narrow(coded.codes.data_ptr(), entries, bits, narrow.data_ptr()):
            return coded
        if not torch.equal(self.widen(narrow, bits), coded.codes):
            return coded
        return CodedWeight(narrow, coded.scales, coded.offsets, coded.group, coded.out_features, coded.in_features,
                           bits)

    def widen(self, narrow: torch.Tensor, bits: int) -> torch.Tensor:
        """Narrow codes [panels, in, narrow_stride(bits)] back to [panels, in, PANEL] bytes."""
        codes = torch.empty(*narrow.shape[:2], PANEL, dtype=torch.uint8)
        self._widen(narrow.contiguous().data_ptr(), narrow.shape[0] * narrow.shape[1], bits, codes.data_ptr())
        return codes

    def expand(self, coded: CodedWeight) -> torch.Tensor:
        """The float32 weight the codes stand for ([out, in], a tensor of its own)."""
        return self.expand_into(coded, torch.empty(coded.out_features * coded.in_features))

    def expand_into(self, coded: CodedWeight, out: torch.Tensor) -> torch.Tensor:
        """The float32 weight ([out, in]) written into `out` (contiguous float32 of at least
        out * in entries, e.g. a scratch many linears share); returns that view."""
        weight = out.reshape(-1)[:coded.out_features * coded.in_features].view(coded.out_features,
                                                                                coded.in_features)
        status = self._expand_rows(coded.codes.data_ptr(), *coded.scale_pointers(), coded.group, coded.bits,
                                   weight.data_ptr(), coded.in_features, coded.out_features, torch.get_num_threads())
        if status:
            raise ValueError(f"coded expansion: shapes it does not take ({coded.out_features} x "
                             f"{coded.in_features}, group {coded.group}, {coded.bits} bits)")
        return weight

    def expand_blocked(self, coded: CodedWeight, address: int, block: int) -> None:
        """The float32 weight written at `address` (out * in floats) in the blocked layout
        [out / block][in][block] (coded_wide.py: the layout of oneDNN's pack). Float scales only
        (the layers': the half form is the LM head's)."""
        if coded.offsets is None:
            raise ValueError("coded expansion: the blocked layout takes float scales and offsets, not the half form")
        status = self._expand_blocked(coded.codes.data_ptr(), coded.scales.data_ptr(), coded.offsets.data_ptr(),
                                      coded.group, coded.bits, address, coded.in_features, coded.out_features,
                                      block, torch.get_num_threads())
        if status:
            raise ValueError(f"coded expansion: a blocked layout it does not take ({coded.out_features} x "
                             f"{coded.in_features}, block {block}, group {coded.group}, {coded.bits} bits)")

    def __call__(self, rows: torch.Tensor, coded: CodedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        """rows [M, in] (float32, contiguous) @ weight.T (+ bias) -> [M, out]."""
        if rows.shape[-1] != coded.in_features:
            raise ValueError(f"rows of {rows.shape[-1]} entries for a weight of {coded.in_features} inputs")
        out = torch.empty(rows.shape[0], coded.out_features)
        scales, offsets, half, zeros = coded.scale_pointers()
        linear = self._linear if half is None else self._linear_half
        status = linear(rows.data_ptr(), coded.codes.data_ptr(), scales if half is None else half,
                        offsets if half is None else zeros, coded.group, coded.bits,
                        bias.data_ptr() if bias is not None else None, out.data_ptr(), rows.shape[0],
                        coded.in_features, coded.out_features, torch.get_num_threads())
        if status:
            raise ValueError(f"coded linear: shapes it does not take ({coded.out_features} x {coded.in_features}, "
                             f"group {coded.group}, {coded.bits} bits)")
        return out


def load_coded_linear(cache_dir: Path) -> NativeCodedLinear | None:
    return load_binding(NativeCodedLinear, "coded_linear", cache_dir, "float32 weights serve")
