"""The C kernel of the LM head screen (native/int8_matmul.c) through ctypes: int16
activation rows times an int8 head packed in panels or times the head's 8-bit weight codes,
int8 rows (a scale per block) times those codes, each row's top-k, the entries above a
threshold, and float32 dot products of chosen (row, token) pairs. lm_head_screen.py says
how the screen uses them."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.worker.engine.cpu.linear.weight_codes import CodedWeight

if TYPE_CHECKING:
    from services.worker.engine.cpu.screen.codes_screen_half import HalfScales

NATIVE_TILE = 8             # activation rows the native kernel's widest tile holds
CODES_TILE = 8              # activation rows the codes kernel's widest tile holds (AVX-512)
QUADS_TILE = 8              # the same for its int8 kernel (codes_screen_quads.c)
PANEL = 32                  # vocabulary rows per panel of the native kernel's weight layout


@dataclass(frozen=True)
class Int8Panels:
    """An int8 head in the C kernel's layout: panels [ceil(V / PANEL), ceil(H / 2), PANEL, 2]
    and scales [ceil(V / PANEL) * PANEL], zero past the vocabulary."""
    panels: torch.Tensor
    scales: torch.Tensor
    vocab: int
    hidden: int


class NativeInt8Matmul:
    """ctypes binding of fairserve_int8_matmul (native/int8_matmul.c)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self.library = library          # its further entries bind where they are used (codes_plane.py)
        function = library.fairserve_int8_matmul
        function.restype = ctypes.c_int
        function.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 4
        self._function = function
        self._top_k = library.fairserve_row_top_k
        self._top_k.restype = None
        self._top_k.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 2 + [ctypes.c_int64]
        self._select = library.fairserve_select_above
        self._select.restype = ctypes.c_int64
        self._select.argtypes = ([ctypes.c_void_p] + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 3
                                 + [ctypes.c_int64, ctypes.c_void_p])
        self._gather_dot = library.fairserve_gather_dot
        self._gather_dot.restype = None
        self._gather_dot.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3
        self._codes_gather_dot = library.fairserve_codes_gather_dot
        self._codes_gather_dot.restype = ctypes.c_int
        self._codes_gather_dot.argtypes = ([ctypes.c_void_p] * 5 + [ctypes.c_int64] + [ctypes.c_void_p] * 4
                                           + [ctypes.c_int64] * 3)
        self._quantize = library.fairserve_screen_quantize
        self._quantize.restype = ctypes.c_int
        self._quantize.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 4
        self._pick = library.fairserve_screen_pick
        self._pick.restype = ctypes.c_int64
        self._pick.argtypes = ([ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 6
                               + [ctypes.c_double] * 3 + [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 2
                               + [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64])
        self._codes_screen = library.fairserve_codes_screen
        self._codes_screen.restype = ctypes.c_int
        self._codes_screen.argtypes = ([ctypes.c_void_p] * 3 + [ctypes.c_int64] + [ctypes.c_void_p] * 4
                                       + [ctypes.c_int64] * 4)
        self._codes_half = library.fairserve_codes_screen_half
        self._codes_half.restype = ctypes.c_int
        self._codes_half.argtypes = ([ctypes.c_void_p] * 3 + [ctypes.c_int64] + [ctypes.c_void_p] * 4
                                     + [ctypes.c_int64] * 4)
        self._codes_quads = library.fairserve_codes_screen_quads
        self._codes_quads.restype = ctypes.c_int
        self._codes_quads.argtypes = ([ctypes.c_void_p] * 5 + [ctypes.c_int64] + [ctypes.c_void_p] * 4
                                      + [ctypes.c_int64] * 4)
        available = library.fairserve_codes_screen_quads_available
        available.restype = ctypes.c_int
        self.has_codes_quads = bool(available())

    @staticmethod
    def pack(weight: torch.Tensor, w_scale: torch.Tensor) -> Int8Panels:
        """weight [V, H] int8 and w_scale [V] in the kernel's layout (native/int8_matmul.c):
        panels of PANEL rows, each entry pair of a row together, zero padding past V and H."""
        vocab, hidden = weight.shape
        count, pairs = -(-vocab // PANEL), -(-hidden // 2)
        padded = torch.zeros(count * PANEL, pairs * 2, dtype=torch.int8)
        padded[:vocab, :hidden] = weight
        panels = padded.view(count, PANEL, pairs, 2).transpose(1, 2).contiguous()
        scales = torch.zeros(count * PANEL)
        scales[:vocab] = w_scale
        return Int8Panels(panels, scales, vocab, hidden)

    def __call__(self, weight: Int8Panels, x: torch.Tensor, x_scale: torch.Tensor,
                 maxima: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, H] int16 and x_scale [rows] -> [rows, V] float32
        = (x @ weight.T) * x_scale[:, None] * w_scale; with `maxima` ([rows, ceil(V / PANEL)]
        float32) also each row's largest output in each panel of PANEL tokens."""
        rows, hidden = x.shape
        if hidden != weight.hidden:
            raise ValueError(f"int8 matmul: activation rows of {hidden} entries for a head of {weight.hidden}")
        pairs = weight.panels.shape[1]
        if hidden != 2 * pairs:
            x = torch.nn.functional.pad(x, (0, 2 * pairs - hidden))
        x, x_scale = x.contiguous(), x_scale.float().contiguous()
        out = torch.empty(rows, weight.vocab)
        if maxima is not None and (maxima.shape != (rows, -(-weight.vocab // PANEL)) or not maxima.is_contiguous()
                                   or maxima.dtype != torch.float32):
            raise ValueError(f"int8 matmul: maxima {tuple(maxima.shape)} for {rows} rows of {weight.vocab} tokens")
        failed = self._function(weight.panels.data_ptr(), weight.scales.data_ptr(), x.data_ptr(), x_scale.data_ptr(),
                                out.data_ptr(), maxima.data_ptr() if maxima is not None else None, weight.vocab,
                                pairs, rows, torch.get_num_threads())
        if failed:
            raise ValueError("int8 matmul: an empty head")
        return out

    def codes_screen(self, coded: CodedWeight, x: torch.Tensor, x_scale: torch.Tensor,
                     maxima: torch.Tensor | None = None, half_scales: "HalfScales | None" = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, in] int16 and x_scale [rows] -> [rows, V] float32 = (x * x_scale[:, None])
        @ weight.T from the 8-bit codes of `coded` (native/codes_screen.c rounds only in
        float32, see there); with `maxima` ([rows, ceil(V / PANEL)] float32) also each row's
        largest output in each panel of PANEL tokens. With `half_scales` (codes_screen_half.py,
        of `coded`) the kernel reads them instead of the float scales and offsets: the same
        outputs, bit for bit, from fewer bytes. `out`: [rows, V] float32 rows to write (e.g. a
        ReusedRows'), else fresh ones. A weight in the half form (weight_codes.py) is read
        through the half-scale kernel from its own half scales."""
        if coded.half:
            assert coded.zeros is not None
            half, zeros = coded.scales, coded.zeros
        elif half_scales is None:
            return self._from_codes(self._codes_screen, "", coded, x, torch.int16, x_scale.float(), maxima,
                                    out=out)
        else:
            half, zeros = half_scales.scales, half_scales.zeros
        if (half.dtype != torch.float16 or zeros.dtype != torch.uint8 or half.shape != coded.scales.shape
                or zeros.shape != coded.scales.shape or not (half.is_contiguous() and zeros.is_contiguous())):
            raise ValueError(f"codes screen: half scales {tuple(half.shape)} {half.dtype} and zeros "
                             f"{tuple(zeros.shape)} {zeros.dtype} for scales {tuple(coded.scales.shape)}")
        return self._from_codes(self._codes_half, "", coded, x, torch.int16, x_scale.float(), maxima, (half, zeros),
                                out)

    def codes_screen_quads(self, coded: CodedWeight, x: torch.Tensor, x_scales: torch.Tensor,
                           maxima: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, in] int8 and x_scales [rows, in / group] (one per block of the codes) ->
        [rows, V] float32 = (x * x_scales per block) @ weight.T from the 8-bit codes of `coded`
        (native/codes_screen_quads.c, AVX-512 VNNI and VBMI only: `has_codes_quads`); `maxima`
        and `out` as in `codes_screen`."""
        if not self.has_codes_quads:
            raise ValueError("codes screen: built without the int8 kernel (AVX-512 VNNI and VBMI)")
        blocks = coded.in_features // coded.group
        if tuple(x_scales.shape) != (x.shape[0], blocks):
            raise ValueError(f"codes screen: scales {tuple(x_scales.shape)} for {x.shape[0]} rows of {blocks} blocks")
        return self._from_codes(self._codes_quads, "the int8 kernel ", coded, x, torch.int8, x_scales.float(), maxima,
                                out=out)

    def _from_codes(self, function: ctypes._CFuncPtr, kernel: str, coded: CodedWeight, x: torch.Tensor,
                    dtype: torch.dtype, scales: torch.Tensor, maxima: torch.Tensor | None,
                    half: tuple[torch.Tensor, torch.Tensor] | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """One of the codes kernels on rows `x` of `dtype` with their `scales`, checked first
        (with `half`, half scales and zeros, the symmetric kernel, which takes no float scales or
        offsets), into `out` where given."""
        if coded.bits != 8:
            raise ValueError(f"codes screen: {coded.bits}-bit codes (it reads bytes)")
        rows, in_features = x.shape
        if in_features != coded.in_features or x.dtype != dtype:
            raise ValueError(f"codes screen: {str(dtype).removeprefix('torch.')} rows of {in_features} entries "
                             f"for a head of {coded.in_features}")
        if not _contiguous(coded):
            raise ValueError("codes screen: codes, scales and offsets must be contiguous")
        x, scales = x.contiguous(), scales.contiguous()
        if out is None:
            out = torch.empty(rows, coded.out_features)
        elif (tuple(out.shape) != (rows, coded.out_features) or out.dtype != torch.float32
              or not out.is_contiguous()):
            raise ValueError(f"codes screen: out {tuple(out.shape)} {out.dtype} for {rows} rows of "
                             f"{coded.out_features} tokens")
        if function is self._codes_quads:       # either form, by four pointers
            weight: tuple[int | None, ...] = coded.scale_pointers()
        elif half is None:
            weight = (coded.scales.data_ptr(), coded.offsets.data_ptr())
        else:
            weight = (half[0].data_ptr(), half[1].data_ptr())
        status = function(coded.codes.data_ptr(), *weight, coded.group, x.data_ptr(), scales.data_ptr(),
                          out.data_ptr(), _pointer(maxima, rows, coded.out_features), coded.out_features,
                          coded.in_features, rows, torch.get_num_threads())
        if status:
            raise ValueError(f"codes screen: shapes {kernel}it does not take ({coded.out_features} x "
                             f"{coded.in_features}, group {coded.group})" if status == 1 else "codes screen: no memory")
        return out

    def top_k(self, values: torch.Tensor, k: int, maxima: torch.Tensor | None = None) -> torch.Tensor:
        """Indices [rows, k] of each row's k largest entries (in no particular order); one pass,
        or with the matmul's panel `maxima` a look into the k best panels only."""
        rows, cols = values.shape
        if not 0 < k <= cols or not values.is_contiguous():
            raise ValueError(f"top_k needs 0 < k <= {cols} over a contiguous tensor, got k={k}")
        top = torch.empty(rows, k, dtype=torch.long)
        self._top_k(values.data_ptr(), rows, cols, k, top.data_ptr(), _pointer(maxima, rows, cols),
                    torch.get_num_threads())
        return top

    def select_above(self, values: torch.Tensor, thresholds: torch.Tensor, capacity: int,
                     maxima: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, cols) of the entries >= their row's threshold, row-major; None past `capacity`.
        With the matmul's panel `maxima` only the panels that can hold one are read."""
        rows, cols = values.shape
        thresholds = thresholds.float().contiguous()
        out_rows = torch.empty(capacity, dtype=torch.long)
        out_cols = torch.empty(capacity, dtype=torch.long)
        count = self._select(values.data_ptr(), rows, cols, thresholds.data_ptr(), out_rows.data_ptr(),
                             out_cols.data_ptr(), capacity, _pointer(maxima, rows, cols))
        return None if count < 0 else (out_rows[:count], out_cols[:count])

    def gather_dot(self, weight: torch.Tensor, x: torch.Tensor, rows: torch.Tensor,
                   ids: torch.Tensor) -> torch.Tensor:
        """[N] float32: weight[ids[i]] . x[rows[i]]; weight [V, H] and x [B, H] contiguous float32."""
        if not (weight.is_contiguous() and weight.dtype == torch.float32 and x.dtype == torch.float32):
            raise ValueError("gather_dot needs contiguous float32 weight and activations")
        x, rows, ids, out = _dot_pairs("gather_dot", x, rows, ids)
        self._gather_dot(weight.data_ptr(), x.data_ptr(), rows.data_ptr(), ids.data_ptr(), out.data_ptr(),
                         ids.numel(), weight.shape[1], torch.get_num_threads())
        return out

    def codes_gather_dot(self, coded: CodedWeight, x: torch.Tensor, rows: torch.Tensor,
                         ids: torch.Tensor) -> torch.Tensor:
        """[N] float32: coded row ids[i] . x[rows[i]], bit for bit `gather_dot` over the rows
        `coded.rows(ids)` expands, without gathering them first (8-bit codes; x [B, in]
        float32)."""
        if coded.bits != 8 or x.dtype != torch.float32 or x.shape[1] != coded.in_features:
            raise ValueError(f"codes gather_dot: {coded.bits}-bit codes of {coded.in_features} inputs, "
                             f"{str(x.dtype).removeprefix('torch.')} rows of {x.shape[1]}")
        if not _contiguous(coded):
            raise ValueError("codes gather_dot: codes, scales and offsets must be contiguous")
        x, rows, ids, out = _dot_pairs("codes gather_dot", x, rows, ids)
        status = self._codes_gather_dot(coded.codes.data_ptr(), *coded.scale_pointers(), coded.group, x.data_ptr(),
                                        rows.data_ptr(), ids.data_ptr(), out.data_ptr(), ids.numel(),
                                        coded.in_features, torch.get_num_threads())
        if status:
            raise ValueError(f"codes gather_dot: group {coded.group} for {coded.in_features} inputs")
        return out

    def screen_quantize(self, x: torch.Tensor, grid: int) -> Quantized | None:
        """Rows of x [rows, in] float32 rounded to int16 for the screen's kernel, with the norms
        its bound reads (native/screen_pick.c); None if an entry is not finite."""
        x = x.float().contiguous()
        rows, width = x.shape
        q = torch.empty(rows, width, dtype=torch.int16)
        scale, activation_error, norms = torch.empty(rows), torch.empty(rows), torch.empty(rows)
        if self._quantize(x.data_ptr(), rows, width, grid, q.data_ptr(), scale.data_ptr(),
                          activation_error.data_ptr(), norms.data_ptr()):
            return None
        return Quantized(q, scale, activation_error, norms)

    def screen_pick(self, approx: torch.Tensor, maxima: torch.Tensor, counts: list[int], x: torch.Tensor,
                    quantized: Quantized, norms: BoundNorms, coded: CodedWeight,
                    scratch: PickScratch) -> Picked | None:
        """Logits [rows, vocab]: exact at every token that can be among row r's counts[r] best,
        -inf elsewhere, from the kernel's approximate logits and their panel maxima over a head
        kept as 8-bit codes (native/screen_pick.c), written into the scratch's output rows (valid
        until its next pick); None past the scratch's capacity of exact logits."""
        rows, vocab = approx.shape
        if coded.bits != 8 or (coded.out_features, coded.in_features) != (vocab, x.shape[1]) or len(counts) != rows:
            raise ValueError(f"screen pick: {rows} x {vocab} logits, {len(counts)} counts, rows of {x.shape[1]} "
                             f"for {coded.bits}-bit codes of {coded.out_features} x {coded.in_features}")
        x = x.float().contiguous()
        pointer = _pointer(maxima, rows, vocab)
        count_list = torch.tensor(counts, dtype=torch.long)
        out = scratch.out(rows, vocab)
        cand_rows, cand_ids, values = scratch.rows, scratch.ids, scratch.values
        found = self._pick(approx.contiguous().data_ptr(), pointer, rows, vocab, count_list.data_ptr(), x.data_ptr(),
                           quantized.norms.data_ptr(), quantized.activation_error.data_ptr(),
                           norms.error.data_ptr(), norms.quant.data_ptr(), norms.slack, norms.max_error,
                           norms.max_quant, coded.codes.data_ptr(), *coded.scale_pointers(), coded.group,
                           coded.in_features, out.data_ptr(), scratch.capacity, cand_rows.data_ptr(),
                           cand_ids.data_ptr(), values.data_ptr(), torch.get_num_threads())
        if found == -1:
            return None
        if found == -2:
            raise ValueError(f"screen pick: counts {counts} (1 to {MAX_PICK}, at most the panels and the vocabulary)")
        if found < 0:
            raise MemoryError("screen pick: no memory for its best tokens")
        return Picked(out, cand_rows[:found].clone(), cand_ids[:found].clone(), values[:found].clone())


MAX_PICK = 256      # screen_pick.c's MAX_PICK: best tokens a row reads at most


class ReusedRows:
    """[rows, width] float32 rows kept between steps (one thread) and handed out again, grown
    when a step needs more: a fresh [30, 262144] tensor a step cost ~10 ms of page faults on
    the 2-core AMD EPYC, more than the screen's pick itself. What it hands out is valid until
    its next `take`."""

    def __init__(self) -> None:
        self._rows = torch.empty(0)

    def take(self, rows: int, width: int) -> torch.Tensor:
        """[rows, width] float32 rows to write (their values are the previous step's)."""
        if self._rows.shape[0] < rows or self._rows.shape[-1] != width:
            self._rows = torch.empty(rows, width)
        return self._rows[:rows]

    def release(self) -> None:
        """Lets the rows go (the next `take` allocates afresh)."""
        self._rows = torch.empty(0)


class PickScratch:
    """Room for a pick's (row, token, exact logit) triples and its logits rows (`out`, or rows of
    its own), kept between steps (one thread)."""

    def __init__(self, capacity: int, out: ReusedRows | None = None) -> None:
        self.capacity = capacity
        self.rows = torch.empty(capacity, dtype=torch.long)
        self.ids = torch.empty(capacity, dtype=torch.long)
        self.values = torch.empty(capacity)
        self._out = out if out is not None else ReusedRows()

    def out(self, rows: int, vocab: int) -> torch.Tensor:
        """[rows, vocab] float32 rows to write, the previous pick's until then."""
        return self._out.take(rows, vocab)


@dataclass(frozen=True)
class Quantized:
    """Rows rounded for the int16 kernel: q [rows, in] int16, scale, and the bound's norms
    |x - q * scale| (activation_error) and |x| per row."""
    q: torch.Tensor
    scale: torch.Tensor
    activation_error: torch.Tensor
    norms: torch.Tensor


@dataclass(frozen=True)
class BoundNorms:
    """The per-token norms of the screen's bound (lm_head_screen.py), float32 [V] each, the
    slack per unit of |x| and their maxima (the widest bound)."""
    error: torch.Tensor
    quant: torch.Tensor
    slack: float
    max_error: float
    max_quant: float


@dataclass(frozen=True)
class Picked:
    """A pick's logits [rows, vocab] and the (row, token, exact logit) it wrote."""
    logits: torch.Tensor
    rows: torch.Tensor
    ids: torch.Tensor
    values: torch.Tensor


def _dot_pairs(name: str, x: torch.Tensor, rows: torch.Tensor,
               ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, rows, ids, out) as the dot-product kernels take them: contiguous, the pairs flat
    int64 of one length, out [N] float32 to fill."""
    rows = rows.reshape(-1).to(torch.long).contiguous()
    ids = ids.reshape(-1).to(torch.long).contiguous()
    if rows.shape != ids.shape:
        raise ValueError(f"{name}: {rows.numel()} rows for {ids.numel()} ids")
    return x.contiguous(), rows, ids, torch.empty(ids.numel())


def _contiguous(coded: CodedWeight) -> bool:
    return all(t.is_contiguous() for t in (coded.codes, coded.scales, coded.offsets, coded.zeros) if t is not None)


def _pointer(maxima: torch.Tensor | None, rows: int, cols: int) -> int | None:
    """The address of panel maxima for [rows, cols] values, checked; None without them."""
    if maxima is None:
        return None
    if maxima.shape != (rows, -(-cols // PANEL)) or maxima.dtype != torch.float32 or not maxima.is_contiguous():
        raise ValueError(f"panel maxima {tuple(maxima.shape)} for values of {rows} x {cols}")
    return maxima.data_ptr()
