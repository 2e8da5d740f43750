"""Multi-turn conversations and the requests a Locust user draws from the workload."""

from __future__ import annotations

from collections import Counter

from loadsim.sessions import ChatSession
from loadsim.users import SimulatedUser
from loadsim.workload import DEFAULT_WORKLOAD, parse_workload

WORKLOAD = parse_workload({
    "templates": [{"name": "talk", "weight": 1, "prefix": "Be brief.", "prompts": ["Hi?", "Why?", "How?"],
                   "max_tokens": [4, 8]}],
    "users": [{"name": "person", "weight": 1, "think_time_s": 2.0, "think_jitter": 0.5}],
})


def session(workload=WORKLOAD, max_turns: int = 3, seed: int = 1, index: int = 0) -> ChatSession:
    user = SimulatedUser(index, workload.user_classes[0], workload, seed, "m")
    return ChatSession(user, max_turns)


def test_a_follow_up_carries_the_conversation_and_a_new_question() -> None:
    talk = session(max_turns=50)
    first = talk.next_request()
    assert [m["role"] for m in first.body["messages"]] == ["system", "user"] and talk.turn == 1
    talk.answered("Hello.")
    second = talk.next_request()
    assert talk.turn == 2 and second.template == "talk" and second.path == "/v1/chat/completions"
    messages = second.body["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[:2] == first.body["messages"] and messages[2]["content"] == "Hello."
    assert messages[3]["content"] in {"Hi?", "Why?", "How?"}
    assert 4 <= second.body["max_tokens"] <= 8 and second.body["user"] == "person-0"


def test_conversations_last_at_most_max_turns() -> None:
    talk = session(max_turns=3, seed=7)
    turns = []
    for _ in range(60):
        talk.next_request()
        turns.append(talk.turn)
        talk.answered("ok")
    assert max(turns) <= 3 and set(turns) == {1, 2, 3}


def test_a_failed_turn_starts_a_new_conversation() -> None:
    talk = session(max_turns=50)
    talk.next_request()
    talk.answered(None)
    request = talk.next_request()
    assert talk.turn == 1 and len(request.body["messages"]) == 2


def test_one_turn_means_no_follow_ups_and_completions_never_follow_up() -> None:
    talk = session(max_turns=1)
    for _ in range(5):
        talk.next_request()
        assert talk.turn == 1
        talk.answered("ok")
    mixed = session(DEFAULT_WORKLOAD, max_turns=50, seed=3)
    for _ in range(40):
        request = mixed.next_request()
        if request.path == "/v1/completions":
            assert mixed.turn == 1 and "messages" not in request.body
        mixed.answered("ok")


def test_users_draw_prompt_kinds_by_weight_deterministically_per_seed_and_index() -> None:
    kinds = Counter()
    for index in range(4):
        talk = session(DEFAULT_WORKLOAD, max_turns=1, index=index)
        for _ in range(300):
            kinds[talk.next_request().template] += 1
            talk.answered("ok")
    assert kinds["chat-short"] > kinds["support-manual"] > kinds["code-completion"] > kinds["summarize-article"]
    one, two = session(DEFAULT_WORKLOAD, seed=5, index=2), session(DEFAULT_WORKLOAD, seed=5, index=2)
    for _ in range(10):
        assert one.next_request().body == two.next_request().body
        one.answered("x")
        two.answered("x")
    assert 1.0 <= one.user.think_time() <= 3.0
