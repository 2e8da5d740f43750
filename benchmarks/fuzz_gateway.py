"""Robustness: floods a running gateway with malformed and absurd requests
from several threads while well-formed chat streams run alongside, and
reports every status it got. No request may get a 5xx, and every stream
must complete.

    python -m benchmarks.fuzz_gateway --url http://127.0.0.1:8000 --requests 10000
    python -m benchmarks.fuzz_gateway --tiny-stack --requests 10000   # starts its own tiny stack

    python -m benchmarks.fuzz_gateway --tiny-stack --api-key sk-fuzz --grpc --requests 10000

The mix is in benchmarks/fuzz_cases.py. With --api-key (the gateway's
API_KEYS holds it) every case presents the key but those testing a missing,
wrong or malformed one, which must get 401. With --grpc-target (or --grpc
and --tiny-stack), the gRPC text API is fuzzed afterwards
(benchmarks/fuzz_grpc.py).
"""

from __future__ import annotations

import argparse
import json
import socket
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from benchmarks.fuzz_cases import FuzzCase, build_cases, with_key

ERROR_FIELDS = {"message", "type", "param", "code"}
HTTP_LAYER_REJECTION = "Invalid HTTP request received."


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


# ---- sending ----

def _from_http_layer(response: httpx.Response) -> bool:
    """uvicorn's own answer to a request it cannot parse (a control byte in
    a header value): it never reaches the app, so it is not in the shape."""
    return (response.status_code == 400 and response.text == HTTP_LAYER_REJECTION
            and response.headers.get("content-type", "").startswith("text/plain"))


def _check_shape(case: FuzzCase, response: httpx.Response) -> str:
    if not case.authenticated and response.status_code != 401:
        return f"{case.kind} {case.headers}: {response.status_code}, not 401"
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
    # A header with control bytes is refused by the HTTP server itself (400).
    refused = status in (400, 401) if not case.authenticated else status < 500
    problem = "" if refused else f"{case.kind} raw {case.raw[:60]!r}: {status}"
    return Outcome(case.kind, status, problem)


def well_formed_stream(base_url: str, max_tokens: int, api_key: str = "") -> StreamResult:
    body = {"messages": [{"role": "user", "content": "Tell me about the sea."}],   # no model: the base
            "max_tokens": max_tokens, "temperature": 0.7, "seed": 5, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    events: list[str] = []
    try:
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, headers=headers,
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
             stream_tokens: int = 48, api_key: str = "") -> FuzzReport:
    """Sends `requests` fuzz cases (with `api_key`, to a gateway requiring it) from `threads`
    threads; meanwhile one well-formed stream after another runs until the flood is over."""
    cases = [with_key(case, api_key) for case in build_cases(requests, seed, keyed=bool(api_key))]
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
            streams.append(well_formed_stream(base_url, stream_tokens, api_key))
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
    return _report(outcomes, time.perf_counter() - started, streams)


def _report(outcomes: list[Outcome], seconds: float, streams: list[StreamResult]) -> FuzzReport:
    statuses: Counter[int | None] = Counter(outcome.status for outcome in outcomes)
    by_kind: dict[str, Counter[int | None]] = {}
    for outcome in outcomes:
        by_kind.setdefault(outcome.kind, Counter())[outcome.status] += 1
    problems = [outcome.problem for outcome in outcomes if outcome.problem]
    return FuzzReport(len(outcomes), seconds, statuses, by_kind, problems, streams)


# ---- command line ----

def _tiny_stack(log_dir: Path, api_key: str) -> Any:
    from fairserve.launcher.stack import Stack, StackPorts
    from tests.fixtures.tiny_model import save_tiny_model

    model_dir = save_tiny_model(log_dir / "tiny-model")
    env = {"MODEL_NAME": str(model_dir), "KV_CACHE_BLOCK_SIZE": "4", "KV_CACHE_NUM_BLOCKS": "512",
           "MAX_BATCH_SIZE": "8", "PREFILL_CHUNK_SIZE": "16", "TORCH_THREADS": "1",
           "LOG_LEVEL": "warning", **({"API_KEYS": f"fuzz={api_key}"} if api_key else {})}
    return Stack(ports=StackPorts.free(1), env=env, log_dir=log_dir / "logs").start(timeout_s=180)


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway's base URL")
    parser.add_argument("--tiny-stack", action="store_true",
                        help="start a stack on a tiny random-weight model and fuzz that")
    parser.add_argument("--requests", type=int, default=10000)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stream-tokens", type=int, default=48,
                        help="tokens per concurrent well-formed stream")
    parser.add_argument("--api-key", default="",
                        help="a key the gateway's API_KEYS holds (with --tiny-stack: its only one)")
    parser.add_argument("--grpc-target", default="",
                        help="host:port of the gateway's gRPC text API, fuzzed after HTTP")
    parser.add_argument("--grpc", action="store_true",
                        help="with --tiny-stack: fuzz its gRPC text API too")
    return parser.parse_args()


def main() -> None:
    args = _arguments()
    stack = None
    url, grpc_target = args.url, args.grpc_target
    if args.tiny_stack:
        stack = _tiny_stack(Path(tempfile.mkdtemp(prefix="fuzz-gateway-")), args.api_key)
        url = stack.url
        if args.grpc:
            grpc_target = f"127.0.0.1:{stack.ports.gateway_grpc}"
    try:
        report = run_fuzz(url, args.requests, args.threads, args.seed, args.stream_tokens,
                          args.api_key)
        grpc_report = None
        if grpc_target:
            from benchmarks.fuzz_grpc import run_grpc_fuzz

            grpc_report = run_grpc_fuzz(grpc_target, args.requests, args.threads, args.seed,
                                        args.api_key)
        alive = httpx.get(f"{url}/health", timeout=10).status_code
    finally:
        if stack is not None:
            stack.stop()
    print(report.summary())
    if grpc_report is not None:
        print(grpc_report.summary())
    print(f"health after the flood: {alive}")
    ok = report.ok and (grpc_report is None or grpc_report.ok) and alive == 200
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
