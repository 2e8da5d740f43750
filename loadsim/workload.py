"""What the simulated users send: weighted prompt templates and user classes.

A workload is plain data (JSON on disk, `DEFAULT_WORKLOAD` built in). Every
choice a user makes (which template, which prompt, how many tokens, how long
to think) is drawn from that user's own random generator, so a user's
requests depend only on the seed and its index, never on how fast the server
answers the others.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadsim import default_texts

ENDPOINTS = ("chat", "completions")


class WorkloadError(ValueError):
    """A workload file that cannot be used; the message names the field."""


@dataclass(frozen=True)
class PromptTemplate:
    name: str
    weight: float
    endpoint: str                       # "chat" (/v1/chat/completions) or "completions" (/v1/completions)
    prompts: tuple[str, ...]            # one is drawn per request
    prefix: str = ""                    # chat: the system message; completions: text before the prompt
    max_tokens: tuple[int, int] = (16, 64)   # inclusive range
    temperature: float = 0.0


@dataclass(frozen=True)
class UserClass:
    name: str
    weight: float                       # share of the users
    think_time_s: float = 1.0           # pause after each answer, before the next request
    think_jitter: float = 0.5           # the pause is drawn from think_time_s * [1 - jitter, 1 + jitter]
    priority: int | None = None         # sent as the request's `priority`
    disconnect_fraction: float = 0.0    # share of its streams it abandons after the first token


@dataclass(frozen=True)
class Workload:
    templates: tuple[PromptTemplate, ...]
    user_classes: tuple[UserClass, ...]

    def pick_template(self, rng: random.Random) -> PromptTemplate:
        return rng.choices(self.templates, weights=[t.weight for t in self.templates])[0]

    def assign_classes(self, num_users: int) -> list[UserClass]:
        """Users per class in proportion to the weights (largest remainder), in a
        fixed order: user i's class depends only on i and the workload."""
        total = sum(c.weight for c in self.user_classes)
        exact = [num_users * c.weight / total for c in self.user_classes]
        counts = [int(share) for share in exact]
        by_remainder = sorted(range(len(exact)), key=lambda i: (counts[i] - exact[i], i))
        for i in by_remainder[:num_users - sum(counts)]:
            counts[i] += 1
        return [c for c, count in zip(self.user_classes, counts) for _ in range(count)]


def think_time(user_class: UserClass, rng: random.Random) -> float:
    low = user_class.think_time_s * (1 - user_class.think_jitter)
    high = user_class.think_time_s * (1 + user_class.think_jitter)
    return rng.uniform(low, high)


def load_workload(path: str | Path) -> Workload:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise WorkloadError(f"cannot read workload {path}: {error}") from None
    return parse_workload(data)


def parse_workload(data: Any) -> Workload:
    if not isinstance(data, dict):
        raise WorkloadError("a workload is a JSON object with `templates` and `users`")
    templates = tuple(_template(item, f"templates[{i}]") for i, item in enumerate(_list(data, "templates")))
    classes = tuple(_user_class(item, f"users[{i}]") for i, item in enumerate(_list(data, "users")))
    for field, named in (("templates", templates), ("users", classes)):
        names = [item.name for item in named]
        if len(set(names)) != len(names):
            raise WorkloadError(f"{field}: names must be unique")
    return Workload(templates, classes)


def _list(data: dict[str, Any], field: str) -> list[Any]:
    value = data.get(field)
    if not isinstance(value, list) or not value:
        raise WorkloadError(f"`{field}` must be a non-empty list")
    return value


def _template(item: Any, where: str) -> PromptTemplate:
    fields = _fields(item, where, {"name", "weight", "endpoint", "prompts", "prefix", "max_tokens", "temperature"})
    endpoint = fields.get("endpoint", "chat")
    if endpoint not in ENDPOINTS:
        raise WorkloadError(f"{where}.endpoint must be one of {', '.join(ENDPOINTS)}, not {endpoint!r}")
    prompts = fields.get("prompts")
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise WorkloadError(f"{where}.prompts must be a non-empty list of non-empty strings")
    max_tokens = fields.get("max_tokens", [16, 64])
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool):
        max_tokens = [max_tokens, max_tokens]
    if (not isinstance(max_tokens, list) or len(max_tokens) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) for n in max_tokens)
            or not 1 <= max_tokens[0] <= max_tokens[1]):
        raise WorkloadError(f"{where}.max_tokens must be a positive integer or a range [low, high]")
    return PromptTemplate(
        name=_name(fields, where), weight=_number(fields, "weight", where, 1.0, minimum=0.0, exclusive=True),
        endpoint=endpoint, prompts=tuple(prompts), prefix=_string(fields, "prefix", where),
        max_tokens=(max_tokens[0], max_tokens[1]),
        temperature=_number(fields, "temperature", where, 0.0, minimum=0.0, maximum=2.0))


def _user_class(item: Any, where: str) -> UserClass:
    fields = _fields(item, where, {"name", "weight", "think_time_s", "think_jitter", "priority",
                                   "disconnect_fraction"})
    priority = fields.get("priority")
    if priority is not None and (not isinstance(priority, int) or isinstance(priority, bool)):
        raise WorkloadError(f"{where}.priority must be an integer")
    return UserClass(
        name=_name(fields, where), weight=_number(fields, "weight", where, 1.0, minimum=0.0, exclusive=True),
        think_time_s=_number(fields, "think_time_s", where, 1.0, minimum=0.0),
        think_jitter=_number(fields, "think_jitter", where, 0.5, minimum=0.0, maximum=1.0),
        priority=priority,
        disconnect_fraction=_number(fields, "disconnect_fraction", where, 0.0, minimum=0.0, maximum=1.0))


def _fields(item: Any, where: str, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise WorkloadError(f"{where} must be an object")
    unknown = sorted(set(item) - allowed)
    if unknown:
        raise WorkloadError(f"{where}: unknown field(s) {', '.join(unknown)}")
    return item


def _name(fields: dict[str, Any], where: str) -> str:
    name = fields.get("name")
    if not isinstance(name, str) or not name:
        raise WorkloadError(f"{where}.name must be a non-empty string")
    return name


def _string(fields: dict[str, Any], key: str, where: str) -> str:
    value = fields.get(key, "")
    if not isinstance(value, str):
        raise WorkloadError(f"{where}.{key} must be a string")
    return value


def _number(fields: dict[str, Any], key: str, where: str, default: float, minimum: float,
            maximum: float | None = None, exclusive: bool = False) -> float:
    value = fields.get(key, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise WorkloadError(f"{where}.{key} must be a number")
    if value < minimum or (exclusive and value == minimum) or (maximum is not None and value > maximum):
        bound = f"> {minimum:g}" if exclusive else f">= {minimum:g}"
        upper = f" and <= {maximum:g}" if maximum is not None else ""
        raise WorkloadError(f"{where}.{key} must be {bound}{upper}, not {value!r}")
    return float(value)


DEFAULT_WORKLOAD = parse_workload({
    "templates": [
        {"name": "chat-short", "weight": 5, "endpoint": "chat", "prefix": default_texts.ASSISTANT_SYSTEM,
         "prompts": list(default_texts.SHORT_QUESTIONS), "max_tokens": [16, 48], "temperature": 0.7},
        {"name": "support-manual", "weight": 3, "endpoint": "chat", "prefix": default_texts.MANUAL_SYSTEM,
         "prompts": list(default_texts.MANUAL_QUESTIONS), "max_tokens": [24, 64], "temperature": 0.3},
        {"name": "code-completion", "weight": 2, "endpoint": "completions",
         "prompts": list(default_texts.CODE_PROMPTS), "max_tokens": [32, 96]},
        {"name": "summarize-article", "weight": 1, "endpoint": "chat", "prefix": default_texts.SUMMARY_SYSTEM,
         "prompts": list(default_texts.ARTICLES), "max_tokens": [48, 128], "temperature": 0.2},
    ],
    "users": [
        {"name": "interactive", "weight": 3, "think_time_s": 2.0, "think_jitter": 0.5},
        {"name": "batch", "weight": 1, "think_time_s": 0.0, "think_jitter": 0.0},
    ],
})
