"""Reads one OpenAI streaming answer (server-sent events) into the numbers a load
test reports: time to first token, time per output token, end-to-end latency,
the text, and why the stream failed if it did.

Pure: it takes the body's lines and a clock, so it is tested without a server
and used by the Locust users (`loadsim/locustfile.py`) over any HTTP client.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from loadsim.transport import chunk_text


@dataclass
class StreamTiming:
    ttft_s: float | None = None        # request sent → first chunk carrying text
    latency_s: float = 0.0             # request sent → end of the stream
    completion_tokens: int = 0         # usage.completion_tokens, else the chunks carrying text
    text: str = ""
    error: str = ""                    # empty when the stream ended properly
    hung_up: bool = False              # the reader stopped after the first token on purpose

    @property
    def tpot_s(self) -> float | None:
        """(latency − TTFT) / (tokens − 1) for a complete stream of at least two tokens."""
        if self.error or self.hung_up or self.ttft_s is None or self.completion_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.completion_tokens - 1)


def read_stream(lines: Iterable[str | bytes], sent_s: float, clock: Callable[[], float] = time.perf_counter,
                hang_up_after_first_token: bool = False) -> StreamTiming:
    """Consumes SSE `lines` of a 200 answer; times are measured from `sent_s` on `clock`.

    An `error` event, a chunk that is not JSON, or a stream that ends without `[DONE]`
    or a finish_reason (a disconnect) leaves a message in `error`.
    """
    timing = StreamTiming()
    chunks = 0
    done = finished = False
    for raw in lines:
        line = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            done = True
            break
        event = _event(data, timing)
        if event is None:
            break
        if "error" in event:
            error = event["error"]
            timing.error = str(error.get("message", error)) if isinstance(error, dict) else str(error)
            break
        usage = event.get("usage")
        if isinstance(usage, dict) and usage.get("completion_tokens"):
            timing.completion_tokens = int(usage["completion_tokens"])
        finished = finished or any(isinstance(c, dict) and c.get("finish_reason")
                                   for c in event.get("choices") or [])
        piece = chunk_text(event)
        if piece:
            chunks += 1
            timing.text += piece
            if timing.ttft_s is None:
                timing.ttft_s = clock() - sent_s
                if hang_up_after_first_token:
                    timing.hung_up = True
                    break
    timing.latency_s = clock() - sent_s
    if not (timing.error or timing.hung_up or done or finished):
        timing.error = "the stream ended without [DONE] or a finish_reason"
    if not timing.completion_tokens:
        timing.completion_tokens = chunks
    return timing


def _event(data: str, timing: StreamTiming) -> dict | None:
    """The JSON object a `data:` line carries; None (with `timing.error` set) if it is not one."""
    try:
        event = json.loads(data)
    except ValueError:
        timing.error = f"not JSON: {data[:200]}"
        return None
    if not isinstance(event, dict):
        timing.error = f"not a JSON object: {data[:200]}"
        return None
    return event
