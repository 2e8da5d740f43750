"""A scripted stand-in for the scheduler (no processes, no gRPC)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import uvicorn

from common.types import TokenLogprob, TopLogprob, Usage
from services.gateway.requests.backend import (
    BackendError,
    Finish,
    GenerationEvent,
    GenerationSpec,
    ModelInfo,
    Readiness,
    SchedulerLost,
    SchedulerView,
    TokenOutput,
    Unavailable,
    WorkerView,
)

EOS_ID = 1


@dataclass(frozen=True)
class SentRequest:
    """One generate call the fake received."""
    spec: GenerationSpec
    request_id: str
    trace_id: str


@dataclass
class FakeScheduler:
    """Replies with `reply_ids` (cut at max_tokens), one event per token.

    A token in stop_token_ids or EOS (unless ignore_eos) ends the request with
    "stop". Cancel() ends a running stream with "cancelled" at the next token.

    Losing the scheduler: each entry of `lose_after` drops one call's connection
    (SchedulerLost) after that many tokens; the calls after a loss raise the
    errors of `after_loss` in turn (a scheduler restarting), or SchedulerLost
    for ever with `stay_down`. A continuation (resume_token_ids) streams the
    reply from after its resumed tokens, as the scheduler does.
    """
    reply_ids: Sequence[int] | Callable[[GenerationSpec], Sequence[int]] = ()
    token_delay_s: float = 0.0
    reject: BackendError | None = None
    finish_error: str | None = None
    cached_tokens: int = 0
    model_len: int | None = 512
    vocab_size: int | None = None  # None: no worker has told it yet
    default_kv_policy: str = "full"  # the scheduler's KV_POLICY
    healthy_workers: int = 1
    kvcache_serving: bool = True
    readiness_probes: int = 0
    requests: list[SentRequest] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    abandoned: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    lose_after: list[int] = field(default_factory=list)
    after_loss: list[BackendError] = field(default_factory=lambda: [
        SchedulerLost("failed to connect to all addresses"), Unavailable("no worker is registered")])
    stay_down: bool = False
    scheduler_seen: bool = True
    _refusing: list[BackendError] = field(default_factory=list, init=False, repr=False)
    _down: bool = field(default=False, init=False, repr=False)

    def reply_for(self, spec: GenerationSpec) -> list[int]:
        if callable(self.reply_ids):
            return list(self.reply_ids(spec))
        return list(self.reply_ids)

    async def generate(self, spec: GenerationSpec, request_id: str,
                       trace_id: str = "") -> AsyncIterator[GenerationEvent]:
        self.requests.append(SentRequest(spec, request_id, trace_id))
        if self._down or self._refusing:
            raise self._refusing.pop(0) if self._refusing else SchedulerLost("failed to connect")
        if self.reject is not None:
            raise self.reject
        produced = len(spec.resume_token_ids)
        lose_at = self.lose_after.pop(0) if self.lose_after else None
        done = False
        try:
            for token_id in self.reply_for(spec)[produced:spec.max_tokens]:
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                if lose_at is not None and produced - len(spec.resume_token_ids) == lose_at:
                    self._down, self._refusing = self.stay_down, list(self.after_loss)
                    raise SchedulerLost("Socket closed")
                if request_id in self.cancelled:
                    done = True
                    yield self._finish(spec, "cancelled", produced)
                    return
                first = produced == len(spec.resume_token_ids)
                produced += 1
                token = (TokenOutput(token_id, self._logprob(spec, token_id)),)
                # As the scheduler: the prompt's logprobs come with the first tokens.
                scored = self.prompt_logprobs(spec) if first and spec.sampling.prompt_logprobs else ()
                ends = token_id in spec.stop_token_ids or (
                    token_id == EOS_ID and not spec.ignore_eos and produced >= spec.min_tokens)
                if ends:  # like the scheduler: the last token and the finish travel together
                    done = True
                    yield GenerationEvent(tokens=token, finish=self._finish(spec, "stop", produced).finish,
                                          prompt_logprobs=scored)
                    return
                yield GenerationEvent(tokens=token, prompt_logprobs=scored)
            done = True
            if self.finish_error is not None:
                yield GenerationEvent(finish=Finish("error", Usage(0, 0, 0), self.finish_error))
                return
            reason = "length" if produced >= spec.max_tokens else "stop"
            yield self._finish(spec, reason, produced)
        finally:
            (self.finished if done else self.abandoned).append(request_id)

    def _finish(self, spec: GenerationSpec, reason: str, produced: int) -> GenerationEvent:
        usage = Usage(len(spec.prompt_token_ids), produced, self.cached_tokens)
        return GenerationEvent(finish=Finish(reason, usage))

    @staticmethod
    def prompt_logprobs(spec: GenerationSpec) -> tuple[TokenLogprob, ...]:
        """Prompt position p (from 1) scores -p / 10 with rank p, its alternatives token 3
        (-0.05, rank 1), then the prompt's token, then token 5 (-9.0)."""
        prompt = spec.prompt_token_ids
        top = spec.sampling.prompt_top_logprobs
        return tuple(TokenLogprob(-position / 10, (TopLogprob(3, -0.05), TopLogprob(prompt[position], -position / 10),
                                                   TopLogprob(5, -9.0))[:top], rank=position)
                     for position in range(1, len(prompt)))

    @staticmethod
    def _logprob(spec: GenerationSpec, token_id: int) -> TokenLogprob | None:
        if not spec.sampling.logprobs:
            return None
        top = (TopLogprob(token_id, -0.25), TopLogprob(token_id + 1, -1.5), TopLogprob(7, -3.0))
        return TokenLogprob(-0.25, top[:spec.sampling.top_logprobs])

    async def cancel(self, request_id: str) -> bool:
        self.cancelled.append(request_id)
        return True

    async def detached(self, request_id: str, client_id: str) -> GenerationSpec | None:
        return None      # detached requests live in a real scheduler (tests/integration)

    async def scheduler_stats(self) -> SchedulerView:
        workers = tuple(WorkerView(f"w{index}", f"127.0.0.1:{50061 + index}", True)
                        for index in range(self.healthy_workers))
        return SchedulerView(workers=workers, details={"pending": 0, "workers": len(workers)})

    async def kvcache_stats(self) -> dict[str, Any]:
        return {"lookups": 0, "backend": "memory"}

    async def readiness(self) -> Readiness:
        self.readiness_probes += 1
        dependencies = (("scheduler", True), ("kvcache", self.kvcache_serving))
        if self.healthy_workers < 1:
            return Readiness(False, "no healthy worker is registered with the scheduler", dependencies)
        return Readiness(True, "", dependencies)

    async def model_info(self) -> ModelInfo:
        return ModelInfo(max_model_len=self.model_len, vocab_size=self.vocab_size,
                         default_kv_policy=self.default_kv_policy)

    async def close(self) -> None:
        return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerThread:
    """Serves an ASGI app with uvicorn on a free port in a background thread."""

    def __init__(self, app: Any, **config_args: Any) -> None:
        self.port = free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                lifespan="off", log_config=None, **config_args)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise TimeoutError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *_exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


class GrpcThread:
    """Serves the gateway's gRPC text API over `state` on a free port, on an
    event loop of its own in a background thread (for synchronous clients)."""

    def __init__(self, state: Any, max_receive_bytes: int | None = None) -> None:
        self._state = state
        self._max_receive_bytes = max_receive_bytes
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: Any = None
        self.port = 0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _start(self) -> None:
        from common.transport.grpc_server import GrpcServer
        from services.gateway.doors.grpc_api import SERVICE_NAME, TextGenerationServicer, add_to_server

        self._server = GrpcServer([(add_to_server, TextGenerationServicer(self._state))],
                                  [SERVICE_NAME], "127.0.0.1", 0,
                                  max_receive_bytes=self._max_receive_bytes)
        await self._server.start()
        self.port = self._server.port

    def __enter__(self) -> GrpcThread:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        return self

    def __exit__(self, *_exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._server.stop(0), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()
