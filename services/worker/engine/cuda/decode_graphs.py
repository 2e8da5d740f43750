"""Decode steps replayed from captured graphs (CUDA graphs on CUDA).

At small batch sizes a GPU decode step is launch-bound: each layer is dozens
of small kernels issued one by one from Python. A decode-only step has the
same shapes every time for a given (batch, context) bucket, so the base
model's forward for that bucket is captured once into a graph and replayed:

* inputs are copied into the graph's static buffers; rows past the real batch
  are padding that writes its K/V into a scratch block no sequence owns and
  attends only to it;
* context is gathered for a fixed `context` positions per sequence with a
  mask (the decode attention path with `decode_ctx_range = (0, context)`),
  so no shape depends on the step's actual lengths;
* the LM head runs outside the graph on the real rows only, so a graph's
  persistent output is `batch x hidden`, not `batch x vocab`.

Buckets are captured lazily, the first time a step needs one. Each capture is
checked twice: its first replay must reproduce the eager forward it was
captured from, and its next replay, on new inputs, an eager forward of those
(a graph that froze something of its first inputs fails there). A capture
that raises (e.g. a host sync inside the model), a replay that does not
reproduce, or a replay that raises turns graphs off for the rest of the
process and the step runs eagerly, so a model the graphs cannot handle still
serves correctly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.worker.engine.accelerators import BaseForward, DecodeRows, GraphCapture
from services.worker.engine.step.attention import StepMetadata
from services.worker.engine.kv.kv_cache import PagedKVCache

log = logging.getLogger("worker.engine")

MIN_CONTEXT_BUCKET = 256
# A replay may differ from eager by kernel choice (rounding), not by content: a row
# read from the wrong slots is off by order 1, bfloat16 rounding by under 1 %.
REPLAY_TOLERANCE = 0.02


class CudaGraphCapture:
    """torch.cuda.CUDAGraph capture; all graphs share one memory pool (they never run at once)."""

    def __init__(self, warmup_runs: int = 2) -> None:
        self.warmup_runs = warmup_runs
        self._pool: object | None = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        # Warm-up on a side stream first, as CUDA graph capture requires (lazy inits, autotuning).
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup_runs):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = fn()
        if self._pool is None:
            self._pool = graph.pool()

        def replay() -> torch.Tensor:
            graph.replay()
            return output

        return replay


class EagerCapture:
    """Replays by running the function again: the capture contract (static buffers,
    padding rows, the scratch block, bucketed shapes) without a GPU."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        return fn


@dataclass
class _Graph:
    batch: int
    context: int
    input_ids: torch.Tensor      # [batch]
    positions: torch.Tensor      # [batch]
    slot_mapping: torch.Tensor   # [batch]
    ctx_lens: torch.Tensor       # [batch]
    block_tables: torch.Tensor   # [batch, context // block_size]
    sliding_slots: torch.Tensor | None = None    # the same two in the sliding group's blocks
    sliding_tables: torch.Tensor | None = None
    replay: Callable[[], torch.Tensor] | None = None
    rechecked: bool = False      # a replay on inputs other than the captured ones matched eager


def row_relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest per-row ||got - expected|| / ||expected||; inf when the shapes differ."""
    if got.shape != expected.shape:
        return float("inf")
    got, expected = got.float().flatten(1), expected.float().flatten(1)
    norms = expected.norm(dim=1).clamp_min(1e-6)
    return float(((got - expected).norm(dim=1) / norms).max())


def batch_buckets(max_batch: int) -> list[int]:
    small = [size for size in (1, 2, 4) if size < max_batch]
    return small + list(range(8, max_batch, 8)) + [max_batch]


def context_buckets(max_context: int, block_size: int, smallest: int = MIN_CONTEXT_BUCKET) -> list[int]:
    """Powers of two from `smallest` up to `max_context`, each rounded up to whole blocks."""
    buckets: list[int] = []
    size = max(1, smallest)
    while True:
        rounded = min(-(-size // block_size), -(-max_context // block_size)) * block_size
        if not buckets or rounded > buckets[-1]:
            buckets.append(rounded)
        if size >= max_context:
            return buckets
        size *= 2


class DecodeGraphs:
    """Captured decode forwards by (batch, context) bucket. `run` returns the hidden
    states of the real rows, or None when the step does not fit a bucket or graphs
    are off, in which case the caller runs the forward eagerly."""

    def __init__(self, forward: BaseForward, kv: PagedKVCache, cache_layer: list[int], capture: GraphCapture,
                 *, block_size: int, scratch_block: int, max_batch: int, max_context: int,
                 device: torch.device, min_context: int | None = None,
                 tolerance: float = REPLAY_TOLERANCE, sliding_scratch_block: int | None = None,
                 sliding_window: int = 0) -> None:
        if max_batch <= 0:
            raise ValueError("max_batch must be positive")
        self._forward = forward
        self._kv = kv
        self._cache_layer = cache_layer
        self._capture = capture
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.sliding_scratch_block = sliding_scratch_block   # None: one cache group
        self.sliding_window = sliding_window
        self.device = device
        self.tolerance = tolerance
        self.batch_buckets = batch_buckets(max_batch)
        self.context_buckets = context_buckets(max_context, block_size,
                                               MIN_CONTEXT_BUCKET if min_context is None else min_context)
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self.enabled = True
        self.replays = 0
        self.failure = ""

    @property
    def captured(self) -> int:
        return len(self._graphs)

    def bucket(self, num_rows: int, longest_context: int) -> tuple[int, int] | None:
        batch = next((size for size in self.batch_buckets if size >= num_rows), None)
        context = next((size for size in self.context_buckets if size >= longest_context), None)
        return None if batch is None or context is None else (batch, context)

    def run(self, rows: DecodeRows) -> torch.Tensor | None:
        if not self.enabled or not rows.token_ids:
            return None
        key = self.bucket(len(rows.token_ids), max(rows.ctx_lens))
        if key is None:
            return None
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._new_graph(*key)
            self._fill(graph, rows)
            hidden = self._capture_checked(graph)
            if hidden is None:
                return None
            self._graphs[key] = graph
        else:
            self._fill(graph, rows)
            assert graph.replay is not None
            try:
                hidden = graph.replay()
            except Exception as error:  # noqa: BLE001 - the step reruns eagerly
                self._disable(f"replaying batch {graph.batch} x context {graph.context} failed: {error!r}")
                return None
            if not graph.rechecked and not self._matches_eager(graph, hidden, "on new inputs "):
                return None
            graph.rechecked = True
        self.replays += 1
        return hidden[:len(rows.token_ids)]

    # ---- capture ---------------------------------------------------------------------------

    def _new_graph(self, batch: int, context: int) -> _Graph:
        def buffer(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=self.device)

        graph = _Graph(batch, context, buffer(batch), buffer(batch), buffer(batch), buffer(batch),
                       buffer(batch, context // self.block_size))
        if self.sliding_scratch_block is not None:
            graph.sliding_slots, graph.sliding_tables = buffer(batch), buffer(batch, context // self.block_size)
        return graph

    def _body(self, graph: _Graph) -> Callable[[], torch.Tensor]:
        def forward() -> torch.Tensor:
            # Built inside the captured function: its derived tensors (slots, masks) are
            # recomputed from the static buffers on every replay.
            meta = self._metadata(graph, graph.slot_mapping, graph.block_tables)
            if graph.sliding_slots is not None and graph.sliding_tables is not None:
                meta.sliding = self._metadata(graph, graph.sliding_slots, graph.sliding_tables)
                meta.sliding.sliding_window = self.sliding_window
            return self._forward(graph.input_ids, graph.positions, meta)

        return forward

    def _metadata(self, graph: _Graph, slots: torch.Tensor, tables: torch.Tensor) -> StepMetadata:
        return StepMetadata(
            kv=self._kv, cache_layer=self._cache_layer, block_size=self.block_size, slot_mapping=slots,
            num_decodes=graph.batch, decode_ctx_lens=graph.ctx_lens, decode_block_tables=tables,
            decode_ctx_range=(0, graph.context), prefills=[], num_tokens=graph.batch)

    def _capture_checked(self, graph: _Graph) -> torch.Tensor | None:
        """Captures `graph` from its filled buffers. Returns its first replay's output, or
        None (graphs turned off) when capturing fails or the replay differs from eager."""
        body = self._body(graph)
        try:
            # Rewriting the real rows' K/V with the same values is harmless.
            expected = body().clone()
            graph.replay = self._capture.capture(body)
            replayed = graph.replay()
        except Exception as error:  # noqa: BLE001 - any capture failure falls back to eager
            self._disable(f"capturing batch {graph.batch} x context {graph.context} failed: {error!r}")
            return None
        return replayed if self._matches_eager(graph, replayed, "", expected) else None

    def _matches_eager(self, graph: _Graph, replayed: torch.Tensor, when: str,
                       expected: torch.Tensor | None = None) -> bool:
        """Whether `replayed` matches an eager forward of the graph's current inputs; turns
        graphs off when not. The second check, on the first replay after the capture step,
        catches anything the capture froze from the inputs it was recorded with."""
        if expected is None:
            expected = self._body(graph)()
        difference = row_relative_error(replayed, expected)
        if difference <= self.tolerance:
            return True
        self._disable(f"replay of batch {graph.batch} x context {graph.context} {when}differs from the eager "
                      f"forward (largest row relative error {difference:.3g})")
        return False

    def _disable(self, reason: str) -> None:
        self.enabled = False
        self.failure = reason
        self._graphs.clear()
        log.warning("decode graphs turned off; decode steps run eagerly", extra={"reason": reason})

    # ---- inputs ----------------------------------------------------------------------------

    def _fill(self, graph: _Graph, rows: DecodeRows) -> None:
        pad = graph.batch - len(rows.token_ids)
        # Padding rows: token 0 at position 0, its K/V into the scratch block, a context of one.
        host = torch.tensor([rows.token_ids + [0] * pad, rows.positions + [0] * pad,
                             rows.ctx_lens + [1] * pad], dtype=torch.long)
        graph.input_ids.copy_(host[0], non_blocking=True)
        graph.positions.copy_(host[1], non_blocking=True)
        graph.ctx_lens.copy_(host[2], non_blocking=True)
        self._fill_group(graph, graph.slot_mapping, graph.block_tables, rows.slots, rows.block_tables,
                         self.scratch_block)
        if graph.sliding_slots is not None and graph.sliding_tables is not None:
            assert rows.sliding is not None and self.sliding_scratch_block is not None
            self._fill_group(graph, graph.sliding_slots, graph.sliding_tables, rows.sliding.slots,
                             rows.sliding.block_tables, self.sliding_scratch_block)

    def _fill_group(self, graph: _Graph, slots_buffer: torch.Tensor, tables_buffer: torch.Tensor,
                    slots: list[int], tables: list[list[int]], scratch: int) -> None:
        pad = graph.batch - len(slots)
        width = graph.context // self.block_size
        padded = [table[:width] + [scratch] * (width - len(table[:width])) for table in tables]
        padded += [[scratch] * width] * pad
        slots_buffer.copy_(torch.tensor(slots + [scratch * self.block_size] * pad, dtype=torch.long),
                           non_blocking=True)
        tables_buffer.copy_(torch.tensor(padded, dtype=torch.long).reshape(graph.batch, width), non_blocking=True)
