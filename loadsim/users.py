"""Simulated users: each turns the workload into concrete requests with its own
random generator (seeded from the run's seed and the user's index)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import Any

from loadsim.workload import PromptTemplate, UserClass, Workload, think_time

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
MAX_SEED = 2**31 - 1


@dataclass(frozen=True)
class PlannedRequest:
    user: str
    user_class: str
    template: str
    path: str
    body: dict[str, Any] = field(hash=False)
    disconnect_after_first_token: bool = False


class SimulatedUser:
    def __init__(self, index: int, user_class: UserClass, workload: Workload, seed: int, model: str) -> None:
        self.name = f"{user_class.name}-{index}"
        self.user_class = user_class
        self._workload = workload
        self._model = model
        self._rng = random.Random(f"{seed}:{index}")

    def next_request(self) -> PlannedRequest:
        template = self._workload.pick_template(self._rng)
        prompt = self._rng.choice(template.prompts)
        body = self._body(template, prompt)
        disconnect = self._rng.random() < self.user_class.disconnect_fraction
        return PlannedRequest(user=self.name, user_class=self.user_class.name, template=template.name,
                              path=PATHS[template.endpoint], body=body, disconnect_after_first_token=disconnect)

    def think_time(self) -> float:
        return think_time(self.user_class, self._rng)

    def session_turns(self, max_turns: int) -> int:
        """How many turns a new conversation lasts, drawn from 1..max_turns."""
        return self._rng.randint(1, max(1, max_turns))

    def follow_up(self, previous: PlannedRequest, reply: str) -> PlannedRequest:
        """The next turn of a chat conversation: `previous`'s messages, the assistant's
        `reply`, then a new question drawn from the same template."""
        template = next(t for t in self._workload.templates if t.name == previous.template)
        body = self._body(template, self._rng.choice(template.prompts))
        body["messages"] = [*previous.body["messages"], {"role": "assistant", "content": reply},
                            body["messages"][-1]]
        disconnect = self._rng.random() < self.user_class.disconnect_fraction
        return replace(previous, body=body, disconnect_after_first_token=disconnect)

    def _body(self, template: PromptTemplate, prompt: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self._model,
            "max_tokens": self._rng.randint(*template.max_tokens),
            "temperature": template.temperature,
            "seed": self._rng.randint(0, MAX_SEED),
            "stream": True,
            "stream_options": {"include_usage": True},
            "user": self.name,
        }
        if self.user_class.priority is not None:
            body["priority"] = self.user_class.priority
        if template.endpoint == "chat":
            messages = [{"role": "system", "content": template.prefix}] if template.prefix else []
            body["messages"] = [*messages, {"role": "user", "content": prompt}]
        else:
            body["prompt"] = template.prefix + prompt
        return body


def make_users(workload: Workload, num_users: int, seed: int, model: str) -> list[SimulatedUser]:
    return [SimulatedUser(index, user_class, workload, seed, model)
            for index, user_class in enumerate(workload.assign_classes(num_users))]
