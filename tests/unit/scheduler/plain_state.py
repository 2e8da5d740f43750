"""Requests and workers built from plain values, for testing the core's
policy modules directly (no SchedulerCore, no engine)."""

from __future__ import annotations

from services.scheduler.core.state import Phase, RequestState, WorkerState
from common.step import PoolStats
from services.scheduler.core.types import RequestSpec, WorkerSpec


def make_request(arrival: int, *, priority: int = 0, client: str = "a", prompt: tuple[int, ...] = (1, 2, 3, 4),
                 max_tokens: int = 8, seq_id: str | None = None, phase: Phase = Phase.PENDING,
                 num_computed: int = 0, worker_id: str = "w0") -> RequestState:
    spec = RequestSpec(request_id=f"r{arrival}", prompt_token_ids=prompt, max_tokens=max_tokens,
                       client_id=client, priority=priority)
    return RequestState(spec=spec, client_id=client, max_tokens=max_tokens, arrival_s=float(arrival),
                        arrival_order=arrival, worker_id=worker_id, phase=phase,
                        seq_id=seq_id if seq_id is not None or phase is Phase.PENDING else f"s{arrival}",
                        num_computed=num_computed)


def make_running(arrival: int, **fields: object) -> RequestState:
    """A request admitted on its worker (it has a seq_id)."""
    return make_request(arrival, phase=Phase.ACTIVE, **fields)  # type: ignore[arg-type]


def make_worker(worker_id: str = "w0", *, num_blocks: int = 64, free_blocks: int | None = None,
                block_size: int = 4, reserved_kv_tokens: int = 0) -> WorkerState:
    spec = WorkerSpec(worker_id=worker_id, address=f"{worker_id}:1", block_size=block_size,
                      num_blocks=num_blocks, max_model_len=4096)
    free = num_blocks if free_blocks is None else free_blocks
    pool = PoolStats(total_blocks=num_blocks, free_blocks=free, cached_blocks=0, used_blocks=num_blocks - free)
    return WorkerState(spec=spec, pool=pool, last_heartbeat_s=0.0, reserved_kv_tokens=reserved_kv_tokens)
