"""SSE answers read into TTFT, TPOT, latency, text and failures, on a fake clock."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from loadsim.sse_timing import read_stream


class Clock:
    """Advances by `step` seconds each time it is read."""

    def __init__(self, step: float = 0.1) -> None:
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def chat(text: str | None = None, finish: str | None = None, usage: dict | None = None) -> str:
    event: dict = {"choices": [{"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish}]}
    if usage is not None:
        event = {"choices": [], "usage": usage}
    return "data: " + json.dumps(event)


def lines(*events: str) -> Iterator[str]:
    for event in events:
        yield event
        yield ""


def test_ttft_tpot_and_latency_from_a_complete_chat_stream() -> None:
    body = lines(chat(), chat("Hel"), chat("lo"), chat(" there", finish="length"),
                 chat(usage={"prompt_tokens": 5, "completion_tokens": 4}), "data: [DONE]")
    timing = read_stream(body, sent_s=0.0, clock=Clock(0.1))
    assert timing.error == "" and timing.text == "Hello there"
    assert timing.ttft_s == pytest.approx(0.1)
    assert timing.latency_s == pytest.approx(0.2)
    assert timing.completion_tokens == 4                          # usage wins over the 3 chunks
    assert timing.tpot_s == pytest.approx((0.2 - 0.1) / 3)


def test_completion_chunks_bytes_lines_and_no_usage_count_chunks() -> None:
    body = [b'data: {"choices":[{"text":"a","finish_reason":null}]}', b": keep-alive",
            b'data: {"choices":[{"text":"b","finish_reason":"stop"}]}', b"data: [DONE]"]
    timing = read_stream(body, sent_s=0.0, clock=Clock(0.5))
    assert (timing.text, timing.completion_tokens, timing.error) == ("ab", 2, "")
    assert timing.tpot_s == pytest.approx(0.5)


def test_one_token_has_a_ttft_but_no_tpot() -> None:
    timing = read_stream(lines(chat("x", finish="stop"), "data: [DONE]"), sent_s=0.0, clock=Clock())
    assert timing.ttft_s is not None and timing.tpot_s is None


@pytest.mark.parametrize("body, message", [
    ([chat("a"), 'data: {"error": {"message": "worker lost", "type": "server_error"}}'], "worker lost"),
    ([chat("a"), 'data: {"error": "plain"}'], "plain"),
    ([chat("a"), "data: {not json"], "not JSON: {not json"),
    ([chat("a"), "data: [1, 2]"], "not a JSON object"),
    ([chat("a"), chat("b")], "the stream ended without [DONE] or a finish_reason"),
    ([], "the stream ended without [DONE] or a finish_reason"),
])
def test_error_events_bad_chunks_and_cut_streams_are_failures(body: list[str], message: str) -> None:
    timing = read_stream(body, sent_s=0.0, clock=Clock())
    assert message in timing.error and timing.tpot_s is None


def test_finish_reason_without_done_is_complete() -> None:
    timing = read_stream([chat("a"), chat("b", finish="stop")], sent_s=0.0, clock=Clock())
    assert timing.error == "" and timing.completion_tokens == 2


def test_hanging_up_after_the_first_token_stops_reading() -> None:
    read: list[str] = []

    def body() -> Iterator[str]:
        for event in (chat("a"), chat("b"), "data: [DONE]"):
            read.append(event)
            yield event

    timing = read_stream(body(), sent_s=0.0, clock=Clock(), hang_up_after_first_token=True)
    assert timing.hung_up and timing.error == "" and timing.tpot_s is None
    assert len(read) == 1 and timing.ttft_s is not None
