"""The fuzz cases of benchmarks.fuzz_gateway: broken JSON, wrong types,
absurd values, bodies over the size limit, odd headers, wrong methods and
paths, raw bytes that are not HTTP, a few small valid requests (some
abandoned mid-stream), and with API keys set, requests with a missing, wrong
or malformed key."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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
    authenticated: bool = True  # with an API key set, the sender adds it


# ---- the cases ----

def _valid_body(rng: random.Random, path: str) -> dict[str, Any]:
    # No `model`: left out, it is the base model whatever SERVED_MODEL_NAME says (wrong_types
    # still sends junk ones, which are 404s).
    if path == "/v1/chat/completions":
        return {"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": rng.randint(1, 4)}
    if path == "/generate":
        return {"prompt": "Hello", "max_tokens": rng.randint(1, 4), "stream": False}
    return {"prompt": "Hello", "max_tokens": rng.randint(1, 4)}


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


def bad_auth(rng: random.Random) -> FuzzCase:
    """With API keys set: no key, a wrong one, or bytes no key is made of
    (>= 0x80, control characters: sent raw, as no client library would)."""
    path = rng.choice(API_PATHS)
    body = _json(_valid_body(rng, path))
    if rng.random() < 0.5:
        headers = rng.choice([{}, {"authorization": "Bearer wrong-key"}, {"x-api-key": "nope"},
                              {"authorization": "Basic abc"}, {"authorization": "Bearer"}])
        return FuzzCase("bad_auth", path=path, body=body, headers=headers, authenticated=False)
    noise = bytes(rng.randbytes(16)).replace(b"\r", b"").replace(b"\n", b"")
    value = rng.choice([b"Bearer \xff\xfe\xfd", b"Bearer k\x80ey", b"\xc3\xa9\xc3\xa9",
                        b"Bearer " + noise])
    request = (f"POST {path} HTTP/1.1\r\nHost: fuzz\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\nConnection: close\r\n").encode()
    return FuzzCase("bad_auth", path=path, raw=request + b"Authorization: " + value + b"\r\n\r\n"
                    + body, authenticated=False)


GENERATORS: tuple[tuple[Callable[[random.Random], FuzzCase], float], ...] = (
    (bad_json, 0.15), (wrong_types, 0.20), (absurd_values, 0.20), (huge_body, 0.02),
    (bad_headers, 0.12), (wrong_method, 0.10), (wrong_path, 0.08), (raw_garbage, 0.05),
    (valid_small, 0.08),
)
KEYED_GENERATORS = (*GENERATORS, (bad_auth, 0.06))


def build_cases(count: int, seed: int, keyed: bool = False) -> list[FuzzCase]:
    """`keyed`: the gateway has API keys, and some cases present a bad one."""
    rng = random.Random(seed)
    generators = KEYED_GENERATORS if keyed else GENERATORS
    makers = [maker for maker, _ in generators]
    weights = [weight for _, weight in generators]
    return [rng.choices(makers, weights)[0](rng) for _ in range(count)]


def with_key(case: FuzzCase, api_key: str) -> FuzzCase:
    """The case as sent to a gateway with API keys: every authenticated case
    presents the key, raw ones in a header line after the request line."""
    if not api_key or not case.authenticated:
        return case
    if case.raw is not None:
        line_end = case.raw.find(b"\r\n")
        if line_end > 0 and b" HTTP/1.1" in case.raw[:line_end]:
            header = f"\r\nAuthorization: Bearer {api_key}".encode()
            case.raw = case.raw[:line_end] + header + case.raw[line_end:]
        return case
    if not any(name.lower() in ("authorization", "x-api-key") for name in case.headers):
        case.headers = {**case.headers, "authorization": f"Bearer {api_key}"}
    return case
