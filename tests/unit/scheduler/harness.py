"""Drives the scheduling core against fake engines with a fake clock, the way
the transport does: plan a step, run it, feed the outcome back."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import count
from typing import NamedTuple

from common.types import TokenLogprob
from services.scheduler.core.types import (
    CoreConfig, Finish, Rejection, RequestSpec, RequestUpdate, SubmitResult,
)
from services.scheduler.core.scheduler import SchedulerCore
from common.step import StepBatch

from tests.unit.scheduler.fake_worker import FakeEngine


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Streamed(NamedTuple):
    """One token as a stream got it."""

    token_id: int
    logprob: TokenLogprob | None = None


@dataclass
class Stream:
    """What one client saw on its Generate stream."""

    tokens: list[Streamed] = field(default_factory=list)
    finish: Finish | None = None
    rejection: Rejection | None = None
    first_token_step: int | None = None
    finish_step: int | None = None
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return [t.token_id for t in self.tokens]

    @property
    def done(self) -> bool:
        return self.finish is not None or self.rejection is not None


class Harness:
    def __init__(self, config: CoreConfig, engines: Mapping[str, FakeEngine] | FakeEngine,
                 step_s: float = 0.01) -> None:
        if isinstance(engines, FakeEngine):
            engines = {"w0": engines}
        self.engines = dict(engines)
        self.clock = FakeClock()
        ids = count()
        self.core = SchedulerCore(config, self.clock, lambda: f"id{next(ids)}")
        for worker_id, engine in self.engines.items():
            self.core.add_worker(engine.spec(worker_id))
        self.step_s = step_s
        self.streams: dict[str, Stream] = {}
        self.plans: dict[str, list[StepBatch]] = {w: [] for w in self.engines}
        # Sent and not yet run, per worker: with config.max_steps_in_flight 2 the next
        # step is planned before the current one's outcome is applied, as the
        # transport does with async scheduling.
        self.sent: dict[str, list[StepBatch]] = {w: [] for w in self.engines}
        self.steps = 0

    def submit(self, prompt: Iterable[int], max_tokens: int = 8, request_id: str = "",
               hints: Mapping[str, int] | None = None, **fields: object) -> SubmitResult:
        spec = RequestSpec(request_id=request_id, prompt_token_ids=tuple(prompt),
                           max_tokens=max_tokens, **fields)  # type: ignore[arg-type]
        result = self.core.submit(spec, hints)
        stream = Stream(rejection=result.rejection)
        self.streams[result.request_id] = stream
        return result

    def cancel(self, request_id: str) -> bool:
        found, updates = self.core.cancel(request_id)
        self.deliver(updates)
        return found

    def step(self) -> bool:
        """One step on every worker that has something to do."""
        ran = False
        for worker_id, engine in self.engines.items():
            if not self.core.has_worker(worker_id):
                self.sent[worker_id] = []
                continue
            sent = self.sent.setdefault(worker_id, [])
            while len(sent) < self.core.config.max_steps_in_flight:
                plan = self.core.plan_step(worker_id)
                if plan is None:
                    break
                self.plans[worker_id].append(plan)
                sent.append(plan)
            if not sent:
                continue
            ran = True
            self.deliver(self.core.apply_step(worker_id, engine.step(sent.pop(0))))
        for worker_id in self.engines:
            self.core.heartbeat(worker_id)
        self.clock.advance(self.step_s)
        self.steps += 1
        return ran

    def run(self, max_steps: int = 10000) -> None:
        """Steps until every worker is idle."""
        for _ in range(max_steps):
            if not self.step():
                return
        raise AssertionError(f"still busy after {max_steps} steps")

    def deliver(self, updates: Iterable[RequestUpdate]) -> None:
        for update in updates:
            stream = self.streams[update.request_id]
            assert not stream.done, f"{update.request_id} got an update after it ended"
            if update.rejection is not None:
                assert not stream.tokens
                stream.rejection = update.rejection
                continue
            if update.prompt_logprobs:
                assert update.tokens and not stream.prompt_logprobs, "sent once, with the first tokens"
                stream.prompt_logprobs.extend(update.prompt_logprobs)
            if update.tokens and stream.first_token_step is None:
                stream.first_token_step = self.steps
            assert not update.logprobs or len(update.logprobs) == len(update.tokens), "aligned, or none"
            stream.tokens.extend(Streamed(token_id, update.logprobs[index] if update.logprobs else None)
                                 for index, token_id in enumerate(update.tokens))
            if update.finish is not None:
                stream.finish = update.finish
                stream.finish_step = self.steps
