"""Workload parsing, class assignment and per-user determinism."""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from pathlib import Path

import pytest

from loadsim.users import make_users
from loadsim.workload import DEFAULT_WORKLOAD, WorkloadError, load_workload, parse_workload, think_time


def workload(**overrides: object) -> dict:
    data = {"templates": [{"name": "a", "weight": 3, "prompts": ["x"]},
                          {"name": "b", "weight": 1, "endpoint": "completions", "prompts": ["y", "z"],
                           "max_tokens": 8}],
            "users": [{"name": "fast", "weight": 1, "think_time_s": 0},
                      {"name": "slow", "weight": 2, "think_time_s": 2.0, "think_jitter": 0.25, "priority": 3}]}
    data.update(overrides)
    return data


def test_parse_fills_defaults_and_ranges() -> None:
    parsed = parse_workload(workload())
    a, b = parsed.templates
    assert (a.endpoint, a.max_tokens, a.temperature, a.prefix) == ("chat", (16, 64), 0.0, "")
    assert (b.endpoint, b.max_tokens, b.prompts) == ("completions", (8, 8), ("y", "z"))
    assert parsed.user_classes[1].priority == 3


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d.pop("templates"), "`templates`"),
    (lambda d: d.update(users=[]), "`users`"),
    (lambda d: d["templates"][0].update(endpoint="embeddings"), "templates[0].endpoint"),
    (lambda d: d["templates"][0].update(prompts=[]), "templates[0].prompts"),
    (lambda d: d["templates"][0].update(prompts=[""]), "templates[0].prompts"),
    (lambda d: d["templates"][1].update(max_tokens=[9, 3]), "templates[1].max_tokens"),
    (lambda d: d["templates"][1].update(max_tokens=0), "templates[1].max_tokens"),
    (lambda d: d["templates"][0].update(weight=0), "templates[0].weight"),
    (lambda d: d["templates"][0].update(weight="heavy"), "templates[0].weight"),
    (lambda d: d["templates"][0].update(temperature=5), "templates[0].temperature"),
    (lambda d: d["templates"][0].update(colour="red"), "templates[0]: unknown field(s) colour"),
    (lambda d: d["users"][0].update(think_jitter=1.5), "users[0].think_jitter"),
    (lambda d: d["users"][0].update(priority=1.5), "users[0].priority"),
    (lambda d: d["users"][1].update(name="fast"), "users: names must be unique"),
    (lambda d: d["users"][0].update(disconnect_fraction=-0.1), "users[0].disconnect_fraction"),
])
def test_bad_workloads_name_the_field(mutate, field: str) -> None:
    data = workload()
    mutate(data)
    with pytest.raises(WorkloadError, match=re.escape(field)):
        parse_workload(data)


def test_load_workload_reports_unreadable_files(tmp_path: Path) -> None:
    path = tmp_path / "w.json"
    path.write_text("{not json")
    with pytest.raises(WorkloadError, match="cannot read workload"):
        load_workload(path)
    path.write_text(json.dumps(workload()))
    assert [t.name for t in load_workload(path).templates] == ["a", "b"]


@pytest.mark.parametrize("num_users, expected", [(3, [1, 2]), (4, [1, 3]), (1, [0, 1]), (9, [3, 6])])
def test_classes_are_assigned_in_proportion(num_users: int, expected: list[int]) -> None:
    classes = parse_workload(workload()).assign_classes(num_users)
    assert len(classes) == num_users
    counts = Counter(c.name for c in classes)
    assert [counts["fast"], counts["slow"]] == expected


def test_think_time_stays_within_the_jitter() -> None:
    slow = parse_workload(workload()).user_classes[1]
    rng = random.Random(0)
    pauses = [think_time(slow, rng) for _ in range(500)]
    assert min(pauses) >= 1.5 and max(pauses) <= 2.5
    assert max(pauses) - min(pauses) > 0.8      # actually jittered


def test_templates_are_drawn_by_weight() -> None:
    parsed = parse_workload(workload())
    rng = random.Random(1)
    counts = Counter(parsed.pick_template(rng).name for _ in range(4000))
    assert 0.70 < counts["a"] / 4000 < 0.80


def test_a_users_requests_depend_only_on_the_seed_and_its_index() -> None:
    def first_bodies(num_users: int, seed: int) -> list[dict]:
        user = make_users(DEFAULT_WORKLOAD, num_users, seed, "m")[1]
        return [user.next_request().body for _ in range(5)]

    assert first_bodies(4, seed=7) == first_bodies(8, seed=7)
    assert first_bodies(4, seed=7) != first_bodies(4, seed=8)


def test_request_bodies_follow_the_template_and_class() -> None:
    parsed = parse_workload(workload(templates=[
        {"name": "chat", "prompts": ["hi"], "prefix": "be brief", "max_tokens": [4, 6]},
    ], users=[{"name": "vip", "priority": 5, "disconnect_fraction": 1.0}]))
    request = make_users(parsed, 1, 0, "model-x")[0].next_request()
    body = request.body
    assert request.path == "/v1/chat/completions" and request.disconnect_after_first_token
    assert body["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert 4 <= body["max_tokens"] <= 6 and body["priority"] == 5 and body["model"] == "model-x"
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["user"] == request.user == "vip-0"

    completions = make_users(parse_workload(workload()), 4, 0, "m")
    bodies = [u.next_request() for u in completions for _ in range(20)]
    completion = next(r for r in bodies if r.template == "b")
    assert completion.path == "/v1/completions" and completion.body["prompt"] in ("y", "z")
    assert "priority" not in next(r for r in bodies if r.user_class == "fast").body


def test_the_default_workload_is_valid_and_shares_a_long_prefix() -> None:
    names = [t.name for t in DEFAULT_WORKLOAD.templates]
    assert "support-manual" in names
    manual = DEFAULT_WORKLOAD.templates[names.index("support-manual")]
    assert len(manual.prefix) > 1500 and len(manual.prompts) > 5
