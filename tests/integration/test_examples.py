"""Every script in examples/ run as a user would (its own process, the
documented environment variables) against a real stack on free ports (tiny
random model, two tenants' keys, a token budget for the second): each exits 0
and prints what it says it does. The model's words are noise; what holds
whatever the model (a schema, a regex, a forced tool call, status codes,
counts) is checked."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fairserve.launcher.stack import Stack
from tests.integration.conftest import start_stack

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
KEYS = {"alice": "sk-example-alice", "bob": "sk-example-bob"}
TESTED = {"openai_chat_stream.py", "structured_output.py", "tool_calls.py", "grpc_client.py",
          "tenants.py", "long_context.py"}


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("examples")
    tenants = tmp / "tenants.json"
    tenants.write_text(json.dumps({"tenants": {"bob": {"tokens_per_minute": 200}}}))
    stack = start_stack(tmp, tiny_model_dir, extra_env={
        "API_KEYS": ",".join(f"{name}={key}" for name, key in KEYS.items()), "TENANTS_FILE": str(tenants)})
    yield stack
    stack.stop()


def run_example(stack: Stack, name: str, **env: str) -> str:
    environment = {**os.environ, "FAIRSERVE_URL": stack.url, "FAIRSERVE_API_KEY": KEYS["alice"],
                   "FAIRSERVE_GRPC_ADDR": f"127.0.0.1:{stack.ports.gateway_grpc}", **env}
    done = subprocess.run([sys.executable, str(EXAMPLES / name)], env=environment, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{name} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def line(output: str, prefix: str) -> str:
    found = [text for text in output.splitlines() if text.startswith(prefix)]
    assert found, f"no line starting {prefix!r} in:\n{output}"
    return found[0][len(prefix):].strip()


def test_every_example_is_run_here_and_says_how_to_run_it() -> None:
    assert {path.name for path in EXAMPLES.glob("*.py")} == TESTED
    for name in TESTED:
        assert f"python examples/{name}" in (EXAMPLES / name).read_text(), name


def test_openai_chat_stream(stack: Stack) -> None:
    output = run_example(stack, "openai_chat_stream.py", OPENAI_BASE_URL=f"{stack.url}/v1",
                         OPENAI_API_KEY=KEYS["alice"])
    assert re.search(r"\[\d+ prompt \+ \d+ completion tokens\]", output), output


def test_structured_output(stack: Stack) -> None:
    output = run_example(stack, "structured_output.py")
    city = json.loads(line(output, "json_schema:"))
    assert set(city) == {"name", "country", "population_thousands", "coastal"}, city
    assert isinstance(city["coastal"], bool) and 0 <= city["population_thousands"] <= 40000
    assert re.fullmatch(r"20\d\d-\d\d-\d\d", line(output, "guided_regex:")), output


def test_tool_calls(stack: Stack) -> None:
    output = run_example(stack, "tool_calls.py")
    assert line(output, "finish_reason:") == "tool_calls"
    call = re.fullmatch(r"get_weather\((\{.*\})\) id=(\S+)", line(output, "tool call:"))
    assert call, output
    arguments = json.loads(call.group(1))
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
    assert line(output, "tool result:").startswith("18 degrees")
    assert "answer:" in output


def test_grpc_client(stack: Stack) -> None:
    output = run_example(stack, "grpc_client.py")
    finished = re.findall(r"finish_reason=(\w+) .*completion_tokens=(\d+)", output)
    assert len(finished) == 2, output            # Generate, then GenerateStream
    for reason, tokens in finished:
        assert reason in ("length", "stop") and 0 < int(tokens) <= 32, output


def test_grpc_client_without_a_key_names_the_status(stack: Stack) -> None:
    environment = {**os.environ, "FAIRSERVE_GRPC_ADDR": f"127.0.0.1:{stack.ports.gateway_grpc}"}
    environment.pop("FAIRSERVE_API_KEY", None)
    done = subprocess.run([sys.executable, str(EXAMPLES / "grpc_client.py")], env=environment,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "gRPC error UNAUTHENTICATED" in done.stderr, done.stderr


def test_tenants(stack: Stack) -> None:
    output = run_example(stack, "tenants.py", FAIRSERVE_OTHER_API_KEY=KEYS["bob"])
    assert line(output, "no key:") == "401"
    assert line(output, "first tenant:").endswith("tenants in its /stats=['alice']"), output
    assert line(output, "second tenant:").endswith("tenants in its /stats=['bob']"), output
    refusal = re.search(r"second tenant, request \d+: 429 tenant_quota_exceeded: .*200 tokens a minute", output)
    assert refusal, output
    assert KEYS["bob"] not in output and KEYS["alice"] not in output
    assert line(output, "first tenant meanwhile:") == "200"


def test_long_context(stack: Stack) -> None:
    output = run_example(stack, "long_context.py")
    sizes = re.fullmatch(r"(\d+) tokens; prompt: (\d+) tokens", line(output, "model context:"))
    assert sizes and int(sizes.group(2)) > int(sizes.group(1)), output
    assert line(output, "kv_policy=full:").startswith("400 "), output
    served = re.fullmatch(r"200 finish_reason=\w+ prompt_tokens=(\d+) completion_tokens=(\d+)",
                          line(output, "kv_policy=sink:"))
    assert served and int(served.group(1)) == int(sizes.group(2)), output
