"""Robustness: floods a running gateway with malformed and absurd requests
from several threads while well-formed chat streams run alongside, and
reports every status it got. No request may get a 5xx, and every stream
must complete.

    python -m benchmarks.fuzz_gateway --url http://127.0.0.1:8000 --requests 10000
    python -m benchmarks.fuzz_gateway --tiny-stack --requests 10000   # starts its own tiny stack

The mix: broken JSON, wrong types, absurd values, bodies over the size
limit, odd headers, wrong methods and paths, raw bytes that are not HTTP,
and a few small valid requests (some abandoned mid-stream).
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

ERROR_FIELDS = {"message", "type", "param", "code"}
HTTP_LAYER_REJECTION = "Invalid HTTP request received."
HUGE_BODY_BYTES = 1_200_000  # over the default MAX_REQUEST_BYTES (1 MiB)
API_PATHS = ("/v1/completions", "/v1/chat/completions", "/generate")
GET_PATHS = ("/v1/models", "/health", "/ready", "/stats", "/metrics", "/openapi.json")
JUNK_VALUES: tuple[Any, ...] = (None, True, False, 0, -1, 3, 1.5, -2.5, "", "x", "12", [], {},
                                [1, "a"], {"k": []}, [[1], [2]], [None], 2**70, -2**70)


@dataclass
class FuzzCase:
    kind: str
    method: str = "POST"
    path: str = "/v1/completions"
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes | None = None
    chunked: bool = False       # send the body without Content-Length
    raw: bytes | None = None    # bytes written to a socket as is, not HTTP from a client
    abandon_stream: bool = False


@dataclass
class Outcome:
    kind: str
    status: int | None  # None: no HTTP answer (connection closed on garbage)
    problem: str = ""   # a 5xx, or an error body not in the one shape


@dataclass
class StreamResult:
    ok: bool
    detail: str


@dataclass
class FuzzReport:
    requests: int
    seconds: float
    statuses: Counter[int | None]
    by_kind: dict[str, Counter[int | None]]
    problems: list[str]
    streams: list[StreamResult]

    @property
    def server_errors(self) -> int:
        return sum(count for status, count in self.statuses.items() if status and status >= 500)

    @property
    def ok(self) -> bool:
        return (not self.problems and self.server_errors == 0 and bool(self.streams)
                and all(stream.ok for stream in self.streams))

    def summary(self) -> str:
        statuses = ", ".join(f"{status}: {count}" for status, count in
                             sorted(self.statuses.items(), key=lambda item: (item[0] is None, item[0] or 0)))
        streams_ok = sum(1 for stream in self.streams if stream.ok)
        lines = [f"{self.requests} requests in {self.seconds:.1f} s "
                 f"({self.requests / self.seconds:.0f}/s)",
                 f"statuses: {statuses}",
                 f"5xx: {self.server_errors}; other problems: {len(self.problems)}",
                 f"concurrent well-formed streams: {streams_ok}/{len(self.streams)} complete"]
        lines += [f"  {kind}: {dict(counts)}" for kind, counts in sorted(self.by_kind.items())]
        lines += [f"  problem: {problem}" for problem in self.problems[:20]]
        lines += [f"  stream: {stream.detail}" for stream in self.streams if not stream.ok][:5]
        return "\n".join(lines)


# ---- the cases ----

def _valid_body(rng: random.Random, path: str) -> dict[str, Any]:
    if path == "/v1/chat/completions":
        return {"model": "m", "messages": [{"role": "user", "content": "Hi there"}],
                "max_tokens": rng.randint(1, 4)}
    if path == "/generate":
        return {"prompt": "Hello", "max_tokens": rng.randint(1, 4), "stream": False}
    return {"model": "m", "prompt": "Hello", "max_tokens": rng.randint(1, 4)}


def _json(value: Any) -> bytes:
    return json.dumps(value).encode()


def bad_json(rng: random.Random) -> FuzzCase:
    valid = _json(_valid_body(rng, "/v1/completions"))
    payloads = [
        valid[:rng.randint(0, len(valid) - 1)], b"", b"null", b"[]", b'"text"', b"1e999", b"NaN",
        b"{'prompt': 'single quotes'}", b'{"prompt": "\\ud800"}', b'{"prompt": "x"} trailing',
        b"[" * 5000 + b"]" * 5000, b'{"a":' * 3000 + b"1" + b"}" * 3000,
        b"\xef\xbb\xbf" + valid, valid.decode().encode("utf-16"), bytes(rng.randbytes(64)),
        b'{"prompt": "a", "prompt": 5}', b'{"max_tokens": 1' + b"0" * 5000 + b"}",
        b'{"messages": [{"role": "user", "content": "\x00\x01"}]}',
    ]
    return FuzzCase("bad_json", path=rng.choice(API_PATHS), body=rng.choice(payloads),
                    headers={"content-type": "application/json"})


def wrong_types(rng: random.Random) -> FuzzCase:
    path = rng.choice(API_PATHS)
    body = _valid_body(rng, path)
    fields = ["prompt", "messages", "max_tokens", "temperature", "top_p", "n", "stream", "stop",
              "seed", "logprobs", "top_logprobs", "stream_options", "user", "top_k", "min_p",
              "ignore_eos", "min_tokens", "priority", "session_id", "model", "raw",
              "max_completion_tokens", "repetition_penalty"]
    for name in rng.sample(fields, rng.randint(1, 3)):
        body[name] = rng.choice(JUNK_VALUES)
    if "messages" in body and rng.random() < 0.5:
        body["messages"] = [{"role": rng.choice(JUNK_VALUES), "content": rng.choice(JUNK_VALUES)}]
    return FuzzCase("wrong_types", path=path, body=_json(body))


ABSURD: dict[str, tuple[Any, ...]] = {
    "max_tokens": (-1, 0, 2**31, 2**63, 10**30, 5000),
    "max_completion_tokens": (-3, 0, 2**40),
    "temperature": (-1, 2.0001, 1e308, -0.0),
    "top_p": (0, -0.1, 2, 1e-300),
    "top_k": (-5, 2**40, -2**40),
    "min_p": (-1, 1.5),
    "n": (0, 17, 10**6, -1),
    "logprobs": (-1, 21, 10**9),
    "top_logprobs": (21, -1, 10**9),
    "seed": (2**70, -2**70),
    "priority": (2**40, -2**40),
    "min_tokens": (10**6, -1),
    "repetition_penalty": (0, -1, 11, 1e300),
    "presence_penalty": (5, -5),
    "frequency_penalty": (9, -9),
    "stop": (["x"] * 100, "y" * 5000, [""], ["a", 1]),
    "session_id": ("s" * 10000,),
    "user": ("u" * 50000,),
    "echo": (True,),
}


def absurd_values(rng: random.Random) -> FuzzCase:
    path = rng.choice(API_PATHS)
    body = _valid_body(rng, path)
    roll = rng.random()
    if roll < 0.15 and path == "/v1/completions":
        body["prompt"] = rng.choice([[10**9], [-1], [], [[]], [[1, 2]] * 100, ["a"] * 100,
                                     list(range(2000)), "word " * 40000])
    elif roll < 0.3 and path == "/v1/chat/completions":
        body["messages"] = rng.choice([
            [], [{"role": "banana", "content": "x"}], [{"role": "system", "content": "only"}],
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            [{"role": "user", "content": "hi"}] * 1000,
            [{"role": "assistant", "content": "first"}, {"role": "assistant", "content": "x"}],
        ])
    else:
        # The valid base keeps max_tokens at 1-4, so an absurd value that is
        # still accepted (n=16, a huge seed) costs little generation.
        for name in rng.sample(sorted(ABSURD), rng.randint(1, 3)):
            body[name] = rng.choice(ABSURD[name])
    return FuzzCase("absurd_values", path=path, body=_json(body))


def huge_body(rng: random.Random) -> FuzzCase:
    body = b'{"model": "m", "prompt": "' + b"z" * HUGE_BODY_BYTES + b'"}'
    return FuzzCase("huge_body", path=rng.choice(API_PATHS), body=body, chunked=rng.random() < 0.5)


def bad_headers(rng: random.Random) -> FuzzCase:
    path = rng.choice(API_PATHS)
    body = _json(_valid_body(rng, path))
    headers = rng.choice([
        {"content-type": "text/plain"}, {"content-type": "multipart/form-data; boundary=x"},
        {"content-type": "application/json; charset=latin-1"}, {"content-type": "\x7f"},
        {"authorization": "Bearer"}, {"authorization": "x" * 6000},
        {"x-request-id": "bad id with spaces"}, {"x-request-id": "r" * 4000},
        {"accept": "image/png"}, {"content-encoding": "gzip"}, {"expect": "100-continue"},
        {"x-request-id": "same-id"},
    ])
    if rng.random() < 0.5:
        raw_headers = rng.choice([
            "Content-Length: abc\r\n", "Content-Length: -5\r\n",
            f"Content-Length: {len(body) + 10}\r\nX-Short: 1\r\n",
            "Transfer-Encoding: chunked\r\n", "Content-Length: 5\r\nContent-Length: 6\r\n",
        ])
        request = (f"POST {path} HTTP/1.1\r\nHost: fuzz\r\nContent-Type: application/json\r\n"
                   f"{raw_headers}Connection: close\r\n\r\n").encode() + body
        return FuzzCase("bad_headers", path=path, raw=request)
    return FuzzCase("bad_headers", path=path, body=body, headers=headers)


def wrong_method(rng: random.Random) -> FuzzCase:
    if rng.random() < 0.6:
        method = rng.choice(["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])
        return FuzzCase("wrong_method", method=method, path=rng.choice(API_PATHS),
                        body=b"{}" if method in ("PUT", "PATCH") else None)
    return FuzzCase("wrong_method", method=rng.choice(["POST", "PUT", "DELETE"]),
                    path=rng.choice(GET_PATHS), body=b"{}")


def wrong_path(rng: random.Random) -> FuzzCase:
    path = rng.choice([
        "/v1/chat", "/v1/completions/", "//v1/models", "/v1/models/../../etc/passwd", "/%00",
        "/v1/%ff", "/" + "a" * 8000, "/v1/completions?x=" + "q" * 3000, "/v2/completions",
        "/v1/models/gemma", "/V1/COMPLETIONS", "/v1/embeddings", "/docs/../openapi.json",
    ])
    return FuzzCase("wrong_path", method=rng.choice(["GET", "POST"]), path=path, body=b"{}")


def raw_garbage(rng: random.Random) -> FuzzCase:
    raw = rng.choice([
        bytes(rng.randbytes(rng.randint(1, 300))), b"GET\r\n\r\n", b"GET /health\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost x\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: a\r\nX: \x00\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: a\r\nX-Long: " + b"l" * 100_000 + b"\r\n\r\n",
        b"GET /health HTTP/9.9\r\n\r\n", b"\r\n\r\n\r\n", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    ])
    return FuzzCase("raw_garbage", raw=raw)


def valid_small(rng: random.Random) -> FuzzCase:
    path = rng.choice(API_PATHS)
    body = _valid_body(rng, path)
    if path != "/generate":
        body["n"] = rng.randint(1, 2)
    stream = rng.random() < 0.5
    body["stream"] = stream
    if stream and rng.random() < 0.5:
        body["max_tokens"] = 64
        body["ignore_eos"] = True
        return FuzzCase("abandoned_stream", path=path, body=_json(body), abandon_stream=True)
    return FuzzCase("valid_small", path=path, body=_json(body))


GENERATORS: tuple[tuple[Callable[[random.Random], FuzzCase], float], ...] = (
    (bad_json, 0.15), (wrong_types, 0.20), (absurd_values, 0.20), (huge_body, 0.02),
    (bad_headers, 0.12), (wrong_method, 0.10), (wrong_path, 0.08), (raw_garbage, 0.05),
    (valid_small, 0.08),
)


def build_cases(count: int, seed: int) -> list[FuzzCase]:
    rng = random.Random(seed)
    makers = [maker for maker, _ in GENERATORS]
    weights = [weight for _, weight in GENERATORS]
    return [rng.choices(makers, weights)[0](rng) for _ in range(count)]


# ---- sending ----

def _from_http_layer(response: httpx.Response) -> bool:
    """uvicorn's own answer to a request it cannot parse (a control byte in
    a header value): it never reaches the app, so it is not in the shape."""
    return (response.status_code == 400 and response.text == HTTP_LAYER_REJECTION
            and response.headers.get("content-type", "").startswith("text/plain"))


def _check_shape(case: FuzzCase, response: httpx.Response) -> str:
    if response.status_code >= 500:
        return f"{case.kind} {case.method} {case.path[:60]}: {response.status_code} {response.text[:200]}"
    if response.status_code >= 400 and case.method != "HEAD" and not _from_http_layer(response):
        try:
            error = response.json()["error"]
            if set(error) != ERROR_FIELDS:
                raise KeyError(sorted(error))
        except (ValueError, KeyError, TypeError):
            return (f"{case.kind} {case.method} {case.path[:60]}: {response.status_code} "
                    f"not in the error shape: {response.text[:200]}")
    return ""


def _chunks(body: bytes) -> Iterator[bytes]:
    for start in range(0, len(body), 65536):
        yield body[start:start + 65536]


def send_http(case: FuzzCase, base_url: str, client: httpx.Client) -> Outcome:
    content: bytes | Iterator[bytes] | None = case.body
    if case.chunked and case.body is not None:
        content = _chunks(case.body)
    try:
        if case.abandon_stream:
            with client.stream(case.method, f"{base_url}{case.path}", content=content,
                               headers=case.headers) as response:
                for _line in response.iter_lines():
                    break  # read one line, then hang up mid-stream
                return Outcome(case.kind, response.status_code,
                               "" if response.status_code < 500 else f"{case.kind}: {response.status_code}")
        response = client.request(case.method, f"{base_url}{case.path}", content=content,
                                  headers=case.headers)
    except (httpx.RemoteProtocolError, httpx.WriteError, httpx.ReadError) as error:
        # The server may answer a huge body and close before it is all sent.
        if case.kind == "huge_body":
            return Outcome(case.kind, None)
        return Outcome(case.kind, None, f"{case.kind} {case.path[:60]}: {type(error).__name__}")
    return Outcome(case.kind, response.status_code, _check_shape(case, response))


def send_raw(case: FuzzCase, host: str, port: int, timeout_s: float = 5.0) -> Outcome:
    """Writes bytes that no HTTP client would send; the answer (if any) comes
    from the HTTP server itself, so only its status is checked."""
    assert case.raw is not None
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        try:
            sock.sendall(case.raw)
            sock.shutdown(socket.SHUT_WR)
            reply = b""
            while len(reply) < 64:
                data = sock.recv(4096)
                if not data:
                    break
                reply += data
        except (ConnectionError, TimeoutError, OSError):
            return Outcome(case.kind, None)
    parts = reply.split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        return Outcome(case.kind, None)
    status = int(parts[1])
    problem = f"{case.kind} raw {case.raw[:60]!r}: {status}" if status >= 500 else ""
    return Outcome(case.kind, status, problem)


def well_formed_stream(base_url: str, max_tokens: int) -> StreamResult:
    body = {"model": "m", "messages": [{"role": "user", "content": "Tell me about the sea."}],
            "max_tokens": max_tokens, "temperature": 0.7, "seed": 5, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    events: list[str] = []
    try:
        with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body,
                          timeout=120) as response:
            if response.status_code != 200:
                return StreamResult(False, f"status {response.status_code}: {response.read()[:200]!r}")
            events = [line[len("data: "):] for line in response.iter_lines()
                      if line.startswith("data: ")]
    except httpx.HTTPError as error:
        return StreamResult(False, f"{type(error).__name__}: {error}")
    if not events or events[-1] != "[DONE]":
        return StreamResult(False, f"no [DONE] after {len(events)} events")
    chunks = [json.loads(event) for event in events[:-1]]
    usage = chunks[-1].get("usage") or {}
    finishes = [choice["finish_reason"] for chunk in chunks for choice in chunk["choices"]
                if choice.get("finish_reason")]
    if finishes != ["length"] or usage.get("completion_tokens") != max_tokens:
        return StreamResult(False, f"finish {finishes}, usage {usage}")
    return StreamResult(True, f"{max_tokens} tokens")


def run_fuzz(base_url: str, requests: int, threads: int = 8, seed: int = 0,
             stream_tokens: int = 48) -> FuzzReport:
    """Sends `requests` fuzz cases from `threads` threads; meanwhile one
    well-formed stream after another runs until the flood is over."""
    cases = build_cases(requests, seed)
    split = urlsplit(base_url)
    host, port = split.hostname or "127.0.0.1", split.port or 80
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    next_index = iter(range(len(cases)))
    streams: list[StreamResult] = []
    flood_done = threading.Event()

    def worker() -> None:
        with httpx.Client(timeout=30) as client:
            while True:
                with lock:
                    index = next(next_index, None)
                if index is None:
                    return
                case = cases[index]
                if case.raw is not None:
                    outcome = send_raw(case, host, port)
                else:
                    outcome = send_http(case, base_url, client)
                with lock:
                    outcomes.append(outcome)

    def streamer() -> None:
        while True:
            streams.append(well_formed_stream(base_url, stream_tokens))
            if flood_done.is_set():
                return

    started = time.perf_counter()
    stream_thread = threading.Thread(target=streamer, daemon=True)
    stream_thread.start()
    pool = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    flood_done.set()
    stream_thread.join(timeout=120)
    seconds = time.perf_counter() - started
    statuses: Counter[int | None] = Counter(outcome.status for outcome in outcomes)
    by_kind: dict[str, Counter[int | None]] = {}
    for outcome in outcomes:
        by_kind.setdefault(outcome.kind, Counter())[outcome.status] += 1
    problems = [outcome.problem for outcome in outcomes if outcome.problem]
    return FuzzReport(len(outcomes), seconds, statuses, by_kind, problems, streams)


# ---- command line ----

def _tiny_stack(log_dir: Path) -> Any:
    from scripts.stack import Stack, StackPorts
    from tests.fixtures.tiny_model import save_tiny_model

    model_dir = save_tiny_model(log_dir / "tiny-model")
    env = {"MODEL_NAME": str(model_dir), "KV_CACHE_BLOCK_SIZE": "4", "KV_CACHE_NUM_BLOCKS": "512",
           "MAX_BATCH_SIZE": "8", "PREFILL_CHUNK_SIZE": "16", "TORCH_THREADS": "1",
           "LOG_LEVEL": "warning"}
    return Stack(ports=StackPorts.free(1), env=env, log_dir=log_dir / "logs").start(timeout_s=180)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway's base URL")
    parser.add_argument("--tiny-stack", action="store_true",
                        help="start a stack on a tiny random-weight model and fuzz that")
    parser.add_argument("--requests", type=int, default=10000)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stream-tokens", type=int, default=48,
                        help="tokens per concurrent well-formed stream")
    args = parser.parse_args()
    stack = None
    url = args.url
    if args.tiny_stack:
        stack = _tiny_stack(Path(tempfile.mkdtemp(prefix="fuzz-gateway-")))
        url = stack.url
    try:
        report = run_fuzz(url, args.requests, args.threads, args.seed, args.stream_tokens)
        alive = httpx.get(f"{url}/health", timeout=10).status_code
    finally:
        if stack is not None:
            stack.stop()
    print(report.summary())
    print(f"health after the flood: {alive}")
    raise SystemExit(0 if report.ok and alive == 200 else 1)


if __name__ == "__main__":
    main()
