"""Robustness of the gateway's gRPC text API: random and absurd TextRequest
fields, bytes that are no TextRequest (random, truncated, bit-flipped,
invalid UTF-8 in a string field), messages over the size limit, and calls
with a missing or wrong API key, sent from several threads. No call may end
in a server-side failure (INTERNAL, UNKNOWN, DATA_LOSS), and every call of
the valid kind must succeed.

Run through benchmarks.fuzz_gateway (`--grpc-target host:port`).
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from fairserve.v1 import common_pb2, gateway_pb2

SERVICE = "/fairserve.v1.TextGeneration/"
SERVER_FAILURES = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS}
OVER_LIMIT_BYTES = 4 * 1024 * 1024 + 64  # past the default GATEWAY_GRPC_MAX_MESSAGE_BYTES
INT32 = (0, 1, -1, 3, 2**31 - 1, -2**31, 5000)
FLOATS = (0.0, 0.5, 1.0, -1.0, 2.5, 1e30, -1e30, float("nan"), float("inf"), float("-inf"))
TEXTS = ("", "Hi", "x" * 300, "東京 🙂", "\x00\x01", "a" * 5000, "<start_of_turn>user")


@dataclass
class GrpcCase:
    kind: str
    method: str = "Generate"
    payload: bytes = b""
    metadata: tuple[tuple[str, str], ...] = ()


@dataclass
class GrpcReport:
    calls: int
    seconds: float
    codes: Counter[str]
    by_kind: dict[str, Counter[str]]
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and self.calls > 0

    def summary(self) -> str:
        lines = [f"{self.calls} gRPC calls in {self.seconds:.1f} s",
                 f"codes: {dict(sorted(self.codes.items()))}",
                 f"problems: {len(self.problems)}"]
        lines += [f"  {kind}: {dict(counts)}" for kind, counts in sorted(self.by_kind.items())]
        lines += [f"  problem: {problem}" for problem in self.problems[:20]]
        return "\n".join(lines)


def _some(rng: random.Random, values: dict[str, Any], odds: float = 0.3) -> dict[str, Any]:
    """Each field set with probability `odds` (else left unset)."""
    return {name: value for name, value in values.items() if rng.random() < odds}


def random_sampling(rng: random.Random) -> common_pb2.SamplingParams:
    sampling = common_pb2.SamplingParams(**_some(rng, {
        "temperature": rng.choice(FLOATS), "top_p": rng.choice(FLOATS),
        "top_k": rng.choice(INT32), "min_p": rng.choice(FLOATS),
        "repetition_penalty": rng.choice(FLOATS), "presence_penalty": rng.choice(FLOATS),
        "frequency_penalty": rng.choice(FLOATS), "top_logprobs": rng.choice(INT32),
        "logprobs": rng.random() < 0.5, "min_tokens": rng.choice(INT32),
        "stop_token_ids": rng.sample(INT32, rng.randint(0, 2))}, odds=0.2))
    if rng.random() < 0.3:
        sampling.seed = rng.choice((0, 7, 2**63 - 1, 2**63, 2**64 - 1))
    return sampling


def random_request(rng: random.Random) -> gateway_pb2.TextRequest:
    """A small valid request with a few fields made random, most of them
    absurd; max_tokens stays small unless it is one of those, so accepted
    requests cost little generation."""
    fields: dict[str, Any] = {"prompt": "Hello", "max_tokens": rng.randint(1, 3)}
    fields.update(_some(rng, {
        "prompt": rng.choice(TEXTS), "max_tokens": rng.choice(INT32),
        "stop": rng.sample(TEXTS, rng.randint(0, 3)) * rng.choice((1, 1, 20)),
        "raw": rng.random() < 0.5, "session_id": rng.choice(TEXTS), "priority": rng.choice(INT32),
        "user": rng.choice(TEXTS), "ignore_eos": rng.random() < 0.2,
        "min_tokens": rng.choice(INT32)}, odds=0.2))
    request = gateway_pb2.TextRequest(**fields)
    if rng.random() < 0.5:
        request.sampling.CopyFrom(random_sampling(rng))
    return request


def malformed_bytes(rng: random.Random) -> bytes:
    valid = random_request(rng).SerializeToString()
    flipped = bytearray(valid or b"\x0a\x02Hi")
    for _ in range(rng.randint(1, 4)):
        flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
    return rng.choice([
        bytes(rng.randbytes(rng.randint(1, 200))), valid[:rng.randint(0, max(0, len(valid) - 1))],
        bytes(flipped), b"\x0a\x02\xed\xa0",                 # prompt: a UTF-8 surrogate
        b"\x0a\x04\xff\xfe\xfd\xfc", b"\x42\x03\xc3\x28\x41",  # invalid UTF-8 in prompt, user
        b"\x0a\xff\xff\xff\xff\x0f", b"\x10" + b"\xff" * 11,  # lengths and varints past the end
    ])


def _key_metadata(api_key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def build_grpc_cases(count: int, seed: int, api_key: str = "") -> list[GrpcCase]:
    rng = random.Random(seed)
    key = _key_metadata(api_key)
    makers: list[tuple[Callable[[], GrpcCase], float]] = [
        (lambda: GrpcCase("random_fields", payload=random_request(rng).SerializeToString(),
                          metadata=key), 0.5),
        (lambda: GrpcCase("malformed", payload=malformed_bytes(rng), metadata=key), 0.3),
        (lambda: GrpcCase("over_limit", payload=gateway_pb2.TextRequest(
            prompt="z" * OVER_LIMIT_BYTES).SerializeToString(), metadata=key), 0.01),
        (lambda: GrpcCase("valid", payload=gateway_pb2.TextRequest(
            prompt="Hello", max_tokens=rng.randint(1, 3)).SerializeToString(), metadata=key), 0.1),
    ]
    if api_key:
        wrong = rng.choice((("authorization", "Bearer wrong"), ("x-api-key", api_key + "x"),
                            ("authorization", api_key), ("authorization", "Bearer")))
        makers.append((lambda: GrpcCase("bad_key", payload=gateway_pb2.TextRequest(
            prompt="Hi", max_tokens=1).SerializeToString(),
            metadata=rng.choice(((), (wrong,)))), 0.09))
    generators = [maker for maker, _ in makers]
    weights = [weight for _, weight in makers]
    cases = [rng.choices(generators, weights)[0]() for _ in range(count)]
    for case in cases:
        case.method = rng.choice(("Generate", "GenerateStream"))
    return cases


def _identity(raw: bytes) -> bytes:
    return raw


def send_grpc(case: GrpcCase, channel: grpc.Channel, timeout_s: float = 60) -> tuple[str, str]:
    """(the status code's name, a problem or "")."""
    try:
        if case.method == "Generate":
            call = channel.unary_unary(SERVICE + "Generate", request_serializer=_identity,
                                       response_deserializer=_identity)
            call(case.payload, metadata=case.metadata, timeout=timeout_s)
        else:
            call_stream = channel.unary_stream(SERVICE + "GenerateStream",
                                               request_serializer=_identity,
                                               response_deserializer=_identity)
            for _chunk in call_stream(case.payload, metadata=case.metadata, timeout=timeout_s):
                pass
    except grpc.RpcError as error:
        code: Any = error.code()  # type: ignore[attr-defined]
        problem = ""
        if code in SERVER_FAILURES or case.kind == "valid":
            problem = f"{case.kind} {case.method}: {code.name} {error.details()!r:.200}"  # type: ignore[attr-defined]
        return code.name, problem
    return "OK", ""


def run_grpc_fuzz(target: str, requests: int, threads: int = 4, seed: int = 0,
                  api_key: str = "") -> GrpcReport:
    cases = build_grpc_cases(requests, seed, api_key)
    results: list[tuple[str, str, str]] = []
    lock = threading.Lock()
    pending = iter(range(len(cases)))
    options = [("grpc.max_send_message_length", 64 * 1024 * 1024)]

    def worker() -> None:
        with grpc.insecure_channel(target, options=options) as channel:
            while True:
                with lock:
                    index = next(pending, None)
                if index is None:
                    return
                code, problem = send_grpc(cases[index], channel)
                with lock:
                    results.append((cases[index].kind, code, problem))

    started = time.perf_counter()
    pool = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    by_kind: dict[str, Counter[str]] = {}
    for kind, code, _problem in results:
        by_kind.setdefault(kind, Counter())[code] += 1
    return GrpcReport(len(results), time.perf_counter() - started,
                      Counter(code for _kind, code, _problem in results), by_kind,
                      [problem for _kind, _code, problem in results if problem])
