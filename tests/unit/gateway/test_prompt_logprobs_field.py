"""vLLM's prompt_logprobs field (prompt_scores.py): each /v1/completions choice, and the
/v1/chat/completions response, carry the prompt's tokens scored as vLLM lays them out
(null first, then per token a dict by id of logprob, rank and decoded token: the
prompt's own token and the top k); bad values are 400s naming the field."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from services.gateway.text.chat_template import raw_prompt_ids
from tests.unit.gateway.fakes import FakeScheduler, ServerThread

MODEL = "gemma-3-270m"   # the default served name (SERVED_MODEL_NAME unset)
PROMPT = "The capital of France is"


def post(server: ServerThread, path: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{path}", json={"model": MODEL, **body}, timeout=10)


def _text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)


def check_scored(scored: list[Any], prompt_ids: list[int], k: int, tokenizer: Any) -> None:
    """The fake scores position p at -p/10 with rank p; its alternatives: 3, the prompt's token, 5."""
    assert len(scored) == len(prompt_ids) and scored[0] is None
    for position in range(1, len(prompt_ids)):
        token_id = prompt_ids[position]
        entry = scored[position]
        own = entry[str(token_id)]
        assert own["logprob"] == pytest.approx(-position / 10)
        assert own["decoded_token"] == _text(tokenizer, token_id)
        top = [3, token_id, 5][:k]
        assert set(entry) == {str(token_id), *map(str, top)}
        for rank, alternative in enumerate(top, start=1):
            assert entry[str(alternative)]["rank"] == rank
        assert own["rank"] == (2 if k >= 2 else position)   # among the top k, its place there


@pytest.mark.parametrize("k", [0, 1, 3])
def test_completion_choices_carry_the_scored_prompt(server: ServerThread, fake: FakeScheduler,
                                                    tokenizer: Any, k: int) -> None:
    reply = post(server, "completions", prompt=PROMPT, max_tokens=2, prompt_logprobs=k)
    assert reply.status_code == 200, reply.text
    sampling = fake.requests[0].spec.sampling
    assert sampling.prompt_logprobs and sampling.prompt_top_logprobs == k
    choice = reply.json()["choices"][0]
    assert choice["logprobs"] is None and choice["text"]   # the completion as without the field
    check_scored(choice["prompt_logprobs"], raw_prompt_ids(tokenizer, PROMPT), k, tokenizer)


def test_without_the_field_no_prompt_is_scored(server: ServerThread, fake: FakeScheduler) -> None:
    reply = post(server, "completions", prompt=PROMPT, max_tokens=2)
    assert "prompt_logprobs" not in reply.json()["choices"][0]
    assert not fake.requests[0].spec.sampling.prompt_logprobs


def test_with_echo_each_shows_its_own_count(server: ServerThread, fake: FakeScheduler, tokenizer: Any) -> None:
    reply = post(server, "completions", prompt=[PROMPT, "Hello there"], max_tokens=0, echo=True,
                 logprobs=1, prompt_logprobs=3)
    assert reply.status_code == 200, reply.text
    assert all(request.spec.sampling.prompt_top_logprobs == 3 for request in fake.requests)
    for choice, text in zip(reply.json()["choices"], [PROMPT, "Hello there"]):
        ids = raw_prompt_ids(tokenizer, text)
        assert choice["text"] == text and choice["finish_reason"] == "length"
        assert all(len(top) == 1 for top in choice["logprobs"]["top_logprobs"][1:])   # echo's: logprobs=1
        check_scored(choice["prompt_logprobs"], ids, 3, tokenizer)
        scores = [entry[str(ids[p])]["logprob"] for p, entry in enumerate(choice["prompt_logprobs"]) if entry]
        assert scores == choice["logprobs"]["token_logprobs"][1:]


def test_chat_response_carries_its_prompt_scored(server: ServerThread, fake: FakeScheduler,
                                                 tokenizer: Any) -> None:
    reply = post(server, "chat/completions", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                 n=2, prompt_logprobs=2)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    prompt_ids = list(fake.requests[0].spec.prompt_token_ids)
    check_scored(body["prompt_logprobs"], prompt_ids, 2, tokenizer)
    assert all("prompt_logprobs" not in choice for choice in body["choices"])


@pytest.mark.parametrize(("path", "fields", "status", "said"), [
    ("completions", {"prompt_logprobs": 21}, 400, "between 0 and 20"),
    ("completions", {"prompt_logprobs": -2}, 400, "between 0 and 20"),
    ("completions", {"prompt_logprobs": -1}, 400, "whole vocabulary"),
    ("completions", {"prompt_logprobs": "many"}, 422, "prompt_logprobs"),
    ("completions", {"prompt_logprobs": 1, "stream": True}, 400, "stream"),
    ("completions", {"prompt_logprobs": 0, "max_tokens": 0}, 400, "max_tokens"),
    ("chat/completions", {"prompt_logprobs": 99}, 400, "between 0 and 20"),
    ("chat/completions", {"prompt_logprobs": 2, "stream": True}, 400, "stream"),
])
def test_bad_values_are_refused_naming_the_field(server: ServerThread, fake: FakeScheduler, path: str,
                                                 fields: dict[str, Any], status: int, said: str) -> None:
    prompt: dict[str, Any] = ({"prompt": PROMPT} if path == "completions"
                              else {"messages": [{"role": "user", "content": "Hi"}]})
    reply = post(server, path, **prompt, **fields)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == ("max_tokens" if "max_tokens" in fields else "prompt_logprobs")
    assert said in error["message"]
    assert not fake.requests


def test_generate_refuses_it_naming_it(server: ServerThread) -> None:
    reply = httpx.post(f"{server.url}/generate", json={"prompt": PROMPT, "stream": False, "prompt_logprobs": 1},
                       timeout=10)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt_logprobs"
