"""The client-facing API through the real stack (four processes, tiny model):
the official openai client, every error status in one shape, disconnects
that free KV blocks, the gRPC text API, and the example script."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from fairserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, worker_pb2, worker_pb2_grpc

from common.observability.prometheus_names import SCHEDULER_FINISHED
from fairserve.launcher.stack import ROOT, Stack, StackPorts, free_port
from tests.integration.conftest import start_stack

ERROR_FIELDS = {"message", "type", "param", "code"}
API_KEY = "test-key-1"
MODEL = "m"             # the lone gateway's first SERVED_MODEL_NAME
LONG_RUN_TOKENS = 900  # enough to still be generating when the checks run


# ---- helpers ----

def make_client(base_url: str, api_key: str = "unused") -> openai.OpenAI:
    # No retries: the tests look at each status as the server sends it.
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=60)


def error_of(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == ERROR_FIELDS, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def scheduler_stats(stack: Stack) -> dict[str, Any]:
    reply = httpx.get(f"{stack.url}/stats", timeout=10)
    assert reply.status_code == 200, reply.text
    return reply.json()["scheduler"]


def worker_stats(stack: Stack) -> worker_pb2.WorkerStats:
    with grpc.insecure_channel(f"127.0.0.1:{stack.ports.workers[0][0]}") as channel:
        return worker_pb2_grpc.WorkerStub(channel).Stats(common_pb2.StatsRequest(), timeout=5)


def worker_used_blocks(stack: Stack) -> int:
    return worker_stats(stack).pool.used_blocks


def wait_until(condition: Callable[[], bool], timeout_s: float, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval_s)
    return condition()


def idle(stack: Stack) -> bool:
    stats = scheduler_stats(stack)
    busy = stats["active"] + stats["prefilling"] + stats["pending"]
    return busy == 0 and worker_used_blocks(stack) == 0


def finished_by_reason(stack: Stack) -> dict[str, float]:
    """The scheduler's finished-request counters by reason, from its /metrics.
    Those are a snapshot the scheduler refreshes every second or so: this waits
    until they add up to its live count of finished requests."""
    counts: dict[str, float] = {}

    def settled() -> bool:
        text = httpx.get(f"http://127.0.0.1:{stack.ports.scheduler_metrics}/metrics", timeout=10).text
        counts.clear()
        counts.update({reason: 0.0 for reason in ("stop", "length", "cancelled", "error")})
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == SCHEDULER_FINISHED.name:
                    counts[sample.labels["reason"]] = sample.value
        return sum(counts.values()) == scheduler_stats(stack)["finished"]

    assert wait_until(settled, 10), (counts, scheduler_stats(stack)["finished"])
    return dict(counts)


def assert_cancelled_and_freed(stack: Stack, before: dict[str, float]) -> None:
    """The abandoned request did not run out to its length (it was cut short),
    and the stack goes idle (no request, no used KV block): how fast the
    machine steps does not matter."""
    assert wait_until(lambda: idle(stack), 15), (scheduler_stats(stack), worker_used_blocks(stack))
    after = finished_by_reason(stack)
    assert after["length"] == before["length"], (before, after)
    assert sum(after.values()) > sum(before.values()), (before, after)


@contextlib.contextmanager
def raw_request(stack: Stack, path: str, body: dict[str, Any]) -> Iterator[socket.socket]:
    """Sends a POST on a plain socket and hangs up when the block ends,
    without reading the answer."""
    payload = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", stack.ports.gateway), timeout=10) as sock:
        sock.sendall(head + payload)
        yield sock


def ascii_stop_in(text: str, start: int) -> str:
    """A 2-character stop string of plain letters taken from `text` at or
    after `start` (random-weight models also emit control bytes)."""
    for index in range(start, len(text) - 1):
        piece = text[index:index + 2]
        if piece.isascii() and piece.isalpha():
            return piece
    raise AssertionError(f"no letters to use as a stop string in {text!r}")


# ---- fixtures ----

@pytest.fixture(scope="module")
def client(tiny_stack: Stack) -> openai.OpenAI:
    return make_client(tiny_stack.url)


@pytest.fixture(scope="module")
def model_id(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


# ---- the openai client, end to end ----

def test_models_lists_the_served_model(client: openai.OpenAI, tiny_model_dir: Path) -> None:
    models = client.models.list()
    # SERVED_MODEL_NAME unset: MODEL_NAME's last path component, never the path.
    assert [model.id for model in models.data] == [tiny_model_dir.name]
    card = models.data[0]
    assert card.object == "model" and card.owned_by == "fairserve"
    assert card.model_extra and card.model_extra["max_model_len"] == 1024
    assert card.model_extra["root"] == tiny_model_dir.name and card.model_extra["parent"] is None


def test_an_unknown_model_is_vllms_404_and_version_answers(tiny_stack: Stack, client: openai.OpenAI,
                                                            tiny_model_dir: Path) -> None:
    for path, body in (("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
                       ("/v1/responses", {"input": "Hi"}), ("/generate", {"prompt": "Hi"})):
        for model in ("nope", str(tiny_model_dir)):
            reply = httpx.post(f"{tiny_stack.url}{path}", json={**body, "model": model}, timeout=30)
            assert reply.status_code == 404 and reply.json() == {"error": {
                "message": f"The model `{model}` does not exist.", "type": "NotFoundError", "param": "model",
                "code": 404}}, (path, model, reply.text)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "Hi"}])
    version = httpx.get(f"{tiny_stack.url}/version", timeout=10)
    assert version.status_code == 200 and version.json() == {"version": "0.1.0"}


def test_completion_stream_and_non_stream_agree(client: openai.OpenAI, model_id: str) -> None:
    args: dict[str, Any] = dict(model=model_id, prompt="The capital of France is", max_tokens=12,
                                temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**args)
    assert whole.object == "text_completion" and whole.model == model_id
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12

    chunks = list(client.completions.create(**args, stream=True,
                                            stream_options={"include_usage": True}))
    *deltas, usage_chunk = chunks
    assert "".join(chunk.choices[0].text for chunk in deltas) == whole.choices[0].text
    assert [chunk.choices[0].finish_reason for chunk in deltas][-1] == "length"
    assert all(chunk.usage is None for chunk in deltas)
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == 12
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_stream_and_non_stream_agree(client: openai.OpenAI, model_id: str) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    args: dict[str, Any] = dict(model=model_id, messages=messages, max_tokens=10, temperature=0,
                                extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**args)
    assert whole.object == "chat.completion"
    message = whole.choices[0].message
    assert message.role == "assistant" and message.content
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 10

    chunks = list(client.chat.completions.create(**args, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert text == message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(chunk.usage is None for chunk in chunks)  # no include_usage: no usage chunk

    with_usage = list(client.chat.completions.create(**args, stream=True,
                                                     stream_options={"include_usage": True}))
    assert with_usage[-1].choices == []
    assert with_usage[-1].usage is not None and with_usage[-1].usage.completion_tokens == 10
    assert with_usage[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_applies_the_template_and_completions_do_not(client: openai.OpenAI,
                                                          model_id: str) -> None:
    text = "Hello!"
    chat = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": text}],
                                          max_tokens=1, temperature=0)
    plain = client.completions.create(model=model_id, prompt=text, max_tokens=1, temperature=0)
    assert chat.usage is not None and plain.usage is not None
    # <bos><start_of_turn>user\n ... <end_of_turn>\n<start_of_turn>model\n around the same text
    assert chat.usage.prompt_tokens > plain.usage.prompt_tokens + 4


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_is_cut_and_cancels_the_rest(tiny_stack: Stack, client: openai.OpenAI,
                                                 model_id: str, stream: bool) -> None:
    prompt = "The capital of France is"
    greedy = client.completions.create(model=model_id, prompt=prompt, max_tokens=30, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text
    stop = ascii_stop_in(greedy, 3)
    expected = greedy[:greedy.index(stop)]
    args: dict[str, Any] = dict(model=model_id, prompt=prompt, max_tokens=LONG_RUN_TOKENS,
                                temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    finished_before = finished_by_reason(tiny_stack)
    if stream:
        chunks = list(client.completions.create(**args, stream=True,
                                                stream_options={"include_usage": True}))
        text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
        finish = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1]
        usage = chunks[-1].usage
    else:
        reply = client.completions.create(**args)
        text, finish, usage = reply.choices[0].text, reply.choices[0].finish_reason, reply.usage
    assert text == expected and stop not in text
    assert finish == "stop"
    assert usage is not None and usage.completion_tokens < 30
    # Left alone, the request would run for LONG_RUN_TOKENS steps.
    assert_cancelled_and_freed(tiny_stack, finished_before)


def test_chat_stop_string(client: openai.OpenAI, model_id: str) -> None:
    messages = [{"role": "user", "content": "Say something"}]
    greedy = client.chat.completions.create(model=model_id, messages=messages, max_tokens=30,
                                            temperature=0, extra_body={"ignore_eos": True})
    full = greedy.choices[0].message.content or ""
    stop = ascii_stop_in(full, 2)
    reply = client.chat.completions.create(model=model_id, messages=messages, max_tokens=30,
                                           temperature=0, stop=stop, extra_body={"ignore_eos": True})
    assert reply.choices[0].message.content == full[:full.index(stop)]
    assert reply.choices[0].finish_reason == "stop"


def test_seed_reproduces_sampling(client: openai.OpenAI, model_id: str) -> None:
    def sample(seed: int) -> str:
        return client.completions.create(model=model_id, prompt="Once upon a time", max_tokens=16,
                                         temperature=1.0, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text

    first, again, other = sample(1234), sample(1234), sample(4321)
    assert first == again
    assert first != other

    def chat(seed: int) -> str:
        return client.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": "Tell me a story"}],
            max_tokens=16, temperature=0.9, seed=seed,
            extra_body={"ignore_eos": True}).choices[0].message.content or ""

    assert chat(7) == chat(7)


def test_n_choices(client: openai.OpenAI, model_id: str) -> None:
    reply = client.completions.create(model=model_id, prompt="Hello world", n=3, max_tokens=8,
                                      temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    assert [choice.index for choice in reply.choices] == [0, 1, 2]
    texts = [choice.text for choice in reply.choices]
    assert len(set(texts)) > 1, texts
    assert reply.usage is not None and reply.usage.completion_tokens == 24
    again = client.completions.create(model=model_id, prompt="Hello world", n=3, max_tokens=8,
                                      temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    assert [choice.text for choice in again.choices] == texts

    chunks = list(client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Hi"}], n=2, max_tokens=6,
        temperature=1.0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True}))
    finishes = {chunk.choices[0].index: chunk.choices[0].finish_reason
                for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason}
    assert finishes == {0: "length", 1: "length"}
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


def test_completion_logprobs(client: openai.OpenAI, model_id: str) -> None:
    reply = client.completions.create(model=model_id, prompt="Hello world", max_tokens=6,
                                      temperature=0, logprobs=3, extra_body={"ignore_eos": True})
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert "".join(logprobs.tokens) == reply.choices[0].text or "\ufffd" in "".join(logprobs.tokens)
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs):
        assert 1 <= len(top) <= 3  # keyed by text: two tokens may read the same
        assert chosen is not None and chosen <= 0
        assert abs(max(top.values()) - chosen) < 1e-4  # greedy takes the most likely token


def test_chat_logprobs_and_top_logprobs(client: openai.OpenAI, model_id: str) -> None:
    reply = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0,
        logprobs=True, top_logprobs=4, extra_body={"ignore_eos": True})
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 4
        values = [top.logprob for top in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert abs(values[0] - entry.logprob) < 1e-4
        if "\ufffd" in entry.token:  # part of a character: the token's own bytes
            assert entry.bytes and entry.bytes != list(entry.token.encode())
        else:
            assert entry.bytes == list(entry.token.encode())

    streamed = list(client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0,
        logprobs=True, top_logprobs=2, stream=True, extra_body={"ignore_eos": True}))
    entries = [entry for chunk in streamed if chunk.choices and chunk.choices[0].logprobs
               for entry in chunk.choices[0].logprobs.content or []]
    assert [entry.token for entry in entries] == [entry.token for entry in content]


def test_max_completion_tokens(client: openai.OpenAI, model_id: str) -> None:
    reply = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Count"}], max_completion_tokens=7,
        temperature=0, extra_body={"ignore_eos": True})
    assert reply.usage is not None and reply.usage.completion_tokens == 7
    assert reply.choices[0].finish_reason == "length"


def test_top_k_and_min_p_narrow_to_greedy(client: openai.OpenAI, model_id: str) -> None:
    def complete(**extra: Any) -> str:
        temperature = extra.pop("temperature")
        return client.completions.create(model=model_id, prompt="Once upon a time", max_tokens=12,
                                         temperature=temperature,
                                         extra_body={"ignore_eos": True, **extra}).choices[0].text

    greedy = complete(temperature=0)
    assert complete(temperature=1.5, top_k=1, seed=3) == greedy
    assert complete(temperature=1.5, min_p=1.0, seed=3) == greedy
    assert complete(temperature=1.5, seed=3) != greedy


def test_repetition_penalty_changes_greedy(client: openai.OpenAI, model_id: str) -> None:
    def complete(**extra: Any) -> str:
        return client.completions.create(model=model_id, prompt="The capital of France is",
                                         max_tokens=16, temperature=0,
                                         extra_body={"ignore_eos": True, **extra}).choices[0].text

    plain = complete()
    assert complete(repetition_penalty=1.0) == plain
    penalized = complete(repetition_penalty=3.0)
    assert penalized != plain


def _prompt_that_stops_early(client: openai.OpenAI, model_id: str) -> tuple[list[int], int]:
    """A token-id prompt whose greedy continuation hits EOS within 10 tokens
    (a random-weight model rarely does, so look through a batch of prompts)."""
    rng = random.Random(0)
    for _attempt in range(3):
        prompts = [[2, *(rng.randrange(6, 384) for _ in range(6))] for _ in range(64)]
        reply = client.completions.create(model=model_id, prompt=prompts, max_tokens=10,
                                          temperature=0)
        for choice in reply.choices:
            if choice.finish_reason == "stop":
                return prompts[choice.index], 10
    raise AssertionError("no prompt among 192 made the tiny model stop early")


def test_ignore_eos_and_min_tokens(client: openai.OpenAI, model_id: str) -> None:
    prompt, budget = _prompt_that_stops_early(client, model_id)
    stopped = client.completions.create(model=model_id, prompt=prompt, max_tokens=budget,
                                        temperature=0)
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage is not None and stopped.usage.completion_tokens < budget
    ignored = client.completions.create(model=model_id, prompt=prompt, max_tokens=budget,
                                        temperature=0, extra_body={"ignore_eos": True})
    assert ignored.choices[0].finish_reason == "length"
    assert ignored.usage is not None and ignored.usage.completion_tokens == budget
    assert ignored.choices[0].text.startswith(stopped.choices[0].text)
    # EOS before min_tokens does not end the request (the budget's last
    # token may itself be an EOS, which then ends it with "stop").
    at_least = client.completions.create(model=model_id, prompt=prompt, max_tokens=budget,
                                         temperature=0, extra_body={"min_tokens": budget})
    assert at_least.usage is not None and at_least.usage.completion_tokens == budget


def test_user_session_and_priority_reach_the_scheduler(tiny_stack: Stack, client: openai.OpenAI,
                                                       model_id: str) -> None:
    client.completions.create(model=model_id, prompt="Hi", max_tokens=2, temperature=0,
                              user="alice-7", extra_body={"priority": 5})
    client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "Hi"}],
                                   max_tokens=2, extra_body={"session_id": "session-42",
                                                             "priority": -3})
    clients = {entry["client_id"] for entry in scheduler_stats(tiny_stack)["clients"]}
    assert {"alice-7", "session-42"} <= clients, clients


# ---- errors through the real stack ----

def test_400_bad_values(tiny_stack: Stack, client: openai.OpenAI, model_id: str) -> None:
    cases = [
        ("/v1/completions", {"prompt": "Hi", "max_tokens": -1}, "max_tokens", "-1"),
        ("/v1/completions", {"prompt": "Hi", "temperature": 2.5}, "temperature", "2.5"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "top_p": 0},
         "top_p", "0"),
        ("/v1/completions", {"prompt": ""}, "prompt", "empty"),
        ("/v1/chat/completions", {"messages": []}, "messages", "empty"),
    ]
    for path, body, param, detail in cases:
        reply = httpx.post(f"{tiny_stack.url}{path}", json={"model": model_id, **body}, timeout=30)
        assert reply.status_code == 400, (body, reply.text)
        error = error_of(reply)
        assert error["type"] == "invalid_request_error"
        assert error["param"] == param and detail in error["message"], error

    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=model_id, prompt="Hi", max_tokens=-5)
    assert raised.value.status_code == 400 and raised.value.param == "max_tokens"


def test_400_prompt_longer_than_the_context(client: openai.OpenAI, model_id: str,
                                            tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    prompt = "hello " * 400
    prompt_tokens = len(AutoTokenizer.from_pretrained(tiny_model_dir)(prompt)["input_ids"])
    assert prompt_tokens > 1024
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=model_id, prompt=prompt, max_tokens=5)
    error = raised.value
    assert error.code == "context_length_exceeded" and error.param == "prompt"
    message = str(error)
    assert "maximum context length is 1024 tokens" in message, message
    assert f"{prompt_tokens + 5} tokens ({prompt_tokens} in the prompt, 5 in the completion)" in message
    with pytest.raises(openai.BadRequestError) as too_many:
        client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "Hi"}],
                                       max_completion_tokens=5000)
    assert too_many.value.param == "max_completion_tokens"
    assert "5000 in the completion" in str(too_many.value)


def test_404_405_422(tiny_stack: Stack) -> None:
    url = tiny_stack.url
    missing = httpx.post(f"{url}/v1/embeddings", json={"input": "x"}, timeout=10)
    assert missing.status_code == 404 and error_of(missing)["type"] == "not_found_error"

    wrong_method = httpx.get(f"{url}/v1/chat/completions", timeout=10)
    assert wrong_method.status_code == 405
    assert wrong_method.headers["allow"] == "POST"
    assert error_of(wrong_method)["code"] == "method_not_allowed"

    for body in ({"prompt": "Hi", "max_tokens": "many"}, {"max_tokens": 3},
                 {"messages": "Hi"}, {"messages": [{"content": "no role"}]}):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        reply = httpx.post(f"{url}{path}", json=body, timeout=10)
        assert reply.status_code == 422, (body, reply.text)
        assert error_of(reply)["code"] == "validation_error"

    malformed = httpx.post(f"{url}/v1/completions", content=b'{"prompt": "Hi",', timeout=10)
    assert malformed.status_code == 400 and error_of(malformed)["code"] == "invalid_json"


# ---- the limits stack: 429 and a soft hold that times out (503) ----

@pytest.fixture(scope="module")
def limits_stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # One long request reserves most of MAX_ACTIVE_KV_TOKENS: the next one is
    # held (soft, by the KV gate) and fills the queue of one.
    stack = start_stack(tmp_path_factory.mktemp("limits"), tiny_model_dir, extra_env={
        "MAX_QUEUE_LEN": "1", "QUEUE_TIMEOUT_S": "1", "MAX_ACTIVE_KV_TOKENS": "1000",
        "MAX_BATCH_SIZE": "4"})
    yield stack
    stack.stop()


class LongStream:
    """A streaming request that keeps generating until closed."""

    def __init__(self, url: str, max_tokens: int = LONG_RUN_TOKENS) -> None:
        self._client = httpx.Client(timeout=60)
        self._context = self._client.stream("POST", f"{url}/v1/completions", json={
            "prompt": "Hi", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True})
        self.response = self._context.__enter__()
        assert self.response.status_code == 200, self.response.read()
        self.lines = self.response.iter_lines()

    def read_events(self, count: int) -> list[str]:
        events: list[str] = []
        for line in self.lines:
            if line.startswith("data: "):
                events.append(line)
                if len(events) == count:
                    break
        return events

    def close(self) -> None:
        self._context.__exit__(None, None, None)
        self._client.close()


HELD_BODY = {"prompt": "Hello", "max_tokens": 200, "temperature": 0}


@contextlib.contextmanager
def kv_blocker(stack: Stack) -> Iterator[LongStream]:
    """A running request that reserves nearly all of MAX_ACTIVE_KV_TOKENS
    (1000), so HELD_BODY is held in the queue until QUEUE_TIMEOUT_S.

    The worker is paused (SIGSTOP) while the checks run: the tiny model's 990
    tokens take about a second on a fast CPU, less than the checks; paused, the
    blocker's step stays in flight and its reservation held, and the scheduler
    waits for it (WORKER_HEARTBEAT_TIMEOUT_S and STEP_TIMEOUT_S are 10 and 60 s)."""
    assert wait_until(lambda: idle(stack), 5), scheduler_stats(stack)
    blocker = LongStream(stack.url, max_tokens=990)
    worker = stack.processes["worker-0"].pid
    try:
        assert len(blocker.read_events(2)) == 2
        os.kill(worker, signal.SIGSTOP)
        yield blocker
        assert scheduler_stats(stack)["active"] == 1, "the blocker ended too early"
    finally:
        os.kill(worker, signal.SIGCONT)
        blocker.close()


def test_429_queue_full_and_503_hold_timeout(limits_stack: Stack) -> None:
    url = f"{limits_stack.url}/v1/completions"
    with kv_blocker(limits_stack):
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            replies = list(pool.map(lambda _: httpx.post(url, json=HELD_BODY, timeout=30), range(6)))
    statuses = sorted(reply.status_code for reply in replies)
    assert statuses == [429] * 5 + [503], [(r.status_code, r.text) for r in replies]
    for reply in replies:
        error = error_of(reply)
        if reply.status_code == 429:
            assert error["type"] == "rate_limit_error" and error["code"] == "queue_full"
            assert int(reply.headers["retry-after"]) >= 1
            assert "MAX_QUEUE_LEN=1" in error["message"]
        else:
            assert error["type"] == "service_unavailable_error"
            assert "QUEUE_TIMEOUT_S=1" in error["message"] and "active_kv" in error["message"]

    # The openai client sees the same: RateLimitError with Retry-After.
    model = served_name(limits_stack)
    with kv_blocker(limits_stack), concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(httpx.post, url, json=HELD_BODY, timeout=30)
        assert wait_until(lambda: scheduler_stats(limits_stack)["pending"] == 1, 5)
        with pytest.raises(openai.RateLimitError) as raised:
            make_client(limits_stack.url).completions.create(model=model, prompt="Hi",
                                                             max_tokens=200)
        assert raised.value.response.headers["retry-after"]
        assert held.result().status_code == 503

    assert wait_until(lambda: idle(limits_stack), 3), scheduler_stats(limits_stack)
    after = httpx.post(url, json=HELD_BODY, timeout=60)
    assert after.status_code == 200, after.text


def served_name(stack: Stack) -> str:
    return httpx.get(f"{stack.url}/v1/models", timeout=10).json()["data"][0]["id"]


def test_disconnect_while_queued_cancels(limits_stack: Stack) -> None:
    with kv_blocker(limits_stack):
        timeouts_before = scheduler_stats(limits_stack)["rejections"].get("timeout", 0)
        with raw_request(limits_stack, "/v1/completions", {**HELD_BODY, "stream": True}):
            assert wait_until(lambda: scheduler_stats(limits_stack)["pending"] == 1, 5)
        assert wait_until(lambda: scheduler_stats(limits_stack)["pending"] == 0, 3)
        # It left the queue as a cancel, before its queue timeout.
        stats = scheduler_stats(limits_stack)
        assert stats["rejections"].get("timeout", 0) == timeouts_before, stats
    assert wait_until(lambda: idle(limits_stack), 3), scheduler_stats(limits_stack)


# ---- the gateway alone: API keys, body limit, no scheduler (503) ----

@pytest.fixture(scope="module")
def lone_gateway(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log_dir = tmp_path_factory.mktemp("lone-gateway")
    stack = Stack(ports=StackPorts.free(0), env={
        "MODEL_NAME": str(tiny_model_dir), "SERVED_MODEL_NAME": f"{MODEL},alias", "API_KEYS": f"{API_KEY},second-key",
        "MAX_REQUEST_BYTES": "4096", "LOG_LEVEL": "warning",
        # Nothing listens here: the scheduler and the kvcache service are down.
        "SCHEDULER_ADDR": f"127.0.0.1:{free_port()}", "KVCACHE_ADDR": f"127.0.0.1:{free_port()}",
    }, log_dir=log_dir)
    with open(log_dir / "gateway.log", "ab") as log_file:
        stack.processes["gateway"] = subprocess.Popen(
            [sys.executable, "-m", "services.gateway.main"], cwd=ROOT, env=stack.service_env(),
            stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        assert wait_until(lambda: _answers(stack.url), 60, 0.2), stack.tail("gateway")
        yield stack.url
    finally:
        stack.stop()


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_401_without_or_with_a_wrong_key(lone_gateway: str) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic abc"},
                    {"x-api-key": "nope"}, {"Authorization": b"Bearer \xff\xfe\x80"},
                    {"x-api-key": b"\xc3\xa9" * 8}, {"Authorization": f"Bearer {API_KEY}x"}):
        reply = httpx.post(f"{lone_gateway}/v1/completions", json=body, headers=headers, timeout=10)
        assert reply.status_code == 401, (headers, reply.text)
        error = error_of(reply)
        assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
    assert httpx.get(f"{lone_gateway}/v1/models", timeout=10).status_code == 401
    assert httpx.get(f"{lone_gateway}/health", timeout=10).status_code == 200  # stays open

    with pytest.raises(openai.AuthenticationError):
        make_client(lone_gateway, api_key="wrong").models.list()
    # The right key gets past the check (and then finds no scheduler).
    with pytest.raises(openai.APIStatusError) as raised:
        make_client(lone_gateway, api_key="second-key").completions.create(
            model=MODEL, prompt="Hi", max_tokens=2)
    assert raised.value.status_code == 503
    # Every SERVED_MODEL_NAME is accepted (then no scheduler); another name is vLLM's 404 first.
    for model, status in (("alias", 503), ("nope", 404), ("tiny-gemma3", 404)):
        reply = httpx.post(f"{lone_gateway}/v1/completions", json={**body, "model": model},
                           headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
        assert reply.status_code == status, (model, reply.text)


def test_413_body_over_the_limit(lone_gateway: str) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    big = {"model": MODEL, "prompt": "x" * 5000}
    reply = httpx.post(f"{lone_gateway}/v1/completions", json=big, headers=headers, timeout=10)
    assert reply.status_code == 413
    error = error_of(reply)
    assert error["code"] == "request_too_large" and "4096" in error["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: refused while reading
        yield b'{"model": "m", "prompt": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}'

    chunked = httpx.post(f"{lone_gateway}/v1/completions", content=chunks(), headers=headers,
                         timeout=10)
    assert chunked.status_code == 413 and error_of(chunked)["code"] == "request_too_large"
    with pytest.raises(openai.APIStatusError) as raised:
        make_client(lone_gateway, api_key=API_KEY).completions.create(model=MODEL, prompt="z" * 5000)
    assert raised.value.status_code == 413


def test_503_when_the_scheduler_is_down(lone_gateway: str) -> None:
    ready = httpx.get(f"{lone_gateway}/ready", timeout=10)
    assert ready.status_code == 503 and error_of(ready)["type"] == "service_unavailable_error"
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for path, body in (("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                 "stream": True}),
                       ("/generate", {"prompt": "Hi"})):
        reply = httpx.post(f"{lone_gateway}{path}", json=body, headers=headers, timeout=30)
        assert reply.status_code == 503, (path, reply.text)
        assert error_of(reply)["code"] == "service_unavailable"


def test_keys_never_leave_the_gateway(lone_gateway: str,
                                      tmp_path_factory: pytest.TempPathFactory) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for key in (API_KEY, "second-key"):
        httpx.post(f"{lone_gateway}/v1/completions", json={"prompt": "Hi", "user": "u"},
                   headers={"Authorization": f"Bearer {key}"}, timeout=30)
        httpx.post(f"{lone_gateway}/v1/completions", json={"prompt": "Hi"},
                   headers={"Authorization": f"Bearer {key}-wrong"}, timeout=30)
    stats = httpx.get(f"{lone_gateway}/stats", headers=headers, timeout=10)
    metrics = httpx.get(f"{lone_gateway}/metrics", timeout=10)
    assert stats.status_code == 200 and metrics.status_code == 200
    logs = [path.read_text(errors="replace")
            for path in tmp_path_factory.getbasetemp().glob("lone-gateway*/gateway.log")]
    assert logs
    for text in (stats.text, metrics.text, *logs):
        assert API_KEY not in text and "second-key" not in text


# ---- disconnects ----

def test_disconnect_mid_stream_cancels_and_frees_blocks(tiny_stack: Stack) -> None:
    assert wait_until(lambda: idle(tiny_stack), 5)
    # Read before the request starts: a fast machine could run it out while the counters settle.
    finished_before = finished_by_reason(tiny_stack)
    stream = LongStream(tiny_stack.url)
    try:
        assert len(stream.read_events(5)) == 5
        stats = scheduler_stats(tiny_stack)
        assert stats["active"] == 1, stats
        assert worker_used_blocks(tiny_stack) > 0
    finally:
        stream.close()
    assert_cancelled_and_freed(tiny_stack, finished_before)
    reply = httpx.post(f"{tiny_stack.url}/v1/completions",
                       json={"prompt": "Hi", "max_tokens": 3, "temperature": 0}, timeout=30)
    assert reply.status_code == 200


def test_disconnect_while_non_streaming_cancels(tiny_stack: Stack) -> None:
    assert wait_until(lambda: idle(tiny_stack), 5)
    finished_before = finished_by_reason(tiny_stack)   # before the request starts, as above
    admitted_before = scheduler_stats(tiny_stack)["admitted"]
    with raw_request(tiny_stack, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": LONG_RUN_TOKENS,
            "ignore_eos": True}):
        assert wait_until(lambda: scheduler_stats(tiny_stack)["admitted"] > admitted_before, 5)
    # The socket is closed before any answer: the request must not run on
    # (the gateway hears the server's disconnect event at once).
    assert_cancelled_and_freed(tiny_stack, finished_before)


# ---- the gRPC text API ----

def test_grpc_text_api_generate_and_stream(tiny_stack: Stack, client: openai.OpenAI,
                                           model_id: str) -> None:
    prompt = "The capital of France is"
    expected = client.completions.create(model=model_id, prompt=prompt, max_tokens=12,
                                         temperature=0, extra_body={"ignore_eos": True})
    request = gateway_pb2.TextRequest(prompt=prompt, max_tokens=12, raw=True, ignore_eos=True,
                                      sampling=common_pb2.SamplingParams(temperature=0.0),
                                      user="grpc-user")
    with grpc.insecure_channel(f"127.0.0.1:{tiny_stack.ports.gateway_grpc}") as channel:
        stub = gateway_pb2_grpc.TextGenerationStub(channel)
        reply = stub.Generate(request, timeout=60)
        assert reply.text == expected.choices[0].text
        assert reply.finish_reason == "length" and reply.usage.completion_tokens == 12
        assert reply.usage.prompt_tokens == expected.usage.prompt_tokens  # type: ignore[union-attr]

        chunks = list(stub.GenerateStream(request, timeout=60))
        assert "".join(chunk.text for chunk in chunks) == reply.text
        assert sum(len(chunk.token_ids) for chunk in chunks) == 12
        assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 12
        assert all(not chunk.finish_reason for chunk in chunks[:-1])

        stop = ascii_stop_in(reply.text, 3)
        stopped = stub.Generate(gateway_pb2.TextRequest(
            prompt=prompt, max_tokens=12, raw=True, ignore_eos=True, stop=[stop]), timeout=60)
        assert stopped.text == reply.text[:reply.text.index(stop)]
        assert stopped.finish_reason == "stop"

        chat = stub.Generate(gateway_pb2.TextRequest(prompt="Hello!", max_tokens=4), timeout=60)
        assert chat.usage.prompt_tokens > 4  # the chat template wraps the prompt

        for bad, code in ((gateway_pb2.TextRequest(prompt=""), grpc.StatusCode.INVALID_ARGUMENT),
                          (gateway_pb2.TextRequest(prompt="Hi", max_tokens=5000),
                           grpc.StatusCode.INVALID_ARGUMENT),
                          (gateway_pb2.TextRequest(prompt="Hi", sampling=common_pb2.SamplingParams(
                              temperature=9)), grpc.StatusCode.INVALID_ARGUMENT)):
            with pytest.raises(grpc.RpcError) as raised:
                stub.Generate(bad, timeout=30)
            assert raised.value.code() == code, raised.value.details()
            with pytest.raises(grpc.RpcError) as streamed:
                list(stub.GenerateStream(bad, timeout=30))
            assert streamed.value.code() == code


# ---- the example script runs unchanged ----

def test_example_script_streams_a_chat_completion(tiny_stack: Stack) -> None:
    env = {key: value for key, value in os.environ.items() if not key.startswith("OPENAI_")}
    env["OPENAI_BASE_URL"] = f"{tiny_stack.url}/v1"
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "openai_chat_stream.py")],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip(), result.stderr
